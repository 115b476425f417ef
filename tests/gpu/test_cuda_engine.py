"""The same engine code on CUDA: logits match the CPU path, and generation matches token for token."""
from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from engine.sampling_params import SamplingParams
from strata.llm import LLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_cuda_greedy_matches_cpu(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 12, 40, 41, 7], [3, 3, 8, 100, 150, 22, 90, 17, 4]]
    cpu = LLM(str(ckpt.path), num_blocks=64, block_size=4).generate(prompts, params)
    gpu = LLM(str(ckpt.path), num_blocks=64, block_size=4, device="cuda").generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_cuda_bfloat16_bundled_model_generates():
    out = LLM(None, device="cuda", dtype="bfloat16").generate(["def fibonacci(n):"], SamplingParams(max_tokens=16))
    assert out[0].completion_tokens >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_cuda_compiled_decode_with_cuda_graphs_matches_eager(tiny_checkpoint, arch):
    """The compiled decode step on CUDA (Inductor + CUDA graphs per bucket) gives the eager engine's tokens."""
    ckpt = tiny_checkpoint(arch)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 12, 40, 41, 7], [3, 3, 8, 100, 150, 22, 90, 17, 4], [7, 8, 9]]
    kw = dict(num_blocks=64, block_size=4, device="cuda", max_num_seqs=4)
    eager = LLM(str(ckpt.path), enforce_eager=True, **kw).generate(prompts, params)
    skipped, recorded = (counters["inductor"][k] for k in ("cudagraph_skips", "cudagraph_recorded_non_static_inputs"))
    llm = LLM(str(ckpt.path), enforce_eager=False, **kw)
    compiled = llm.generate(prompts, params)
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert llm.engine.runner.compiled.compilations == 2
    # the graphs were captured: Inductor skips a graph that writes into an input not marked static (the cache)
    assert counters["inductor"]["cudagraph_skips"] == skipped
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > recorded


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_cuda_serving_records_no_cuda_graph_after_warmup(tiny_checkpoint, speculative):
    """Warm-up records the CUDA graphs of every (bucket, table width), for the verify step too; requests whose
    contexts cross several widths then record none (a recording costs a step many times the step itself)."""
    ckpt = tiny_checkpoint("llama")
    llm = LLM(str(ckpt.path), num_blocks=64, block_size=4, device="cuda", max_num_seqs=4, max_model_len=64,
              enforce_eager=False, speculative=speculative, speculative_adaptive=False)
    recorded = counters["inductor"]["cudagraph_recorded_non_static_inputs"]
    prompts = [[5, 9, 12], [3, 4] * 10, [7, 8, 9, 10, 11]]     # 3 to 20 tokens, then 40 more: 1 to 15 blocks
    out = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [40, 40, 40]
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] == recorded
