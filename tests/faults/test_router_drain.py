"""The router's front door under pressure (issue 15 items 1 and 4): a client past `--max-streams-per-client` gets
RESOURCE_EXHAUSTED / HTTP 429 with a retry hint while other clients are served; a router told to stop (SIGTERM)
refuses new requests with UNAVAILABLE and a retry hint, lets the streams in flight finish with their finish reason,
then exits by itself."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import httpx
import pytest

from strata.client import StrataClient
from strata.launcher import ServeConfig
from strata.v1 import common_pb2, strata_pb2_grpc
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster

pytestmark = pytest.mark.slow

MAX_TOKENS = 400
PER_CLIENT = 2


def open_streams(address: str, n: int, metadata=()) -> list:
    """`n` long streams from one client, each holding until cancelled; returns once every one has a token."""
    calls = []
    for i in range(n):
        with StrataClient(address) as client:
            request = client.request(f"client stream {i}", max_tokens=MAX_TOKENS, ignore_eos=True)
        channel = grpc.insecure_channel(address)
        call = strata_pb2_grpc.StrataStub(channel).Generate(request, timeout=300, metadata=metadata)
        next(call)
        calls.append((channel, call))
    return calls


def test_a_client_past_its_stream_limit_is_refused_with_a_hint_and_others_are_served(cluster):
    held = open_streams(cluster.grpc_address, PER_CLIENT)
    try:
        with StrataClient(cluster.grpc_address, timeout_s=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate("one too many", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams-per-client" in err.value.details()
        assert dict(err.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"
        reply = httpx.post(cluster.http_url + "/v1/completions", json={"prompt": "over http", "max_tokens": 2},
                           timeout=60)                                          # the same address over HTTP
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1", reply.text
        other = open_streams(cluster.grpc_address, 1, metadata=(("authorization", "Bearer another-client"),))
        for channel, call in other:
            call.cancel()
            channel.close()
    finally:
        for channel, call in held:
            call.cancel()
            channel.close()


@pytest.fixture(scope="module")
def cluster():
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, ready_timeout_s=240,
                         router_args=("--max-streams-per-client", str(PER_CLIENT)), **SMALL_WORKERS)
    with own_cluster(config, "router-door") as c:
        yield c


def test_a_stopping_router_finishes_the_streams_in_flight_and_refuses_new_ones(cluster):
    router = next(p for p in cluster.info.processes if p.role == "router")
    got: dict[str, object] = {}
    started, http_started = threading.Event(), threading.Event()

    def long_stream() -> None:
        with StrataClient(cluster.grpc_address, timeout_s=300) as client:
            tokens, reason = 0, ""
            for chunk in client.stream("a long answer before the router stops", max_tokens=MAX_TOKENS,
                                       ignore_eos=True):
                tokens += len(chunk.token_ids)
                started.set()
                reason = chunk.finish_reason or reason
            got["tokens"], got["reason"] = tokens, reason

    def long_http_stream() -> None:
        body = {"prompt": "a long answer over http", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        lines = []
        with httpx.stream("POST", cluster.http_url + "/v1/completions", json=body, timeout=300) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    http_started.set()
        got["http_last"] = lines[-1] if lines else ""
        got["http_usage"] = next((line for line in lines if '"usage":{' in line), "")

    stream, http_stream = threading.Thread(target=long_stream), threading.Thread(target=long_http_stream)
    http_stream.start()
    stream.start()
    assert started.wait(120) and http_started.wait(120)
    os.kill(router.pid, signal.SIGTERM)
    refused = None
    deadline = time.monotonic() + 30
    while refused is None and time.monotonic() < deadline and stream.is_alive():
        try:   # NOTE: another client (its own key), so the per-client limit is not what refuses it
            with StrataClient(cluster.grpc_address, timeout_s=30, api_key="late-client") as client:
                client.generate("a new request while draining", max_tokens=2)
        except grpc.RpcError as exc:
            refused = exc
        time.sleep(0.05)
    stream.join(300)
    http_stream.join(300)
    assert (got["tokens"], got["reason"]) == (MAX_TOKENS, common_pb2.FINISH_REASON_LENGTH)
    assert got["http_last"] == "data: [DONE]" and f'"completion_tokens":{MAX_TOKENS}' in got["http_usage"], got
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "shutting down" in refused.details()
    assert dict(refused.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"
    assert _exits(router.pid, 60)


def _exits(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False
