"""Every benchmark still runs: its `--quick --json` mode exits 0 and ends with one JSON object (DESIGN §10)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ["engine_throughput.py", "kvstore_bench.py", "transfer_bench.py", "transfer_ab.py", "routing_sim.py", "ttft_breakdown.py",
              "moe_bench.py", "ttft_tiers.py", "quant_bench.py", "spec_bench.py", "soak.py", "routing_grid.py",
              "tenant_probe.py", "migration_bench.py", "serve_bench.py", "gpu_kernels.py"]


@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmark_quick_mode_prints_json_last(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert isinstance(json.loads(last), dict)
