"""A partial block's KV computed by another engine (a prefill worker's hand-off tail) is installed behind the
cached full blocks: only the remaining token is computed, and the continuation is the one-engine continuation."""
from __future__ import annotations

import random

import torch

from engine.sampling_params import SamplingParams
from strata.llm import LLM

BS = 4


def run(engine, request_id, prompt, params, first_token=None, preload=None, steps_log=None):
    request = engine.add_request(request_id, prompt, params)
    if first_token is not None:
        request.append_output(first_token)
    request.preloaded_kv = preload
    while not request.is_finished:
        for out in engine.step():
            pass
    return request


def test_preloaded_tail_is_used_and_the_continuation_matches(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    prompt = [random.Random(4).randrange(3, 200) for _ in range(4 * BS + 3)]   # 4 full blocks + a 3-token tail
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    want = LLM(str(ckpt.path), num_blocks=64, block_size=BS).generate([prompt], greedy)[0].token_ids

    prefill = LLM(str(ckpt.path), num_blocks=64, block_size=BS).engine
    done = run(prefill, "p", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    tail_kv = prefill.runner.read_blocks([done.freed_block_ids[4]])[0].clone()
    full_kv = prefill.runner.read_blocks(done.freed_block_ids[:4]).clone()
    assert done.output_token_ids == want[:1]

    def decode_engine():
        """A second engine that holds the 4 full blocks in its prefix cache (as installed from a hand-off)."""
        llm = LLM(str(ckpt.path), num_blocks=64, block_size=BS)
        warm = run(llm.engine, "warm", prompt[:4 * BS + 1], SamplingParams(max_tokens=1, ignore_eos=True))
        llm.engine.runner.write_blocks(warm.freed_block_ids[:4], full_kv)
        computed = []
        execute = llm.engine.runner.execute
        llm.engine.runner.execute = lambda batch: computed.append(batch.num_tokens) or execute(batch)
        return llm.engine, computed

    engine, computed = decode_engine()
    got = run(engine, "d", prompt, greedy, first_token=want[0], preload=(tail_kv, 3))
    assert got.output_token_ids == want
    assert computed[0] == 1 and got.num_cached_tokens == 4 * BS  # the tail was not recomputed

    engine, computed = decode_engine()
    wrong = run(engine, "z", prompt, greedy, first_token=want[0], preload=(torch.randn_like(tail_kv) * 5, 3))
    assert computed[0] == 1 and wrong.output_token_ids != want  # the preloaded KV is what the model attends to

    engine, computed = decode_engine()
    unusable = run(engine, "u", prompt, greedy, first_token=want[0], preload=(tail_kv, BS))  # not a partial block
    assert computed[0] == 4 and unusable.output_token_ids == want  # recomputed: 3 tail tokens + the first token
