"""The load generator of `serve_bench.py`: sends a `Workload` to a running `strata serve` and times every chunk.

Two doors, the same record: gRPC (`StrataClient.stream`, token ids per chunk, the request's metrics: cached tokens
per tier) and the OpenAI HTTP API (`/v1/completions`, streamed server-sent events, `usage` at the end). Times are
taken on the client as vLLM's serving benchmark takes them: the request's start, then the arrival of every chunk
that carries output (gRPC: token ids; HTTP: an event with a choice, as vLLM counts them).

Single requests are sent at their arrival times (open loop: a late response never delays the next arrival);
sessions start at theirs and send each turn when the previous reply ends (closed loop within a session).
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import grpc
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from strata.client import StrataClient
from serve_workload import Session, Workload  # beside this script

REQUEST_TIMEOUT_S = 600.0
FILLER_TOKEN = 3


@dataclass
class Record:
    """One request as the client saw it (vLLM's RequestFuncOutput). Times in seconds from its start."""

    start: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)     # gaps between consecutive output chunks
    e2e: float = 0.0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)   # cached blocks per tier that served them (gRPC only)
    token_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens > 0


class Door(Protocol):
    """Sends one prompt and returns its record; safe to call from many threads at once."""

    def send(self, prompt: Sequence[int], max_tokens: int) -> Record: ...


class GrpcDoor:
    def __init__(self, client: StrataClient) -> None:
        self.client = client

    def send(self, prompt: Sequence[int], max_tokens: int) -> Record:
        rec = Record(start=time.perf_counter(), prompt_tokens=len(prompt))
        last = rec.start
        try:
            for chunk in self.client.stream(list(prompt), timeout_s=REQUEST_TIMEOUT_S, max_tokens=max_tokens,
                                            ignore_eos=True, include_metrics=True):
                now = time.perf_counter()
                if chunk.token_ids:
                    _mark(rec, now, last)
                    last = now
                    rec.token_ids.extend(chunk.token_ids)
                if chunk.finish_reason:
                    rec.output_tokens, rec.cached_tokens = chunk.usage.completion_tokens, chunk.usage.cached_tokens
                    rec.by_tier = dict(chunk.metrics.timings.blocks_by_tier)
            rec.e2e = time.perf_counter() - rec.start
        except grpc.RpcError as exc:
            rec.error = f"{exc.code().name}: {exc.details()}"
        return rec


class HttpDoor:
    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http, self.model = http, model

    def send(self, prompt: Sequence[int], max_tokens: int) -> Record:
        rec = Record(start=time.perf_counter(), prompt_tokens=len(prompt))
        last = rec.start
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with self.http.stream("POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as reply:
                if reply.status_code != 200:
                    rec.error = f"HTTP {reply.status_code}: {reply.read()[:200]!r}"
                    return rec
                for line in reply.iter_lines():
                    last = self._event(rec, line, last)
            rec.e2e = time.perf_counter() - rec.start
        except (httpx.HTTPError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        return rec

    @staticmethod
    def _event(rec: Record, line: str, last: float) -> float:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return last
        now, data = time.perf_counter(), json.loads(line[6:])
        if "error" in data:
            raise ValueError(f"stream error: {data['error']}")
        if data.get("choices"):
            _mark(rec, now, last)
            return now
        if usage := data.get("usage"):
            rec.output_tokens = usage["completion_tokens"]
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return last


def _mark(rec: Record, now: float, last: float) -> None:
    """A chunk with output arrived at `now`: the first sets TTFT, every later one adds an inter-token gap."""
    if not rec.ttft:
        rec.ttft = now - rec.start
    else:
        rec.itl.append(now - last)


# ------------------------------------------------------------------------------------------------------ the run

@dataclass(frozen=True)
class RunResult:
    records: tuple[Record, ...]
    duration_s: float          # first send to last reply (vLLM's benchmark duration)


def run_load(workload: Workload, door: Door, label: str = "", max_concurrency: int = 512) -> RunResult:
    """Send every request and session of `workload` on time; a progress bar on stderr while it runs."""
    records: list[Record] = []
    lock = threading.Lock()
    with _progress() as progress, ThreadPoolExecutor(max_concurrency) as pool:
        task = progress.add_task(label or "requests", total=workload.size)

        def done(rec: Record) -> None:
            with lock:
                records.append(rec)
            progress.advance(task)

        started = time.perf_counter()
        futures = [pool.submit(_session, s, door, started, done) for s in workload.sessions]
        for spec in workload.requests:
            time.sleep(max(0.0, started + spec.arrival_s - time.perf_counter()))
            futures.append(pool.submit(lambda s=spec: done(door.send(s.prompt, s.max_tokens))))
        wait(futures)
        for f in futures:
            f.result()  # a bug in the generator itself surfaces here, not as a silent short run
    end = max((r.start + r.e2e for r in records if r.ok), default=started)
    return RunResult(tuple(sorted(records, key=lambda r: r.start)), end - started)


def _session(session: Session, door: Door, started: float, done: Callable[[Record], None]) -> None:
    time.sleep(max(0.0, started + session.start_s - time.perf_counter()))
    for turn in range(len(session.user_messages)):
        rec = door.send(session.prompt(turn), session.max_tokens)
        done(rec)
        # NOTE: the HTTP door sees text, not token ids: its sessions carry a stand-in reply of the same length, so
        # the next turn reuses the earlier prompts' blocks but not the reply's (gRPC reuses both, as a chat would).
        session.add_turn(turn, rec.token_ids or [FILLER_TOKEN] * rec.output_tokens)
        if session.think_time_s:
            time.sleep(session.think_time_s)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=False)
