"""Disaggregation changes nothing in the output (issue 4, "Must show"): a prefill worker process and a decode worker
process, talking gRPC and moving KV over a real transfer backend (shm, tcp, nixl), produce exactly the tokens, text and
finish reasons that one engine produces alone, for greedy and seeded sampling, single requests and 16 concurrent
requests with shared prefixes.

The reference is an in-process `LLMEngine` built the same way the workers build theirs, but with its own
detokenizer (so text and stop strings are the engine's, not the workers').
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.sampling_params import SamplingParams
from strata.v1 import common_pb2, worker_pb2
from tests.conftest import SKIP_NIXL
from worker_common.client import Completion, disaggregated
from worker_common.convert import FINISH_REASONS, sampling_to_proto
from worker_common.engine_setup import build_engine_from
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

MODEL = "llama"
ENGINE_ARGS = ["--num-blocks", "512", "--max-num-batched-tokens", "256", "--handoff-mib", "16",
               "--host-tier-mib", "16"]
WORDS = range(3, 203)   # token ids the tiny tokenizer spells as words


def make_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.choice(WORDS) for _ in range(length)]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def seeded(seed: int, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=40, top_p=0.95, seed=seed,
                          ignore_eos=True, **kw)


def start_pair(model: str, backend: str) -> tuple[WorkerProcess, WorkerProcess]:
    common = ["--model", model, "--transfer", backend, *ENGINE_ARGS]
    prefill = WorkerProcess("prefill", common, wait=False)
    decode = WorkerProcess("decode", [*common, "--metrics-port", "0"], wait=False)
    try:
        return prefill.wait_ready(), decode.wait_ready()
    except Exception:
        prefill.stop()
        decode.stop()
        raise


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint(MODEL).path)


@pytest.fixture(scope="module")
def reference(model_path):
    return build_engine_from(model_path, num_blocks=512, max_num_batched_tokens=256, engine_text=True).engine


def _backends() -> list:
    """nixl where NIXL imports (CI installs it and requires it, see test_transfer_nixl.py)."""
    return ["shm", "tcp"] + ([] if SKIP_NIXL else ["nixl"])


@pytest.fixture(scope="module", params=_backends())
def workers(request, model_path):
    prefill, decode = start_pair(model_path, request.param)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def assert_same(got: Completion, want) -> None:
    assert got.token_ids == want.token_ids, f"{got.request_id}: tokens differ"
    assert got.text == want.text, f"{got.request_id}: text differs"
    assert got.finish_reason == FINISH_REASONS[want.finish_reason], f"{got.request_id}: finish reason differs"


def assert_same_entries(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.sampled.token_id, g.rank) == (w.token_id, w.rank)
        assert g.sampled.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t.token_id for t in g.top] == [t for t, _ in w.top]
        assert [t.logprob for t in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("params", [greedy(), seeded(7)], ids=["greedy", "seeded"])
def test_single_request_matches_one_engine(workers, reference, params):
    prefill, decode = workers
    prompt = make_prompt(random.Random(1), 57)           # 3 full blocks + a 9-token tail
    want = reference.generate([prompt], params)[0]
    got = disaggregated(prefill.stub(), decode.stub(), f"single-{params.seed}", prompt, params)
    assert_same(got, want)
    last = got.last_chunk
    assert (last.blocks_transferred, last.blocks_from_store, last.blocks_recomputed) in ((3, 0, 0), (0, 3, 0))
    assert last.kv_fallback_reason == ""
    assert got.prefill.kv.tail_tokens == 9 and got.prefill.kv.num_tokens == 57
    assert last.tail_tokens_transferred == 9  # the partial block came over the transfer too: nothing recomputed
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.prefill.kv.lease_id and len(got.prefill.kv.blocks) == 3


@pytest.mark.timeout(600)
def test_logprobs_match_one_engine_first_token_from_prefill_rest_from_decode(workers, reference):
    prompt = make_prompt(random.Random(3), 41)
    params = seeded(11, logprobs=3)
    want = reference.generate([prompt], params)[0]
    got = disaggregated(workers[0].stub(), workers[1].stub(), "logprobs", prompt, params)
    assert_same(got, want)
    assert got.prefill.HasField("first_logprobs")
    assert len(want.logprobs) == len(want.token_ids)
    assert_same_entries(got.logprobs, want.logprobs)
    plain = disaggregated(workers[0].stub(), workers[1].stub(), "no-logprobs", prompt, seeded(11))
    assert plain.logprobs == [] and not plain.prefill.HasField("first_logprobs")


@pytest.mark.timeout(600)
def test_prompt_logprobs_come_from_the_prefill_worker_or_the_local_generate(workers, reference):
    from worker_common.client import local

    prompt = make_prompt(random.Random(8), 45)
    params = greedy(4, prompt_logprobs=2, logprobs=1)
    want = reference.generate([prompt], params)[0]
    got = disaggregated(workers[0].stub(), workers[1].stub(), "prompt-logprobs", prompt, params)
    assert_same(got, want)
    assert_same_entries(got.prompt_logprobs, want.prompt_logprobs[1:])
    assert_same_entries(got.logprobs, want.logprobs)
    alone = local(workers[1].stub(), "prompt-logprobs-local", prompt, params)
    assert_same(alone, want)
    assert_same_entries(alone.prompt_logprobs, want.prompt_logprobs[1:])


@pytest.mark.timeout(600)
def test_min_tokens_is_held_by_the_prefill_worker_too(workers, reference):
    """The first token, sampled on the prefill worker, may not be a stop token before min_tokens either."""
    prompt = make_prompt(random.Random(5), 37)
    first = reference.generate([prompt], greedy(4))[0].token_ids[0]
    params = greedy(8, stop_token_ids=(first,), min_tokens=3)
    want = reference.generate([prompt], params)[0]
    got = disaggregated(workers[0].stub(), workers[1].stub(), "min-tokens", prompt, params)
    assert_same(got, want)
    assert got.token_ids[0] != first and got.prefill.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


@pytest.mark.timeout(600)
def test_the_tail_block_carries_the_prompt_tail_and_zeros_after_it(model_path, reference):
    """What the decode worker reads for the tail: a codec block over exactly the prompt's last tokens, its unused
    slots zeroed, never the KV of whichever request held that device block before. A prefill worker with 8 blocks
    reuses blocks from the third request on, so those tails come from dirty blocks."""
    import numpy as np

    from kvstore import codec
    from kvstore.hashing import hash_block
    from kvstore.transfer import Descriptor, TransferConfig, create_agent

    worker = WorkerProcess("prefill", ["--model", model_path, "--transfer", "shm", "--num-blocks", "8",
                                       "--handoff-mib", "4", "--host-tier-mib", "4"])
    agent = create_agent(TransferConfig(backend="shm"))
    shape = reference.runner.kv_cache.shape[1:]                      # [layers, 2, block_size, heads, dim]
    try:
        for i in range(4):
            prompt = make_prompt(random.Random(100 + i), 16 * 3 + 6)
            first = worker.stub().Prefill(worker_pb2.PrefillRequest(
                request_id=f"tail-bytes-{i}", token_ids=prompt, sampling=sampling_to_proto(greedy(2))), timeout=60)
            kv, tail = first.kv, first.kv.tail
            buf = bytearray(tail.length)
            agent.read([Descriptor(tail.agent_address, tail.region_id, tail.offset, tail.length,
                                   tail.transfer_lease_id)], [buf], deadline_s=10.0)
            worker.stub().ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=kv.lease_id), timeout=10)
            decoded = codec.decode(buf, kv.namespace_fingerprint, hash_block(kv.block_hashes[-1], prompt[48:]))
            assert decoded.header.num_tokens == kv.tail_tokens == 6 and list(decoded.tokens) == prompt[48:]
            block = np.frombuffer(bytes(decoded.payload), dtype=np.float32).reshape(shape)
            assert np.count_nonzero(block[:, :, :6]) > 0 and np.count_nonzero(block[:, :, 6:]) == 0, f"request {i}"
    finally:
        agent.close()
        worker.stop()


@pytest.mark.timeout(600)
def test_a_prompt_shorter_than_a_block_hands_over_its_tail_alone(workers, reference):
    prompt = make_prompt(random.Random(9), 11)
    want = reference.generate([prompt], seeded(3))[0]
    got = disaggregated(workers[0].stub(), workers[1].stub(), "tail-only", prompt, seeded(3))
    assert_same(got, want)
    assert not got.prefill.kv.block_hashes and got.prefill.kv.tail_tokens == 11
    assert got.last_chunk.tail_tokens_transferred == 11


def handoff_totals(worker: WorkerProcess) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = {}
    for family in text_string_to_metric_families(httpx.get(worker.metrics_url, timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith(("strata_worker_kv_handoff", "strata_worker_kv_transfer")):
                totals[sample.name + sample.labels.get("source", "")] = sample.value
    return totals


@pytest.mark.timeout(600)
def test_decode_worker_metrics_count_where_the_blocks_came_from(workers):
    before = handoff_totals(workers[1])
    prompt = make_prompt(random.Random(12), 37)   # 2 full blocks + a 5-token tail
    got = disaggregated(workers[0].stub(), workers[1].stub(), "metrics", prompt, greedy(3))
    after = handoff_totals(workers[1])
    last = got.last_chunk
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["strata_worker_kv_handoff_blocks_totaltransferred"] == last.blocks_transferred
    assert delta["strata_worker_kv_handoff_blocks_totalfrom_store"] == last.blocks_from_store
    assert delta["strata_worker_kv_handoff_blocks_totalrecomputed"] == last.blocks_recomputed == 0
    assert delta["strata_worker_kv_handoff_tail_tokens_total"] == last.tail_tokens_transferred == 5
    assert delta["strata_worker_kv_transfer_failures_total"] == 0


@pytest.mark.timeout(600)
def test_sixteen_concurrent_requests_with_shared_prefixes_match_one_engine(workers, reference):
    rng = random.Random(16)
    system_a, system_b = make_prompt(rng, 40), make_prompt(rng, 23)
    prompts = [(system_a if i < 12 else system_b) + make_prompt(rng, rng.randrange(1, 30)) for i in range(16)]
    params = [greedy(10) if i % 2 else seeded(100 + i, 10) for i in range(16)]
    want = reference.generate(prompts, params)
    prefill, decode = workers[0].stub(), workers[1].stub()
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: disaggregated(prefill, decode, f"conc-{i}", prompts[i], params[i]), range(16)))
    for g, w in zip(got, want):
        assert_same(g, w)
    for g in got:
        assert g.last_chunk.blocks_recomputed == 0 and g.last_chunk.kv_fallback_reason == ""


@pytest.mark.timeout(600)
def test_stop_string_and_stop_token_match_one_engine(workers, reference):
    """Text is held back and cut exactly as the single engine does, across the prefill/decode boundary."""
    prefill, decode = workers
    prompt = make_prompt(random.Random(3), 35)
    free = reference.generate([prompt], greedy(16))[0]
    words = free.text.split()
    assert len(words) >= 4, "the tiny model should spell some words"
    for params in (greedy(16, stop=(words[3],)), greedy(16, stop_token_ids=(free.token_ids[5],)),
                   greedy(16, stop=(words[2][:2] + "zz",))):
        want = reference.generate([prompt], params)[0]
        got = disaggregated(prefill.stub(), decode.stub(), f"stop-{params.stop}-{params.stop_token_ids}", prompt,
                            params)
        assert_same(got, want)


@pytest.mark.timeout(600)
def test_first_token_that_ends_the_request_is_answered_by_prefill_alone(workers, reference):
    prefill, decode = workers
    prompt = make_prompt(random.Random(4), 20)
    want = reference.generate([prompt], greedy(1))[0]
    got = disaggregated(prefill.stub(), decode.stub(), "one-token", prompt, greedy(1))
    assert_same(got, want)
    assert got.prefill.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert not got.prefill.kv.lease_id and got.last_chunk is None


@pytest.mark.timeout(600)
def test_salted_requests_match_and_do_not_share_blocks(workers, reference):
    prefill, decode = workers
    prompt = make_prompt(random.Random(5), 48)
    want = reference.generate([prompt], seeded(9))[0]
    plain = disaggregated(prefill.stub(), decode.stub(), "salt-none", prompt, seeded(9))
    salted = disaggregated(prefill.stub(), decode.stub(), "salt-t1", prompt, seeded(9), cache_salt="tenant-1")
    assert_same(plain, want)
    assert_same(salted, want)
    assert plain.prefill.kv.namespace_fingerprint != salted.prefill.kv.namespace_fingerprint
    assert set(plain.prefill.kv.block_hashes).isdisjoint(salted.prefill.kv.block_hashes)


@pytest.mark.timeout(600)
def test_matches_the_offline_llm_api(workers, model_path):
    """The public single-engine API (`strata.llm.LLM`, its own batching defaults) gives the same answers."""
    from strata.llm import LLM

    llm = LLM(model_path, num_blocks=512)
    prefill, decode = workers
    rng = random.Random(8)
    prompts = [make_prompt(rng, n) for n in (16, 33, 70)]
    params = [greedy(8), seeded(77, 8), seeded(78, 8, stop_token_ids=(5,))]
    for i, (prompt, p, want) in enumerate(zip(prompts, params, llm.generate(prompts, params))):
        assert_same(disaggregated(prefill.stub(), decode.stub(), f"llm-{i}", prompt, p), want)
