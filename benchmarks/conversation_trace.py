"""A synthetic multi-turn conversation trace in Mooncake format (`mooncake_trace.TraceRequest`), deterministic per seed.

The real conversation traces that `kv_aware` fell short on are not in this repository; this generates traffic of the
same shape. Every request starts with one shared system-prompt block; each session's history then grows turn by turn:

    turn 1 prompt = system + user_1
    turn t prompt = prompt_{t-1} + answer_{t-1} + user_t              (append-only, so old blocks stay equal)

    tokens  | system (512) | user_1 ......... | answer_1 | user_2 | answer_2 | user_3 |
    blocks  |      0       |  s,1  |  s,2  |  s,3  |  s,4  |  s,5  |  s,6  | fresh |
              every request  the session's full 512-token blocks              the partial last block

Block ids follow the Mooncake contract (equal id at a position = equal prefix through that block): a full block of a
session's history keeps its id across turns; a prompt's partial last block gets a fresh id (next turn it holds more
tokens). Sessions start as a Poisson process; the next turn arrives a think time (exponential) after the previous
one. Lengths are log-normal (medians below), capped so a prompt stays under `max_prompt_tokens`.

    python benchmarks/conversation_trace.py --out conv.jsonl      # write it as Mooncake JSONL
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

from mooncake_trace import TRACE_BLOCK, TraceRequest, dump_trace  # beside this script

SYSTEM_BLOCK_ID = 0  # the one block every request shares


@dataclass(frozen=True)
class ConversationConfig:
    """Defaults: 2,958 requests over 40 minutes (about 1.2 a second), mean prompt 9,313 tokens, mean answer 546."""

    sessions: int = 600
    session_rate_per_s: float = 0.5
    mean_turns: float = 5.0
    first_user_tokens: int = 4_000  # median: the first message often carries a document
    user_tokens: int = 300  # median of later messages
    answer_tokens: int = 400  # median
    sigma: float = 0.8  # log-normal shape of every length
    mean_think_s: float = 60.0
    max_prompt_tokens: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.mean_turns < 1:
            raise ValueError(f"sessions and mean_turns must be >= 1, got {self.sessions}, {self.mean_turns}")
        if min(self.session_rate_per_s, self.mean_think_s, self.sigma) <= 0:
            raise ValueError("session_rate_per_s, mean_think_s and sigma must be > 0")
        if min(self.first_user_tokens, self.user_tokens, self.answer_tokens) < 1:
            raise ValueError("first_user_tokens, user_tokens and answer_tokens must be >= 1")
        if self.max_prompt_tokens < 2 * TRACE_BLOCK:
            raise ValueError(f"max_prompt_tokens must be >= {2 * TRACE_BLOCK}, got {self.max_prompt_tokens}")


class _Ids:
    """Block ids: one per (session, full block position), a fresh one for every partial last block."""

    def __init__(self) -> None:
        self._next = itertools.count(SYSTEM_BLOCK_ID + 1)
        self._full: dict[tuple[int, int], int] = {}

    def chain(self, session: int, num_tokens: int) -> tuple[int, ...]:
        full, partial = divmod(num_tokens, TRACE_BLOCK)
        ids = [SYSTEM_BLOCK_ID] + [self._full_id(session, i) for i in range(1, full)]
        if partial:
            ids.append(next(self._next))
        return tuple(ids)

    def _full_id(self, session: int, position: int) -> int:
        key = (session, position)
        if key not in self._full:
            self._full[key] = next(self._next)
        return self._full[key]


def _length(rng: random.Random, median: int, sigma: float) -> int:
    return max(1, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def _turns(rng: random.Random, mean: float) -> int:
    """Geometric on 1, 2, ... with this mean."""
    if mean == 1:
        return 1
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean))


def _session(rng: random.Random, config: ConversationConfig, start_s: float) -> Iterator[tuple[float, int, int]]:
    """(arrival, prompt tokens, answer tokens) of each turn of one session."""
    turns = _turns(rng, config.mean_turns)
    prompt, ts = TRACE_BLOCK + _length(rng, config.first_user_tokens, config.sigma), start_s
    for _ in range(turns):
        if prompt > config.max_prompt_tokens:
            return
        answer = _length(rng, config.answer_tokens, config.sigma)
        yield ts, prompt, answer
        ts += rng.expovariate(1.0 / config.mean_think_s)
        prompt += answer + _length(rng, config.user_tokens, config.sigma)


def conversation_trace(config: ConversationConfig = ConversationConfig()) -> list[TraceRequest]:
    """Every turn of every session, in arrival order (ties: session order)."""
    rng, ids, starts = random.Random(config.seed), _Ids(), 0.0
    turns: list[tuple[float, int, int, int]] = []
    for s in range(config.sessions):
        starts += rng.expovariate(config.session_rate_per_s)
        turns.extend((ts, s, prompt, answer) for ts, prompt, answer in _session(rng, config, starts))
    heapq.heapify(turns)
    out = []
    while turns:  # ids are handed out in arrival order, as a live system would see the blocks
        ts, s, prompt, answer = heapq.heappop(turns)
        out.append(TraceRequest(round(ts, 3), prompt, answer, ids.chain(s, prompt)))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=ConversationConfig.sessions)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write Mooncake JSONL here (default: print a summary only)")
    args = ap.parse_args(argv)
    trace = conversation_trace(ConversationConfig(sessions=args.sessions, seed=args.seed))
    if args.out:
        with open(args.out, "w") as f:
            f.write(dump_trace(trace))
    n = len(trace)
    print(f"{n} requests over {trace[-1].ts_s - trace[0].ts_s:.0f} s, mean prompt "
          f"{sum(r.input_length for r in trace) / n:.0f} tokens, "
          f"mean answer {sum(r.output_length for r in trace) / n:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
