"""`strata serve` as a user runs it (issue 5 item 6): one command starts router + prefill + decode processes from a
config file, prints where to connect, serves, and on Ctrl-C stops every process it started. The operator commands
(`strata workers`, `strata cache stats|flush`) run as separate processes against it."""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from strata.client import StrataClient
from strata.launcher import REPO_ROOT, ServeConfig
from tests.conftest import needs_nixl

pytestmark = pytest.mark.slow

CONFIG = """\
serve:
  prefill: 1
  decode: 1
  grpc-port: 0
  http-port: 0
  num_blocks: 256
  host_tier_mib: 16
  handoff_mib: 16
"""


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """The operator CLI in its own process (`strata cache ...` / `strata workers`)."""
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO_ROOT)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is dead for this purpose
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return False


class Serve:
    """`python -m strata.cli serve ...` (the `strata serve` entry point) with its stdout and stderr read line by line in the background."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", *args], cwd=REPO_ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.stdout: queue.Queue[str] = queue.Queue()
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines.append), daemon=True).start()

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"no line matching {pattern!r}; serve's log:\n" + "\n".join(self.stderr_lines[-40:]))

    def child_pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.stderr_lines if (m := re.search(r"started \S+ \(pid (\d+)\)", line))]


def test_serve_config_file_and_overrides(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(CONFIG)
    cfg = ServeConfig.from_file(path, decode=2, redis_url=None)
    assert (cfg.prefill, cfg.decode, cfg.grpc_port, cfg.num_blocks) == (1, 2, 0, 256)
    path.write_text("serve:\n  prefil: 1\n")
    with pytest.raises(ValueError, match="config key 'prefil' is unknown"):
        ServeConfig.from_file(path)
    with pytest.raises(ValueError, match="decode must be >= 1 worker, got 0"):
        ServeConfig(decode=0)


@pytest.fixture
def redis_url():
    """A real redis-server for the shared tier when one is installed (else the cluster runs without it)."""
    if shutil.which("redis-server") is None:
        yield None
        return
    from strata.devservers import RedisServer
    with RedisServer() as server:
        yield server.url


def test_serve_starts_a_cluster_serves_and_stops_every_process_on_ctrl_c(tmp_path, redis_url):
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    args = ["--config", str(config), "--log-level", "WARNING"] + (["--redis-url", redis_url] if redis_url else [])
    serve = Serve(args)
    expected_tiers = ["host", "disk", "redis"] if redis_url else ["host", "disk"]
    try:
        m = serve.wait_for(r"^SERVING grpc=(\S+) http=(\S+)")
        grpc_address, http = m.group(1), m.group(2)
        pids = serve.child_pids()
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        banner = "\n".join(serve.stderr_lines)
        assert "prefill-0" in banner and "decode-0" in banner  # prefixed child logs

        workers = run_cli("workers", "--json", "--router", grpc_address)
        assert workers.returncode == 0, workers.stderr
        assert sorted((w["id"], w["role"], w["state"]) for w in json.loads(workers.stdout)) == [
            ("decode-0", "decode", "ready"), ("prefill-0", "prefill", "ready")]

        reply = httpx.post(f"{http}/v1/completions", timeout=60, json={
            "model": "strata-moe-tiny", "prompt": "def fibonacci(n):", "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1

        stats = run_cli("cache", "stats", "--json", "--router", grpc_address)
        assert stats.returncode == 0, stats.stderr
        tiers = {w["worker_id"]: [t["tier"] for t in w["tiers"] if t["tier"] != "device"]  # G1 when reported
                 for w in json.loads(stats.stdout)["workers"]}
        assert tiers == {"prefill-0": expected_tiers, "decode-0": expected_tiers}
        table = run_cli("cache", "stats", "--router", grpc_address)
        assert table.returncode == 0 and "prefill-0" in table.stdout and "hit% blk" in table.stdout

        evicted = run_cli("cache", "evict", "--bytes", "1", "--tier", "host", "--json", "--router", grpc_address)
        assert evicted.returncode == 0, evicted.stderr
        assert {(r["worker_id"], r["tier"], r["error"]) for r in json.loads(evicted.stdout)} == {
            ("prefill-0", "host", ""), ("decode-0", "host", "")}
        flushed = run_cli("cache", "flush", "--yes", "--json", "--router", grpc_address)
        assert flushed.returncode == 0 and not [r for r in json.loads(flushed.stdout) if r["error"]]
        after = json.loads(run_cli("cache", "stats", "--json", "--router", grpc_address).stdout)
        assert all(t["blocks"] == 0 for w in after["workers"] for t in w["tiers"] if not t["shared"])

        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if pid_alive(p)], "strata serve left processes behind"
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()


@needs_nixl
def test_serve_with_nixl_transfer_hands_kv_over_through_nixl(tmp_path):
    """`strata serve --transfer nixl`: the router disaggregates a long prompt and the decode worker reads its KV
    through NIXL (every full block and the tail); Ctrl-C stops it."""
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    serve = Serve(["--config", str(config), "--transfer", "nixl", "--log-level", "WARNING"])
    try:
        grpc_address = serve.wait_for(r"^SERVING grpc=(\S+) http=(\S+)").group(1)
        with StrataClient(grpc_address, timeout_s=60) as client:
            prompt = list(range(100, 190))  # 5 full blocks + a 10-token tail: too long to prefill on the decode side
            out = client.generate(prompt, max_tokens=4, ignore_eos=True, include_metrics=True)
        assert out.metrics.disaggregated and len(out.token_ids) == 4
        assert (out.metrics.blocks_transferred, out.metrics.tail_tokens_transferred) == (5, 10)
        serve.proc.send_signal(signal.SIGINT)
        assert serve.proc.wait(timeout=30) == 0
    finally:
        if serve.proc.poll() is None:
            serve.proc.kill()


def test_operator_cli_reports_an_unreachable_router_cleanly():
    out = run_cli("workers", "--router", "127.0.0.1:1")
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr and "strata serve" in out.stderr and "Traceback" not in out.stderr
