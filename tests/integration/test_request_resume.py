"""Request migration on the worker (issue 15 item 3): `Generate` with `resume_output_ids` computes prompt + those
tokens and samples on from the next output position, so a seeded request continues exactly where the failed worker
left it: same tokens, same text (the first chunk's text starts with the text of the resumed tokens), same finish.
A real decode worker process; the single engine is the reference. The same worker runs with `--max-requests 2`:
a third request is refused with RESOURCE_EXHAUSTED and a retry hint while Health still answers."""
from __future__ import annotations

import random

import grpc
import pytest

from engine.sampling_params import SamplingParams
from strata.v1 import worker_pb2
from worker_common.convert import FINISH_REASONS, sampling_to_proto
from worker_common.engine_setup import build_engine_from
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

RPC_TIMEOUT_S = 120
PARAMS = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=77, presence_penalty=0.4, ignore_eos=True)


def make_prompt(seed: int, length: int = 45) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 203) for _ in range(length)]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


@pytest.fixture(scope="module")
def reference(model_path):
    return build_engine_from(model_path, num_blocks=256, max_num_batched_tokens=256, engine_text=True).engine


@pytest.fixture(scope="module")
def worker(model_path):
    proc = WorkerProcess("decode", ["--model", model_path, "--num-blocks", "256", "--host-tier-mib", "16",
                                    "--handoff-mib", "16", "--max-requests", "2"])
    try:
        yield proc
    finally:
        proc.stop()


def resume(worker: WorkerProcess, request_id: str, prompt: list[int], done: list[int],
           params: SamplingParams = PARAMS) -> tuple[list[int], str, int]:
    stream = worker.stub().Generate(worker_pb2.WorkerGenerateRequest(
        request_id=request_id, token_ids=prompt, sampling=sampling_to_proto(params), resume_output_ids=done),
        timeout=RPC_TIMEOUT_S)
    tokens, text, reason = [], "", 0
    for chunk in stream:
        tokens += chunk.token_ids
        text += chunk.text_delta
        reason = chunk.finish_reason or reason
    return tokens, text, reason


@pytest.mark.parametrize("k", [1, 7, 16, 23])
def test_a_resumed_request_continues_with_the_reference_tokens_and_text(worker, reference, k):
    prompt = make_prompt(k)
    want = reference.generate([prompt], PARAMS)[0]
    tokens, text, reason = resume(worker, f"resume-{k}", prompt, want.token_ids[:k])
    assert tokens == want.token_ids[k:]
    assert text == want.text            # the resumed tokens' text first, then the new tokens'
    assert reason == FINISH_REASONS[want.finish_reason]


def test_a_resume_that_leaves_nothing_to_generate_or_is_outside_the_vocabulary_is_invalid(worker):
    prompt = make_prompt(99)
    for done, what in (([5] * PARAMS.max_tokens, "sampling.max_tokens"), ([10 ** 6], "resume_output_ids")):
        with pytest.raises(grpc.RpcError) as err:
            resume(worker, "bad-resume", prompt, done)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert what in err.value.details() and "resume_output_ids" in err.value.details()


def test_a_worker_holding_its_request_limit_refuses_more_with_a_hint_and_still_answers_health(worker):
    long = SamplingParams(max_tokens=2000, ignore_eos=True)
    held = [worker.stub().Generate(worker_pb2.WorkerGenerateRequest(
        request_id=f"held-{i}", token_ids=make_prompt(200 + i), sampling=sampling_to_proto(long)), timeout=RPC_TIMEOUT_S)
        for i in range(2)]
    try:
        for call in held:
            next(call)                                       # both are running
        with pytest.raises(grpc.RpcError) as err:
            resume(worker, "one-too-many", make_prompt(300), [])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-requests" in err.value.details()
        assert dict(err.value.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"
        assert worker.stub().Health(worker_pb2.HealthRequest(), timeout=30).worker_id
    finally:
        for call in held:
            call.cancel()
