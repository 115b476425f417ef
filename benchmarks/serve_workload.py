"""What `serve_bench.py` sends: single requests at their arrival times, or multi-turn sessions (issue 17).

Sources of requests (each gives arrival times and prompt/output lengths; prompts are token ids, so the router's
tokenizer plays no part and equal ids mean equal KV blocks):

- **poisson**: `num_requests` arrivals at `rate` per second, exponential gaps; prompt and output lengths uniform in
  `[len * (1 - range_ratio), len * (1 + range_ratio)]` (vLLM's random dataset). `long_fraction` > 0 makes the
  prefill-heavy mix of the disaggregation comparison: that share of requests has a `long_input_len` prompt and a
  `long_output_len` output, the rest `input_len` / `output_len`.
- **mooncake**: a Mooncake-format trace (`mooncake_trace.py`): each 512-token hash id becomes `tokens_per_id`
  deterministic token ids (a multiple of the engine's block size, so equal ids give equal engine blocks), lengths
  scaled by tokens_per_id / 512, arrival times scaled by `time_scale`.
- **azure**: an Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens): its times and lengths
  (scaled by `length_scale`), fresh random prompts (the trace has no content).
- **sessions**: `sessions` conversations starting at Poisson times, each of `turns` turns sent one after the other:
  turn t's prompt is its system prompt (one of `system_prompts`, shared across sessions) + every earlier user message
  and reply (the reply's real token ids, filled in while the run goes) + a new `user_tokens` message.

Every prompt is clipped so prompt + output fits `max_model_len`.
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from mooncake_trace import DATA, TRACE_BLOCK, find_trace, load_trace  # beside this script

AZURE_TRACES = {"azure-code": DATA / "azure2023_AzureLLMInferenceTrace_code.csv",
                "azure-conv": DATA / "azure2023_AzureLLMInferenceTrace_conv.csv"}
TRACES = ("mooncake", *AZURE_TRACES)
FIRST_TOKEN = 3  # below it: the bundled tokenizer's special tokens


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload. `source`: poisson, mooncake, azure-code, azure-conv or a trace file path; `sessions` > 0
    replaces single requests by conversations (their starts Poisson at `rate`)."""

    source: str = "poisson"
    rate: float = 4.0
    num_requests: int = 100
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    long_fraction: float = 0.0
    long_input_len: int = 1024
    long_output_len: int = 8
    time_scale: float = 1.0
    tokens_per_id: int = 16
    length_scale: float = 0.25
    trace_offset: int = 0
    sessions: int = 0
    turns: int = 4
    system_prompt_tokens: int = 256
    system_prompts: int = 1
    user_tokens: int = 64
    think_time_s: float = 0.0
    max_model_len: int = 2048
    vocab: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.source in ("poisson", *TRACES) or Path(self.source).is_file(),
                 f"source must be poisson, one of {TRACES} or a trace file, got {self.source!r}")
        _require(self.rate > 0, f"rate must be > 0 per second, got {self.rate}")
        _require(self.num_requests >= 1, f"num_requests must be >= 1, got {self.num_requests}")
        _require(0 <= self.range_ratio < 1, f"range_ratio must be in [0, 1), got {self.range_ratio}")
        _require(0 <= self.long_fraction <= 1, f"long_fraction must be in [0, 1], got {self.long_fraction}")
        _require(min(self.input_len, self.output_len, self.long_input_len, self.long_output_len) >= 1,
                 "input_len, output_len, long_input_len and long_output_len must be >= 1 token")
        _require(self.time_scale > 0 and self.length_scale > 0, "time_scale and length_scale must be > 0")
        _require(self.tokens_per_id >= 1, f"tokens_per_id must be >= 1, got {self.tokens_per_id}")
        _require(self.sessions >= 0 and self.turns >= 1 and self.system_prompts >= 1,
                 "sessions must be >= 0, turns and system_prompts >= 1")
        history = self.system_prompt_tokens + self.turns * (self.user_tokens + self.output_len)
        _require(self.sessions == 0 or history < self.max_model_len,
                 f"a session's last turn needs system_prompt_tokens + turns * (user_tokens + output_len) = "
                 f"{history} < max_model_len = {self.max_model_len} tokens")

    @property
    def total_requests(self) -> int:
        return self.sessions * self.turns if self.sessions else self.num_requests


@dataclass(frozen=True)
class RequestSpec:
    """One request: sent `arrival_s` after the run starts."""

    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Session:
    """One conversation: turns go one after the other; `history` grows by each user message and reply."""

    start_s: float
    system: tuple[int, ...]
    user_messages: list[tuple[int, ...]]
    max_tokens: int
    think_time_s: float
    history: list[int] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        return [*self.system, *self.history, *self.user_messages[turn]]

    def add_turn(self, turn: int, reply: list[int]) -> None:
        self.history += [*self.user_messages[turn], *reply]


@dataclass(frozen=True)
class Workload:
    requests: tuple[RequestSpec, ...]
    sessions: tuple[Session, ...]
    description: str

    @property
    def size(self) -> int:
        return len(self.requests) + sum(len(s.user_messages) for s in self.sessions)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------------- building

def build(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    if spec.sessions:
        return _sessions(spec, rng)
    if spec.source == "poisson":
        return _poisson(spec, rng)
    if spec.source in AZURE_TRACES or spec.source.endswith(".csv"):
        return _azure(spec, rng, AZURE_TRACES.get(spec.source, Path(spec.source)))
    return _mooncake(spec, None if spec.source == "mooncake" else spec.source)


def random_tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN, vocab) for _ in range(n))


def poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))


def _clipped(spec: WorkloadSpec, prompt: tuple[int, ...], max_tokens: int) -> tuple[tuple[int, ...], int]:
    """(prompt, max_tokens) with prompt + output <= max_model_len: the prompt is cut, never the output below 1."""
    max_tokens = max(1, min(max_tokens, spec.max_model_len // 2))
    return prompt[:spec.max_model_len - max_tokens], max_tokens


def _poisson(spec: WorkloadSpec, rng: random.Random) -> Workload:
    requests = []
    for t in poisson_times(rng, spec.num_requests, spec.rate):
        long = rng.random() < spec.long_fraction
        n_in = _length(rng, spec.long_input_len if long else spec.input_len, spec.range_ratio)
        n_out = _length(rng, spec.long_output_len if long else spec.output_len, spec.range_ratio)
        requests.append(RequestSpec(t, *_clipped(spec, random_tokens(rng, n_in, spec.vocab), n_out)))
    mix = (f"{spec.long_fraction:.0%} long ({spec.long_input_len} in / {spec.long_output_len} out), rest "
           if spec.long_fraction else "")
    return Workload(tuple(requests), (), f"poisson {spec.rate:g}/s, {spec.num_requests} requests, {mix}"
                                         f"{spec.input_len} in / {spec.output_len} out")


def id_tokens(hash_id: int, n: int, vocab: int) -> tuple[int, ...]:
    """The token block of one trace hash id: the same id always gives the same tokens."""
    return random_tokens(random.Random(hash_id * 1_000_003 + 17), n, vocab)


def _mooncake(spec: WorkloadSpec, path: str | None) -> Workload:
    trace = load_trace(find_trace(path), limit=spec.trace_offset + spec.num_requests)[spec.trace_offset:]
    t0, scale = trace[0].ts_s, spec.tokens_per_id / TRACE_BLOCK
    requests = []
    for r in trace:
        n_in = max(1, round(r.input_length * scale))
        ids = r.hash_ids[:-(-n_in // spec.tokens_per_id)]
        prompt = tuple(t for h in ids for t in id_tokens(h, spec.tokens_per_id, spec.vocab))[:n_in]
        requests.append(RequestSpec((r.ts_s - t0) * spec.time_scale,
                                    *_clipped(spec, prompt, max(1, round(r.output_length * scale)))))
    return Workload(tuple(requests), (), f"mooncake trace, {len(requests)} requests from #{spec.trace_offset}, "
                                         f"{spec.tokens_per_id} tokens per 512-token id, time x{spec.time_scale:g}")


def _azure(spec: WorkloadSpec, rng: random.Random, path: Path) -> Workload:
    with path.open() as f:
        rows = list(csv.DictReader(f))[spec.trace_offset:spec.trace_offset + spec.num_requests]
    stamps = [_azure_time(r["TIMESTAMP"]) for r in rows]
    requests = []
    for r, ts in zip(rows, stamps):
        n_in = max(1, round(int(r["ContextTokens"]) * spec.length_scale))
        n_out = max(1, round(int(r["GeneratedTokens"]) * spec.length_scale))
        requests.append(RequestSpec((ts - stamps[0]) * spec.time_scale,
                                    *_clipped(spec, random_tokens(rng, n_in, spec.vocab), n_out)))
    return Workload(tuple(requests), (), f"{path.name}, {len(requests)} requests from #{spec.trace_offset}, "
                                         f"lengths x{spec.length_scale:g}, time x{spec.time_scale:g}")


def _azure_time(stamp: str) -> float:
    day, _, frac = stamp.partition(".")   # 7 fractional digits: more than datetime parses
    return datetime.strptime(day, "%Y-%m-%d %H:%M:%S").timestamp() + float(f"0.{frac or 0}")


def _sessions(spec: WorkloadSpec, rng: random.Random) -> Workload:
    systems = [random_tokens(rng, spec.system_prompt_tokens, spec.vocab) for _ in range(spec.system_prompts)]
    sessions = tuple(Session(start, systems[i % spec.system_prompts],
                             [random_tokens(rng, spec.user_tokens, spec.vocab) for _ in range(spec.turns)],
                             spec.output_len, spec.think_time_s)
                     for i, start in enumerate(poisson_times(rng, spec.sessions, spec.rate)))
    return Workload((), sessions, f"{spec.sessions} sessions x {spec.turns} turns starting at {spec.rate:g}/s, "
                                  f"{spec.system_prompts} shared {spec.system_prompt_tokens}-token system prompt(s), "
                                  f"{spec.user_tokens}-token user turns, {spec.output_len}-token replies")
