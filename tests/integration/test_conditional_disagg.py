"""Conditional disaggregation (issue 4, item 5): the decode worker prefills short or almost fully cached prompts
itself (`Generate`), with exactly the single engine's tokens and text; the policy decides per request, and both
paths agree with one engine. Which path a prompt takes is the router's one rule (`CostModelConfig.prefills_locally`,
applied by `kv_aware`)."""
from __future__ import annotations

import random

import pytest

from engine.sampling_params import SamplingParams
from router.cost_model import CostModelConfig
from strata.v1 import common_pb2
from worker_common.client import disaggregated, local
from worker_common.convert import FINISH_REASONS
from worker_common.engine_setup import build_engine_from
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--num-blocks", "512", "--max-num-batched-tokens", "256", "--handoff-mib", "16",
               "--host-tier-mib", "16"]


def make_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 203) for _ in range(length)]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3_moe").path)


@pytest.fixture(scope="module")
def reference(model_path):
    return build_engine_from(model_path, num_blocks=512, max_num_batched_tokens=256, engine_text=True).engine


@pytest.fixture(scope="module")
def workers(model_path):
    args = ["--model", model_path, "--transfer", "shm", *ENGINE_ARGS]
    prefill, decode = WorkerProcess("prefill", args, wait=False), WorkerProcess("decode", args, wait=False)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert got.finish_reason == FINISH_REASONS[want.finish_reason]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_generate_on_the_decode_worker_matches_one_engine(workers, reference, params):
    _, decode = workers
    prompt = make_prompt(1, 20)
    got = local(decode.stub(), f"local-{params.seed}", prompt, params)
    assert_same(got, reference.generate([prompt], params)[0])
    assert got.usage.prompt_tokens == 20 and got.usage.completion_tokens == 12
    timings = got.last_chunk.timings
    assert timings.prefill_ms > 0 and timings.decode_ms > 0


@pytest.mark.timeout(600)
def test_almost_fully_cached_prompt_reuses_the_decode_workers_blocks(workers, reference):
    """After a disaggregated turn, the next turn (same prefix, a few more tokens) prefills locally from cache."""
    prefill, decode = workers
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=21, ignore_eos=True)
    turn1 = make_prompt(2, 64)
    first = disaggregated(prefill.stub(), decode.stub(), "turn-1", turn1, params)
    assert_same(first, reference.generate([turn1], params)[0])
    turn2 = turn1 + first.token_ids + make_prompt(3, 5)
    rule = CostModelConfig(local_prefill_max_uncached_tokens=32)   # the router's one rule (kv_aware)
    assert rule.prefills_locally(len(turn2) - 64)
    second = local(decode.stub(), "turn-2", turn2, params)
    assert_same(second, reference.generate([turn2], params)[0])
    assert second.usage.cached_tokens >= 64, "the first turn's prompt blocks were reused on the decode worker"


@pytest.mark.timeout(600)
def test_policy_routed_mix_matches_one_engine(workers, reference):
    prefill, decode = workers
    rule = CostModelConfig(local_prefill_max_uncached_tokens=24)
    prompts = [make_prompt(10 + i, n) for i, n in enumerate((5, 17, 24, 40, 70))]
    params = SamplingParams(max_tokens=6, temperature=0.6, seed=5, ignore_eos=True)
    wants = reference.generate(prompts, params)
    paths = []
    for i, (prompt, want) in enumerate(zip(prompts, wants)):
        placed_locally = rule.prefills_locally(len(prompt))
        paths.append(placed_locally)
        got = (local(decode.stub(), f"mix-{i}", prompt, params) if placed_locally
               else disaggregated(prefill.stub(), decode.stub(), f"mix-{i}", prompt, params))
        assert_same(got, want)
    assert paths == [True, True, True, False, False]
    assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
