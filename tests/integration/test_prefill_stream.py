"""PrefillStream on a real prefill worker service (in this process, over a real gRPC socket): the first token is
answered before the KV hand-off is exported, and the handle follows; a request that ends at its first token gets
one answer; the streamed answers carry what Prefill's one answer does. And a real router process in front of a
worker without PrefillStream (an older one) falls back to Prefill."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from decode_worker.service import DecodeService
from engine.sampling_params import SamplingParams
from prefill_worker.service import PrefillService
from strata.client import StrataClient
from strata.paths import REPO_ROOT
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.config import WorkerConfig
from worker_common.convert import sampling_to_proto
from worker_common.engine_setup import build_engine_from
from worker_common.server import serve

PROMPT = list(range(3, 60))          # 57 tokens: 3 full blocks of 16 and a tail


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    service = PrefillService(WorkerConfig(role="prefill", model=str(ckpt.path), num_blocks=64, enforce_eager=True,
                                          handoff_bytes=8 << 20, host_tier_bytes=8 << 20,
                                          kv_events_endpoint="", kv_replay_endpoint=""))
    server = serve(service)
    channel = grpc.insecure_channel(service.address)
    try:
        yield service, worker_pb2_grpc.WorkerStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)
        service.close()


def request(rid: str, max_tokens: int = 4) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(request_id=rid, token_ids=PROMPT,
                                     sampling=sampling_to_proto(SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def hold_export(service, monkeypatch) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Make the service's export wait for the test: (exporting: it started, release: let it go, exported: done)."""
    exporting, release, exported = threading.Event(), threading.Event(), threading.Event()
    export = service.exporter.export

    def held_export(*args, **kwargs):
        exporting.set()
        assert release.wait(60), "the test never let the export finish"
        try:
            return export(*args, **kwargs)
        finally:
            exported.set()

    monkeypatch.setattr(service.exporter, "export", held_export)
    return exporting, release, exported


def wait_for_a_release(service, released: int, live: int, what: str) -> None:
    deadline = time.monotonic() + 20
    while service.leases.num_released == released:
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    assert service.leases.num_live == live


def test_the_first_token_is_answered_while_the_hand_off_is_still_being_exported(worker, monkeypatch):
    service, stub = worker
    exporting, release, _ = hold_export(service, monkeypatch)
    call = stub.PrefillStream(request("held"), timeout=60)
    try:
        first = next(call)                  # arrives although the export has not returned
        assert exporting.is_set() and not release.is_set()
        assert first.kv.lease_id == "" and first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        assert first.timings.prefill_ms > 0 and first.worker_id == service.worker_id
    finally:
        release.set()
    handoff = next(call)
    assert handoff.kv.lease_id and len(handoff.kv.block_hashes) == 3 and handoff.kv.tail_tokens == 57 - 48
    assert list(call) == []                 # two answers, then the stream ends
    stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=handoff.kv.lease_id), timeout=10)


def test_streamed_answers_match_the_unary_one(worker):
    _, stub = worker
    one = stub.Prefill(request("unary-a"), timeout=60)
    first, handoff = list(stub.PrefillStream(request("stream-a"), timeout=60))
    assert (first.first_token_id, first.first_text_delta) == (one.first_token_id, one.first_text_delta)
    assert list(handoff.kv.block_hashes) == list(one.kv.block_hashes)
    assert handoff.kv.num_tokens == one.kv.num_tokens == len(PROMPT)
    for answer in (one, handoff):
        stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=answer.kv.lease_id), timeout=10)


def test_a_request_that_ends_at_its_first_token_gets_one_answer_and_no_handle(worker):
    _, stub = worker
    answers = list(stub.PrefillStream(request("one", max_tokens=1), timeout=60))
    assert len(answers) == 1
    assert answers[0].finish_reason == common_pb2.FINISH_REASON_LENGTH and not answers[0].kv.lease_id


def test_a_bad_request_is_refused_before_any_answer(worker):
    _, stub = worker
    bad = worker_pb2.PrefillRequest(request_id="bad", token_ids=[10 ** 6])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.PrefillStream(bad, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class OlderPrefillService(PrefillService):
    """A prefill worker from before PrefillStream: the generated servicer's UNIMPLEMENTED answers it."""

    unary_calls = stream_calls = 0

    def PrefillStream(self, request, context):
        self.stream_calls += 1
        return worker_pb2_grpc.WorkerServicer.PrefillStream(self, request, context)

    def Prefill(self, request, context):
        self.unary_calls += 1
        return super().Prefill(request, context)


@pytest.fixture
def router_over_an_older_prefill_worker(tiny_checkpoint):
    ckpt = str(tiny_checkpoint("llama").path)
    common = dict(model=ckpt, num_blocks=64, enforce_eager=True, handoff_bytes=8 << 20, host_tier_bytes=8 << 20)
    prefill = OlderPrefillService(WorkerConfig(role="prefill", **common))
    decode = DecodeService(WorkerConfig(role="decode", **common))
    servers = [serve(prefill), serve(decode)]
    router = subprocess.Popen([sys.executable, "-m", "router", "--model", ckpt, "--grpc-port", "0", "--http-port",
                               "-1", "--local-prefill-max-tokens", "0", "--worker", prefill.address, "--worker",
                               decode.address], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = router.stdout.readline()
        assert line.startswith("READY "), line
        address = dict(field.split("=", 1) for field in line.split()[1:])["grpc"]
        yield prefill, ckpt, address
    finally:
        router.terminate()
        router.wait(timeout=30)
        for server in servers:
            server.stop(grace=None)
        decode.close()
        prefill.close()


def test_the_router_falls_back_to_prefill_on_a_worker_without_prefill_stream(router_over_an_older_prefill_worker):
    prefill, ckpt, address = router_over_an_older_prefill_worker
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = build_engine_from(ckpt, num_blocks=64).engine.generate([PROMPT], params)[0].token_ids
    with StrataClient(address, timeout_s=60) as client:
        deadline = time.monotonic() + 60
        while len(client.workers()) < 2:           # the router probes both workers before it routes
            assert time.monotonic() < deadline, "the router never saw both workers"
            time.sleep(0.1)
        for i in range(2):
            out = client.generate(PROMPT, max_tokens=6, ignore_eos=True, include_metrics=True)
            assert out.token_ids == want and out.metrics.disaggregated
    assert (prefill.stream_calls, prefill.unary_calls) == (1, 2)   # the first UNIMPLEMENTED is remembered


def test_a_client_gone_after_the_first_token_leaves_no_lease_behind(worker, monkeypatch):
    """The router cancels the stream after the first token (its client went away) while the export still runs:
    the lease that export grants is released at once, not held for its TTL (30 s here)."""
    service, stub = worker
    exporting, release, exported = hold_export(service, monkeypatch)
    live, released = service.leases.num_live, service.leases.num_released
    call = stub.PrefillStream(request("gone"), timeout=60)
    next(call)
    assert exporting.wait(10)
    call.cancel()
    time.sleep(0.3)                                  # the handler notices the cancel (it polls every 0.1 s)
    release.set()
    assert exported.wait(30)                         # the export granted its lease, and the handler released it
    wait_for_a_release(service, released, live, "the export's lease was not released")
