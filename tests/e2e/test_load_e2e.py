"""Load on the front doors (issue 15 item 1, first part): 128 concurrent gRPC streams and 128 concurrent HTTP
streams against one router at once. Every stream completes and no worker is swept out of routing: client streams
hold at most `MAX_GRPC_STREAMS` of the router's threads (the rest answer heartbeats), and HTTP streams wait for
their chunks through a thread of their own each, not anyio's default 40 threads that every other HTTP call shares."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from strata.client import StrataClient
from strata.v1 import common_pb2

pytestmark = pytest.mark.slow

STREAMS = 128
MAX_TOKENS = 160        # long enough that the streams outlast the router's 5 s heartbeat timeout


def grpc_stream(address: str, i: int) -> int:
    with StrataClient(address, timeout_s=300) as client:
        return len(client.generate(f"w{i % 50} w{i % 7} load {i}", max_tokens=MAX_TOKENS, ignore_eos=True).token_ids)


def http_stream(url: str, i: int) -> int:
    body = {"prompt": f"w{i % 30} w{i % 11} http load {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True}
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                tokens += 1
    return tokens


def test_128_grpc_and_128_http_streams_all_complete_and_no_worker_is_swept(cluster):
    log_before = len(cluster.log_path.read_text(errors="replace"))
    with ThreadPoolExecutor(2 * STREAMS) as pool:
        grpc_calls = [pool.submit(grpc_stream, cluster.grpc_address, i) for i in range(STREAMS)]
        http_calls = [pool.submit(http_stream, cluster.http_url, i) for i in range(STREAMS)]
        # meanwhile the router still answers a plain HTTP call at once (not queued behind the streams)
        health = httpx.get(cluster.http_url + "/health", timeout=10)
        assert health.status_code == 200
        assert [c.result() for c in grpc_calls] == [MAX_TOKENS] * STREAMS
        assert all(c.result() >= 1 for c in http_calls)
    with StrataClient(cluster.grpc_address, timeout_s=30) as client:
        states = {w.id: w.state for w in client.workers()}
    assert states and all(s == common_pb2.WORKER_STATE_READY for s in states.values()), states
    log = cluster.log_path.read_text(errors="replace")[log_before:]
    assert "out of routing" not in log, log[-3000:]
