"""benchmarks/routing_grid.py: kv_aware against the pooled ceiling over workers x blocks x traffic."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # as when run as a script: the grid imports its neighbours by name

import routing_grid as grid  # noqa: E402


def make_cell(kv_hit: float, pooled_hit: float = 0.5) -> grid.Cell:
    return grid.Cell("synthetic", 8, 2_000, 100, pooled_hit, kv_hit, 0.1, 0.1, 1.0, 1.0, 1.0, 0.5, 0.6)


def test_a_cell_meets_the_target_at_097_of_pooled():
    assert make_cell(0.485).meets and not make_cell(0.4849).meets
    assert make_cell(0.485).as_dict()["kv_vs_pooled"] == pytest.approx(0.97)


def test_grid_cells_come_in_traffic_workers_capacity_order():
    cells = grid.run_grid(["multi-turn", "hot-prefix"], [2, 3], [50], limit=60)
    assert [(c.traffic, c.workers, c.capacity_blocks) for c in cells] == [
        ("multi-turn", 2, 50), ("multi-turn", 3, 50), ("hot-prefix", 2, 50), ("hot-prefix", 3, 50)]
    assert all(c.requests == 60 and 0 < c.pooled_hit <= 1 and c.kv_imbalance >= 1 for c in cells)
    table = grid.markdown(cells).splitlines()
    assert table[0] == grid.HEADER and len(table) == 2 + len(cells)


def test_unknown_traffic_is_a_clear_error():
    with pytest.raises(ValueError, match="traffic must be one of"):
        grid.load_traffic("bursty")


def test_quick_mode_prints_the_grid_and_json_last(capsys):
    grid.main(["--quick", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["summary"]["cells"] == 10 == len(report["cells"])
    assert {c["traffic"] for c in report["cells"]} == set(grid.TRAFFIC)
