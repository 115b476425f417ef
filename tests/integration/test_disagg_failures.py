"""When the KV hand-off breaks, the decode worker still answers with the right tokens, in bounded time (issue 4,
"Must show"): the prefill process killed after answering, a lease expiring, a transfer deadline passing. Each falls
back to the store, else to local recompute, and says why in `kv_fallback_reason`. Also: cancels and aborts free the
request; a handle of another namespace is refused.

Real processes over real sockets; every call carries a deadline, every test a timeout.
"""
from __future__ import annotations

import random
import signal
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from kvstore.tiers.redis import RedisTier
from strata.v1 import common_pb2, worker_pb2
from tests.conftest import needs_nixl
from worker_common.client import Completion
from worker_common.convert import FINISH_REASONS, sampling_to_proto
from worker_common.engine_setup import build_engine_from
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--num-blocks", "512", "--max-num-batched-tokens", "256", "--handoff-mib", "16",
               "--host-tier-mib", "16"]
DEADLINE_S = 0.5        # the tcp decode worker's transfer deadline
RPC_TIMEOUT_S = 60


def make_prompt(seed: int, length: int = 50) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 203) for _ in range(length)]


PARAMS = SamplingParams(max_tokens=10, temperature=0.7, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


@pytest.fixture(scope="module")
def reference(model_path):
    return build_engine_from(model_path, num_blocks=512, max_num_batched_tokens=256, engine_text=True).engine


@pytest.fixture(scope="module")
def cluster(model_path, redis_server):
    """shm pair sharing a Redis tier, and a tcp decode worker with a short transfer deadline."""
    shm_args = ["--model", model_path, "--transfer", "shm", "--redis-url", redis_server.url, *ENGINE_ARGS]
    procs = {"prefill_shm": WorkerProcess("prefill", shm_args, wait=False),
             "decode_shm": WorkerProcess("decode", shm_args, wait=False),
             "decode_tcp": WorkerProcess("decode", ["--model", model_path, "--transfer", "tcp",
                                                    "--transfer-deadline-s", str(DEADLINE_S), *ENGINE_ARGS],
                                         wait=False)}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def assert_exact(got: Completion, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert got.finish_reason == FINISH_REASONS[want.finish_reason]


def prefill(worker: WorkerProcess, request_id: str, prompt: list[int], **kw) -> worker_pb2.PrefillResponse:
    return worker.stub().Prefill(worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt,
                                                           sampling=sampling_to_proto(PARAMS), **kw),
                                 timeout=RPC_TIMEOUT_S)


def decode(worker: WorkerProcess, request_id: str, prompt: list[int], first: worker_pb2.PrefillResponse,
           params: SamplingParams = PARAMS) -> Completion:
    out = Completion(request_id, [first.first_token_id], first.first_text_delta)
    stream = worker.stub().Decode(worker_pb2.DecodeRequest(request_id=request_id, token_ids=prompt,
                                                           first_token_id=first.first_token_id, kv=first.kv,
                                                           sampling=sampling_to_proto(params)),
                                  timeout=RPC_TIMEOUT_S)
    for chunk in stream:
        out.token_ids += chunk.token_ids
        out.text += chunk.text_delta
        if chunk.finish_reason:
            out.finish_reason, out.last_chunk = chunk.finish_reason, chunk
    return out


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_expired_lease_recomputes_token_exactly(cluster, reference):
    prompt = make_prompt(1)
    first = prefill(cluster["prefill_shm"], "lease-1", prompt, lease_ms=200)
    assert len(first.kv.blocks) == 3
    time.sleep(0.5)
    got = decode(cluster["decode_shm"], "lease-1", prompt, first)
    assert_exact(got, reference.generate([prompt], PARAMS)[0])
    last = got.last_chunk
    assert last.kv_fallback_reason == "lease expired"
    assert last.blocks_transferred == 0 and last.blocks_from_store + last.blocks_recomputed == 3


@pytest.mark.timeout(600)
def test_prefill_killed_after_answering_serves_blocks_from_the_shared_store(cluster, reference, model_path,
                                                                            redis_server):
    victim = WorkerProcess("prefill", ["--model", model_path, "--transfer", "shm", "--redis-url", redis_server.url,
                                       *ENGINE_ARGS])
    try:
        prompt = make_prompt(2)
        first = prefill(victim, "killed-shm", prompt)
        hashes = list(first.kv.block_hashes)
        tier = RedisTier(redis_server.url)
        wait_until(lambda: all(tier.contains(hashes)), 20, "the prefill worker's background writes to Redis")
        victim.kill()
        started = time.monotonic()
        got = decode(cluster["decode_shm"], "killed-shm", prompt, first)
        assert time.monotonic() - started < 30
    finally:
        victim.stop()
    assert_exact(got, reference.generate([prompt], PARAMS)[0])
    last = got.last_chunk
    assert last.kv_fallback_reason == "peer unreachable"
    assert (last.blocks_transferred, last.blocks_from_store, last.blocks_recomputed) == (0, 3, 0)


@pytest.mark.timeout(600)
def test_transfer_deadline_and_killed_prefill_over_tcp_recompute_token_exactly(cluster, reference, model_path):
    """A frozen owner (SIGSTOP) makes the tcp read miss its deadline; a killed one refuses the connection."""
    victim = WorkerProcess("prefill", ["--model", model_path, "--transfer", "tcp", *ENGINE_ARGS])
    try:
        prompt = make_prompt(3)
        first = prefill(victim, "frozen", prompt)
        victim.signal(signal.SIGSTOP)
        started = time.monotonic()
        got = decode(cluster["decode_tcp"], "frozen", prompt, first)
        elapsed = time.monotonic() - started
        victim.signal(signal.SIGCONT)
        assert_exact(got, reference.generate([prompt], PARAMS)[0])
        assert got.last_chunk.kv_fallback_reason == "deadline exceeded"
        assert got.last_chunk.blocks_recomputed == 3
        assert elapsed < DEADLINE_S + 20

        prompt = make_prompt(4)
        first = prefill(victim, "killed-tcp", prompt)
        victim.kill()
        got = decode(cluster["decode_tcp"], "killed-tcp", prompt, first)
        assert_exact(got, reference.generate([prompt], PARAMS)[0])
        assert got.last_chunk.kv_fallback_reason in ("peer unreachable", "deadline exceeded")
        assert got.last_chunk.blocks_recomputed == 3
    finally:
        victim.stop()


@pytest.mark.timeout(600)
@needs_nixl
def test_killed_prefill_over_nixl_recomputes_token_exactly(reference, model_path):
    """nixl reads never reach owner code, so a dead owner shows up as NIXL's remote-disconnect error (or the
    deadline): the decode worker recomputes and the tokens stay exact."""
    args = ["--model", model_path, "--transfer", "nixl", "--transfer-deadline-s", "2", *ENGINE_ARGS]
    victim, reader = WorkerProcess("prefill", args, wait=False), WorkerProcess("decode", args, wait=False)
    try:
        victim.wait_ready(), reader.wait_ready()
        prompt = make_prompt(6)
        healthy = decode(reader, "nixl-ok", prompt, prefill(victim, "nixl-ok", prompt))
        assert_exact(healthy, reference.generate([prompt], PARAMS)[0])
        assert healthy.last_chunk.blocks_transferred == 3 and healthy.last_chunk.kv_fallback_reason == ""
        prompt = make_prompt(7)
        first = prefill(victim, "killed-nixl", prompt)
        victim.kill()
        got = decode(reader, "killed-nixl", prompt, first)
        assert_exact(got, reference.generate([prompt], PARAMS)[0])
        assert got.last_chunk.kv_fallback_reason in ("peer unreachable", "deadline exceeded")
        assert got.last_chunk.blocks_recomputed == 3
    finally:
        victim.stop()
        reader.stop()


@pytest.mark.timeout(600)
def test_released_lease_is_reported_released_once(cluster):
    prompt = make_prompt(5)
    first = prefill(cluster["prefill_shm"], "release", prompt)
    stub = cluster["prefill_shm"].stub()
    assert stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=first.kv.lease_id), timeout=10).released is True
    assert stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=first.kv.lease_id), timeout=10).released is False
    assert stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id="unknown"), timeout=10).released is False


def idle(worker: WorkerProcess) -> bool:
    load = worker.stub().Stats(worker_pb2.StatsRequest(), timeout=10).load
    return load.running == 0 and load.waiting == 0


@pytest.mark.timeout(600)
def test_client_cancel_and_abort_free_the_decode_request(cluster):
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    prompt = make_prompt(6)
    decode_worker = cluster["decode_shm"]
    first = prefill(cluster["prefill_shm"], "cancel", prompt)
    stream = decode_worker.stub().Decode(worker_pb2.DecodeRequest(
        request_id="cancel", token_ids=prompt, first_token_id=first.first_token_id, kv=first.kv,
        sampling=sampling_to_proto(long)), timeout=RPC_TIMEOUT_S)
    next(stream)
    stream.cancel()
    wait_until(lambda: idle(decode_worker), 15, "the cancelled request to leave the decode worker")

    first = prefill(cluster["prefill_shm"], "abort", prompt)
    stream = decode_worker.stub().Decode(worker_pb2.DecodeRequest(
        request_id="abort", token_ids=prompt, first_token_id=first.first_token_id, kv=first.kv,
        sampling=sampling_to_proto(long)), timeout=RPC_TIMEOUT_S)
    next(stream)
    found = decode_worker.stub().Abort(worker_pb2.WorkerAbortRequest(request_id="abort"), timeout=10).found
    chunks = list(stream)
    assert found is True
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    wait_until(lambda: idle(decode_worker), 15, "the aborted request to leave the decode worker")
    assert decode_worker.stub().Abort(worker_pb2.WorkerAbortRequest(request_id="abort"), timeout=10).found is False


@pytest.mark.timeout(600)
def test_a_tail_for_other_tokens_is_refused_and_recomputed(cluster, reference):
    """The tail is not in the block hashes: a Decode whose prompt differs only in its last token passes every
    full-block check, so the tail's own hash must catch it. The continuation is then the one of the prompt sent."""
    prompt = make_prompt(8)                       # 3 full blocks + a 2-token tail
    first = prefill(cluster["prefill_shm"], "tail-a", prompt)
    assert first.kv.tail_tokens == 2
    other = prompt[:-1] + [(prompt[-1] + 1) % 200 + 3]
    got = decode(cluster["decode_shm"], "tail-b", other, first)
    request = reference.add_request("tail-ref", other, PARAMS)
    request.append_output(first.first_token_id)
    while not request.is_finished:
        reference.step()
    assert got.token_ids == request.output_token_ids  # the first token included
    assert got.last_chunk.tail_tokens_transferred == 0
    assert got.last_chunk.kv_fallback_reason == "checksum mismatch"


@pytest.mark.timeout(600)
def test_a_handle_asking_for_huge_block_lengths_is_refused_and_recomputed(cluster, reference):
    """A Decode's handle comes from the caller: a block location claiming 1 TB is never allocated; the worker
    falls back (store, then recompute) and the tokens are still exact."""
    prompt = make_prompt(9)
    first = prefill(cluster["prefill_shm"], "huge-a", prompt)
    first.kv.blocks[0].length = 1 << 40
    got = decode(cluster["decode_shm"], "huge-b", prompt, first)
    request = reference.add_request("huge-ref", prompt, PARAMS)
    request.append_output(first.first_token_id)
    while not request.is_finished:
        reference.step()
    assert got.token_ids == request.output_token_ids
    assert "outside (0, " in got.last_chunk.kv_fallback_reason


@pytest.mark.timeout(600)
def test_handle_of_another_namespace_is_refused(cluster):
    prompt = make_prompt(7)
    first = prefill(cluster["prefill_shm"], "salted", prompt, cache_salt="tenant-a")
    with pytest.raises(grpc.RpcError) as err:
        decode(cluster["decode_shm"], "salted", prompt, first)   # sent without the salt
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "namespace" in err.value.details()


@pytest.mark.timeout(600)
def test_bad_requests_name_the_field(cluster):
    stub = cluster["prefill_shm"].stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(worker_pb2.PrefillRequest(request_id="bad", token_ids=[5],
                                               sampling=common_pb2.SamplingParams(top_p=2.0)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.top_p" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(worker_pb2.PrefillRequest(request_id="empty"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.value.details()


@pytest.mark.timeout(600)
def test_wrong_role_is_unavailable_and_health_names_the_role(cluster):
    prefill_worker, decode_worker = cluster["prefill_shm"], cluster["decode_shm"]
    with pytest.raises(grpc.RpcError) as err:
        list(prefill_worker.stub().Generate(worker_pb2.WorkerGenerateRequest(request_id="g", token_ids=[5]),
                                            timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:
        decode_worker.stub().Prefill(worker_pb2.PrefillRequest(request_id="p", token_ids=[5]), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    health = decode_worker.stub().Health(worker_pb2.HealthRequest(), timeout=10)
    assert (health.role, health.state) == (common_pb2.WORKER_ROLE_DECODE, common_pb2.WORKER_STATE_READY)
    stats = prefill_worker.stub().Stats(worker_pb2.StatsRequest(), timeout=10)
    tiers = {t.tier: t for t in stats.cache.tiers}
    assert tiers["host"].blocks > 0
