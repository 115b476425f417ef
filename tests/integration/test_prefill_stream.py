"""PrefillStream on a real prefill worker service (in this process, over a real gRPC socket): the first token is
answered before the KV hand-off is exported, and the handle follows; a request that ends at its first token gets
one answer; the streamed answers carry what Prefill's one answer does."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine.sampling_params import SamplingParams
from prefill_worker.service import PrefillService
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.config import WorkerConfig
from worker_common.convert import sampling_to_proto
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


def test_the_first_token_is_answered_while_the_hand_off_is_still_being_exported(worker, monkeypatch):
    service, stub = worker
    exporting, release = threading.Event(), threading.Event()
    export = service.exporter.export

    def held_export(*args, **kwargs):
        exporting.set()
        assert release.wait(60), "the test never let the export finish"
        return export(*args, **kwargs)

    monkeypatch.setattr(service.exporter, "export", held_export)
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
