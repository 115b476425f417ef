"""The Azure LLM inference traces (2023, `benchmarks/data/`) as Mooncake-format requests with a synthetic prefix.

The CSVs give arrival times and token counts only; the prefix structure is made up, deterministically per seed:

    every request belongs to one of `apps` applications, drawn with Zipf(`zipf_s`) popularity (app 0 the most
    popular); app g has a fixed system prompt of A_g full blocks (A_g uniform in 1 .. max_app_blocks, drawn once)

    request of L tokens: n = ceil(L / 512) blocks
    blocks   | app g's first min(A_g, n - 1) blocks (shared by its app) | the rest: fresh ids (this request alone) |

so a request always keeps at least its last block to itself (the user's own input), and a one-block request shares
nothing. Arrival = TIMESTAMP (seconds after the first row), input = ContextTokens, output = GeneratedTokens.
"""
from __future__ import annotations

import bisect
import csv
import itertools
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from mooncake_trace import DATA, TRACE_BLOCK, TraceRequest  # beside this script

AZURE_TRACES = {"code": DATA / "azure2023_AzureLLMInferenceTrace_code.csv",
                "conv": DATA / "azure2023_AzureLLMInferenceTrace_conv.csv"}
APP_ID_BASE = 1 << 41  # ids of the apps' system prompts: far above the per-request ids, apart from HOT_ID_BASE


@dataclass(frozen=True)
class AzurePrefixConfig:
    apps: int = 128
    zipf_s: float = 1.0
    max_app_blocks: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.apps < 1 or self.max_app_blocks < 1:
            raise ValueError(f"apps and max_app_blocks must be >= 1, got {self.apps}, {self.max_app_blocks}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")


def read_azure(path: Path, limit: int | None = None) -> list[tuple[float, int, int]]:
    """(arrival seconds after the first row, context tokens, generated tokens) per row."""
    rows: list[tuple[datetime, int, int]] = []
    with path.open() as f:
        for r in itertools.islice(csv.DictReader(f), limit):
            # Seven fractional digits: one more than strptime parses, and below a microsecond anyway.
            ts = datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            rows.append((ts, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    return [((ts - rows[0][0]).total_seconds(), ctx, gen) for ts, ctx, gen in rows]


def azure_trace(name: str, config: AzurePrefixConfig = AzurePrefixConfig(), limit: int | None = None
                ) -> list[TraceRequest]:
    """The `name` ("code" or "conv") trace with app prefixes as the module docstring says."""
    if name not in AZURE_TRACES:
        raise ValueError(f"name must be one of {sorted(AZURE_TRACES)}, got {name!r}")
    rng = random.Random(config.seed)
    app_blocks = [rng.randint(1, config.max_app_blocks) for _ in range(config.apps)]
    cumulative = list(itertools.accumulate(1.0 / (g + 1) ** config.zipf_s for g in range(config.apps)))
    fresh = itertools.count(1)
    out = []
    for ts, ctx, gen in read_azure(AZURE_TRACES[name], limit):
        g = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        n = -(-ctx // TRACE_BLOCK)
        shared = max(0, min(app_blocks[g], n - 1))
        ids = [APP_ID_BASE + g * config.max_app_blocks + i for i in range(shared)]
        out.append(TraceRequest(ts, ctx, gen, tuple(ids + [next(fresh) for _ in range(n - shared)])))
    return out

