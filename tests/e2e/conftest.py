"""A real local cluster for the end-to-end tests: router + 1 prefill + 1 decode worker processes, started by
`strata.launcher.LocalLauncher` (what `strata serve` runs) with the bundled model, host + disk tiers; the workers
register with the router and feed its prefix index with their KV events.

NOTE: one cluster per session, not per module: starting three model-loading processes takes ~30 s on a loaded
2-core machine, and the gRPC and OpenAI modules only read from it (each request has its own id; the tests that
look at cache counters compare before/after). `test_serve_cli.py` starts its own through the CLI.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from strata.launcher import ClusterInfo, LocalLauncher, ServeConfig
from strata.v1 import worker_pb2, worker_pb2_grpc

# Prompts with at most this many uncached tokens prefill on their decode worker (conditional disaggregation).
LOCAL_PREFILL_MAX_TOKENS = 16
SMALL_WORKERS = dict(num_blocks=256, host_tier_mib=16, handoff_mib=16)


@dataclass
class Cluster:
    info: ClusterInfo
    log_path: Path

    @property
    def grpc_address(self) -> str:
        return self.info.grpc_address

    @property
    def http_url(self) -> str:
        return self.info.http_url

    @property
    def registry_address(self) -> str:
        """Where workers register: the router's registry port (the launcher gives it one by default)."""
        return self.info.registry_address or self.info.grpc_address

    def worker(self, role: str) -> worker_pb2_grpc.WorkerStub:
        """A direct stub to the first worker of a role (to check what the worker itself saw)."""
        address = next(p.address for p in self.info.processes if p.role == role)
        return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))

    def busy(self, role: str) -> int:
        load = self.worker(role).Stats(worker_pb2.StatsRequest(), timeout=5).load
        return load.running + load.waiting

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


@pytest.fixture(scope="session")
def cluster():
    log_path = Path(tempfile.mkstemp(prefix="strata-e2e-", suffix=".log")[1])
    log = log_path.open("w")
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0,
                         local_prefill_max_tokens=LOCAL_PREFILL_MAX_TOKENS, ready_timeout_s=240, **SMALL_WORKERS)
    launcher = LocalLauncher(config, log=log)
    try:
        info = launcher.start()
    except Exception:
        log.flush()
        raise RuntimeError(f"the e2e cluster did not start:\n{log_path.read_text()[-6000:]}")
    try:
        yield Cluster(info, log_path)
    finally:
        launcher.stop()
        log.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the cluster gets the tail of the cluster's prefixed log in its report."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "cluster" in getattr(item, "funcargs", {}):
        report.sections.append(("strata cluster log (tail)", item.funcargs["cluster"].log_tail()))
