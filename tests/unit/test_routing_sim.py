"""benchmarks/routing_sim.py: the Mooncake-trace routing benchmark still runs and its parts do what they say."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from router.index import PrefixIndex, WorkerId

REPO = Path(__file__).resolve().parents[2]


def _load_sim():
    sys.path.insert(0, str(REPO / "benchmarks"))  # as when run as a script: `mooncake_trace` sits beside it
    spec = importlib.util.spec_from_file_location("routing_sim", REPO / "benchmarks" / "routing_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["routing_sim"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


sim = _load_sim()


def make_request(ts: float, ids, input_length: int | None = None, output: int = 10):
    return sim.TraceRequest(ts, input_length or len(ids) * sim.TRACE_BLOCK, output, tuple(ids))


def test_lru_cache_touch_reports_stored_and_evicted_blocks():
    cache = sim.LruCache(3)
    assert cache.touch([1, 2, 3]) == ([1, 2, 3], [])
    assert cache.touch([1, 4]) == ([4], [2])  # 1 was refreshed, so 2 is the oldest
    assert cache.prefix_run([1, 3, 4, 5]) == 3 and cache.prefix_run([2, 1]) == 0


def test_pooled_lru_counts_prefix_hits_in_tokens_and_blocks():
    trace = [make_request(0, [1, 2, 3]), make_request(1, [1, 2, 9], input_length=2 * 512 + 100)]
    figures = sim.pooled_lru(trace, capacity=10)
    assert figures["token_hit_ratio"] == pytest.approx(1024 / (1536 + 1124))
    assert figures["block_hit_ratio"] == pytest.approx(2 / 6)


def test_worker_events_keep_the_index_equal_to_its_cache():
    index = PrefixIndex()
    worker = sim.SimWorker(WorkerId("w0"), sim.LruCache(4))
    for ids in ([1, 2, 3], [1, 5, 6], [7]):
        worker.publish(index, ids)
    assert set(index.blocks_of(WorkerId("w0"))) == {sim.block_key(i) for i in worker.cache.blocks}
    assert index.expected_seq(WorkerId("w0")) == 3
    index.check_integrity()


def test_hot_prefix_prepends_the_same_blocks_to_every_request():
    hot = sim.with_hot_prefix([make_request(0, [1]), make_request(1, [2])], 3)
    assert hot[0].hash_ids[:3] == hot[1].hash_ids[:3] and hot[0].hash_ids[3:] == (1,)
    assert hot[0].input_length == 4 * 512


def test_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="trace not found"):
        sim.find_trace(str(tmp_path / "absent.jsonl"))


def test_default_trace_lives_in_the_repository():
    """No benchmark reads outside the repository: a fresh clone with nothing beside it has every trace."""
    path = sim.find_trace(None).resolve()
    assert path == REPO / "benchmarks" / "data" / "mooncake_synthetic_trace.jsonl"
    assert len(sim.load_trace(path)) == 3_993


def test_quick_mode_runs_and_pooled_cache_bounds_every_policy(capsys):
    sim.main(["--quick", "--json", "--hot-prefix-blocks", "8"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    main = report["main"]
    assert report["trace_requests"] == 500
    pooled = main["pooled"]["token_hit_ratio"]
    for name, figures in main["policies"].items():
        assert figures["token_hit_ratio"] <= pooled + 1e-12, name
    assert main["policies"]["kv_aware"]["token_hit_ratio"] > main["policies"]["round_robin"]["token_hit_ratio"]
    assert set(report["hot"]["policies"]) == {"kv_aware", "kv_aware_no_guard", "round_robin"}
