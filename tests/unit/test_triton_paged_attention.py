"""The "triton" attention backend (the Triton quantized-KV kernels inside the engine, as CUDA runs them) against the
torch backend, on CPU under the Triton interpreter, for fp8 and int8 KV: after prefills the same cache bytes (the
write kernel writes the torch write rule's bytes), and the same greedy tokens through prefill, a prefix hit and
decode. (After decode steps the bytes may differ: the decode kernel's float rounding is not SDPA's, and the next
layers' K/V follow it.)"""
from __future__ import annotations

import pytest
import torch

import engine.attention.triton_paged as triton_paged
from engine.sampling_params import SamplingParams
from strata.llm import LLM

PROMPTS = [[5 + i for i in range(37)], [40 + 3 * i for i in range(21)], [5 + i for i in range(37)] + [9, 9]]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_triton_backend_writes_the_same_cache_and_tokens_as_torch(tiny_checkpoint, kv, monkeypatch):
    calls = {"write": 0, "decode": 0}
    for name, key in (("write_quantized_kv", "write"), ("paged_decode_attention_quant", "decode")):
        real = getattr(triton_paged, name)
        monkeypatch.setattr(triton_paged, name, lambda *a, _real=real, _key=key, **kw: (
            calls.__setitem__(_key, calls[_key] + 1), _real(*a, **kw))[1])
    path = str(tiny_checkpoint("qwen3_moe").path)
    engines = {name: LLM(path, attention=name, kv_cache_dtype=kv, num_blocks=64, enforce_eager=True)
               for name in ("torch", "triton")}
    assert type(engines["triton"].engine.runner.attention).__name__ == "TritonPagedAttention"
    first = {name: [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=1))]
             for name, llm in engines.items()}
    caches = [llm.engine.runner.kv_cache for llm in engines.values()]
    assert torch.equal(caches[0], caches[1])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {name: [o.token_ids for o in llm.generate(PROMPTS, params)] for name, llm in engines.items()}
    assert first["triton"] == first["torch"] and outs["triton"] == outs["torch"]
    assert calls["write"] > 0 and calls["decode"] > 0      # the kernels ran, not the torch paths
