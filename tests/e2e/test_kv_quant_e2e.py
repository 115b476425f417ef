"""An fp8 KV cache end to end (issue 12, item 3): a prefill worker process and a decode worker process, both started
with `--kv-cache-dtype fp8`, serve requests disaggregated over `tcp` token-exactly like one engine with the same
settings, moving fp8 blocks (header + tokens + scales + payload: a quarter of this float32 model's bytes, plus the
scales) under a namespace of their own.

The reference is an in-process engine built the way the workers build theirs (tests/integration/
test_disagg_token_exact.py is the model-dtype version of this harness).
"""
from __future__ import annotations

import random

import pytest

from kvstore import codec
from tests.integration.test_disagg_token_exact import ENGINE_ARGS, assert_same, greedy, make_prompt, seeded
from worker_common.client import disaggregated
from worker_common.engine_setup import build_engine_from
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

MODEL = "llama"


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint(MODEL).path)


@pytest.fixture(scope="module")
def reference(model_path):
    return build_engine_from(model_path, num_blocks=512, max_num_batched_tokens=256, engine_text=True,
                             kv_cache_dtype="fp8")


@pytest.fixture(scope="module")
def workers(model_path):
    common = ["--model", model_path, "--transfer", "tcp", "--kv-cache-dtype", "fp8", *ENGINE_ARGS]
    prefill = WorkerProcess("prefill", common, wait=False)
    decode = WorkerProcess("decode", common, wait=False)
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("params", [greedy(), seeded(7)], ids=["greedy", "seeded"])
def test_fp8_workers_over_tcp_match_one_fp8_engine(workers, reference, params):
    prefill, decode = workers
    prompt = make_prompt(random.Random(1), 57)           # 3 full blocks + a 9-token tail
    want = reference.engine.generate([prompt], params)[0]
    got = disaggregated(prefill.stub(), decode.stub(), f"fp8-{params.seed}", prompt, params)
    assert_same(got, want)
    last = got.last_chunk
    assert (last.blocks_transferred, last.blocks_from_store, last.blocks_recomputed) in ((3, 0, 0), (0, 3, 0))
    assert last.kv_fallback_reason == "" and last.tail_tokens_transferred == 9


@pytest.mark.timeout(600)
def test_fp8_blocks_move_in_their_own_namespace_at_fp8_size(workers, reference, model_path):
    prefill, decode = workers
    prompt = make_prompt(random.Random(2), 40)
    got = disaggregated(prefill.stub(), decode.stub(), "fp8-size", prompt, greedy(4))
    assert_same(got, reference.engine.generate([prompt], greedy(4))[0])
    kv = got.prefill.kv
    assert bytes(kv.namespace_fingerprint) == reference.fingerprint_for("")
    float32 = build_engine_from(model_path, num_blocks=8)
    assert float32.fingerprint_for("") != reference.fingerprint_for(""), "fp8 and float32 blocks never share a hash"
    layout = reference.layout
    fp8_block = codec.encoded_size(layout.payload_bytes("float8_e4m3fn"), layout.scale_bytes("float8_e4m3fn"), 16)
    assert [loc.length for loc in kv.blocks] == [fp8_block, fp8_block]
    assert fp8_block < codec.encoded_size(layout.payload_bytes("float32"), 0, 16) / 3


@pytest.mark.timeout(600)
def test_a_shared_prefix_hit_on_the_prefill_worker_stays_token_exact(workers, reference):
    """The second request's first 2 blocks come from the prefill worker's prefix cache (written by the first
    request in one call): the same bytes it would compute, so the same tokens as the reference."""
    prefill, decode = workers
    rng = random.Random(3)
    system = make_prompt(rng, 32)
    for i, params in enumerate([greedy(10), seeded(21, 10)]):
        prompt = system + make_prompt(rng, 11 + i)
        got = disaggregated(prefill.stub(), decode.stub(), f"fp8-shared-{i}", prompt, params)
        assert_same(got, reference.engine.generate([prompt], params)[0])
        if i:
            assert got.prefill.cached_tokens >= 32

