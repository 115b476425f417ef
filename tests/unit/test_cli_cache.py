"""`strata cache` without a router: what it prints from the stats it is given, how it reads hashes, the deadlines
it sets for evict and flush."""
from __future__ import annotations

from rich.console import Console
from typer.testing import CliRunner

from strata.cli_cache import cache_app, evict_timeout_s, stats_dict, stats_table
from strata.v1 import common_pb2


def make_worker(worker_id: str, pending: int, dropped: dict[str, int]) -> common_pb2.WorkerCacheStats:
    tiers = [common_pb2.CacheTierStats(tier=t, shared=t in ("redis", "s3"), dropped=n, healthy=True)
             for t, n in dropped.items()]
    return common_pb2.WorkerCacheStats(worker_id=worker_id, tiers=tiers, pending_writes=pending)


def render(table) -> str:
    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def test_stats_carry_dropped_per_tier_and_pending_writes_per_worker():
    data = stats_dict([make_worker("prefill-0", 3, {"host": 0, "redis": 5}),
                       make_worker("decode-0", 0, {"host": 0, "s3": 2})], "r:1")
    assert [(w["worker_id"], w["pending_writes"]) for w in data["workers"]] == [("prefill-0", 3), ("decode-0", 0)]
    assert [t["dropped"] for t in data["workers"][0]["tiers"]] == [0, 5]
    assert (data["totals"]["dropped"], data["totals"]["pending_writes"]) == (7, 3)
    text = render(stats_table(data))
    assert "dropped" in text and "pending background writes: prefill-0 3, decode-0 0" in text


def test_stats_carry_quota_refused_per_tier_and_in_the_totals():
    workers = [common_pb2.WorkerCacheStats(worker_id=w, tiers=[
        common_pb2.CacheTierStats(tier="host", healthy=True),
        common_pb2.CacheTierStats(tier="redis", shared=True, quota_refused=n, healthy=True)]) for w, n in
        (("prefill-0", 4), ("decode-0", 1))]
    data = stats_dict(workers, "r:1")
    assert [[t["quota_refused"] for t in w["tiers"]] for w in data["workers"]] == [[0, 4], [0, 1]]
    assert data["totals"]["quota_refused"] == 5
    text = render(stats_table(data))
    assert "quota refused" in text


def test_evict_deadline_grows_with_the_number_of_hashes():
    assert evict_timeout_s(0) == 60.0 and evict_timeout_s(2000) == 100.0


def test_a_bad_hash_is_refused_before_asking_the_router(tmp_path):
    runner = CliRunner()
    out = runner.invoke(cache_app, ["evict", "--hash", "abc", "--router", "127.0.0.1:1"])
    assert out.exit_code == 2 and "got 'abc'" in out.output
    listed = tmp_path / "hashes.txt"
    listed.write_text("# from the index\n" + "00" * 16 + "\n\nnot-hex\n")
    out = runner.invoke(cache_app, ["evict", "--hashes-from", str(listed), "--router", "127.0.0.1:1"])
    assert out.exit_code == 2 and "got 'not-hex'" in out.output
    out = runner.invoke(cache_app, ["evict", "--hashes-from", str(tmp_path / "missing"), "--router", "127.0.0.1:1"])
    assert out.exit_code == 2 and "--hashes-from" in out.output
    out = runner.invoke(cache_app, ["evict", "--router", "127.0.0.1:1"])
    assert out.exit_code == 2 and "exactly one of --bytes" in out.output
