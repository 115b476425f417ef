"""Mooncake-format request traces (`benchmarks/data/`): loading, writing, and a synthetic hot prefix.

One JSON object per line: `timestamp` (ms), `input_length`, `output_length` (tokens), `hash_ids` (one id per
512-token block; equal ids mean an equal prefix up to that block). Shared by the routing and serving benchmarks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DATA = Path(__file__).resolve().parent / "data"  # the public traces shipped with this repository (README there)
DEFAULT_TRACE = DATA / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK = 512  # the Mooncake trace's block size, in tokens
HOT_ID_BASE = 1 << 40  # ids of the synthetic hot prefix: far above any trace id


@dataclass(frozen=True)
class TraceRequest:
    ts_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prefix_tokens(self, k: int) -> int:
        """Tokens in the first k blocks (the last block of a request may be partial)."""
        return min(k * TRACE_BLOCK, self.input_length)


# --------------------------------------------------------------------------------------------------- the trace

def find_trace(explicit: str | None) -> Path:
    """`explicit`, or the Mooncake synthetic trace in `benchmarks/data/`; nothing outside the repository."""
    path = Path(explicit) if explicit else DEFAULT_TRACE
    if not path.is_file():
        raise SystemExit(f"trace not found: {path} (pass --trace PATH to a Mooncake-format JSONL)")
    return path


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with path.open() as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            r = json.loads(line)
            out.append(TraceRequest(r["timestamp"] / 1000.0, r["input_length"], r["output_length"],
                                    tuple(r["hash_ids"])))
    return out


def dump_trace(trace: Sequence[TraceRequest]) -> str:
    """Mooncake JSONL: what `load_trace` reads back (timestamps rounded to the millisecond)."""
    return "".join(json.dumps({"timestamp": round(r.ts_s * 1000), "input_length": r.input_length,
                               "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                   for r in trace)


def with_hot_prefix(trace: Sequence[TraceRequest], num_blocks: int) -> list[TraceRequest]:
    """Every request starts with the same `num_blocks` full blocks (one hot system prompt), then its own blocks."""
    hot = tuple(HOT_ID_BASE + i for i in range(num_blocks))
    return [TraceRequest(r.ts_s, r.input_length + num_blocks * TRACE_BLOCK, r.output_length, hot + r.hash_ids)
            for r in trace]
