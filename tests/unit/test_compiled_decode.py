"""The compiled decode step (engine/compiled_decode.py) equals the eager one: logits within 1e-4 (fp32) and identical
greedy tokens on every architecture (Mistral/Mixtral with a sliding window shorter than the context), through
batch padding, block borders and growing contexts; it never recompiles once every bucket has run; and a second
process loads the compiled code from the disk cache instead of compiling again. With an fp8 / int8 KV cache its
in-graph write rule writes exactly the bytes of the reference (engine/attention/kv_quant.py).

Each compile takes seconds to tens of seconds on a CPU, so each architecture compiles only the batch-1 graph; the
graphs for the buckets from 2 up are checked on two MoE architectures (one with a shared expert).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.compiled_decode import batch_buckets
from engine.config import CacheConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from strata.llm import LLM
from tests.unit.test_sliding_window import build_checkpoint as build_sliding

ATOL = 1e-4
BLOCK = 4
VOCAB = 320
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    def get(name: str):
        if name in ("mistral", "mixtral_sliding"):
            return build_sliding("mistral" if name == "mistral" else "mixtral", tmp_path_factory.mktemp(name))
        return tiny_checkpoint(name)
    return get


def runner_pair(path, max_num_seqs: int, kv_cache_dtype: str = "auto") -> tuple[ModelRunner, ModelRunner]:
    cache = CacheConfig(block_size=BLOCK, num_blocks=160, kv_cache_dtype=kv_cache_dtype)
    compiled = ModelRunner(ModelConfig(str(path), enforce_eager=False), cache, max_num_seqs=max_num_seqs,
                           log=lambda line: None)
    eager = ModelRunner(ModelConfig(str(path), enforce_eager=True), cache, max_num_seqs=max_num_seqs)
    assert compiled.compiled is not None and eager.compiled is None
    return compiled, eager


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_both(compiled: ModelRunner, eager: ModelRunner, prompts: list[list[int]], steps: int,
                atol: float = ATOL) -> None:
    """Prefill each prompt (eager on both: same KV), then `steps` decode steps of the whole batch on both runners,
    feeding each the same (eager-argmax) tokens; every step's logits must agree."""
    tables = [list(range(16 * i, 16 * (i + 1))) for i in range(len(prompts))]
    for runner in (compiled, eager):
        for i, p in enumerate(prompts):
            runner.execute(StepBatch([ScheduledSeq(f"r{i}", p, 0, tables[i])]))
    nexts = [p[-1] for p in prompts]
    lengths = [len(p) for p in prompts]
    for _ in range(steps):
        batch = StepBatch([ScheduledSeq(f"r{i}", [nexts[i]], lengths[i], tables[i]) for i in range(len(prompts))])
        assert compiled.compiled.supports(batch)
        ours, ref = compiled.execute(batch), eager.execute(batch)
        assert ours.shape == ref.shape == (len(prompts), compiled.vocab_size) and ours.dtype == torch.float32
        diff = (ours - ref).abs().max().item()
        assert diff <= atol, f"compiled vs eager logits differ by {diff:.2e}"
        assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()
        nexts = ref.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]


@pytest.mark.parametrize("name", ARCHITECTURES + ["mistral", "mixtral_sliding"])
def test_compiled_decode_equals_eager_at_batch_1(checkpoint, name):
    ckpt = checkpoint(name)
    compiled, eager = runner_pair(ckpt.path, max_num_seqs=1)
    assert compiled.compiled.attention.kernel      # Strata's CPU kernel (engine/cpu_kernels) attends here
    # 7 prompt tokens, 12 decode steps: crosses three block borders and (Mistral: window 5, Mixtral: 6) the window
    decode_both(compiled, eager, [tokens(7, seed=1)], steps=12)
    assert compiled.compiled.compilations == 1


@pytest.mark.parametrize("name", ["qwen3_moe", "mistral"])
def test_the_compiled_step_without_the_cpu_kernels_equals_eager(checkpoint, name, monkeypatch):
    """The torch code the CPU kernels replace (engine/cpu_kernels: attention, MoE) still runs where they are
    off: `STRATA_CPU_KERNELS=0`, or a machine where they did not build."""
    monkeypatch.setenv("STRATA_CPU_KERNELS", "0")
    compiled, eager = runner_pair(checkpoint(name).path, max_num_seqs=4)
    assert not compiled.compiled.attention.kernel
    decode_both(compiled, eager, [tokens(7, seed=3), tokens(4, seed=4), tokens(9, seed=5)], steps=8)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_every_bucket_from_2_shares_one_graph_and_never_recompiles(checkpoint, name):
    ckpt = checkpoint(name)
    compiled, eager = runner_pair(ckpt.path, max_num_seqs=8)
    assert compiled.compiled.buckets == [1, 2, 4, 8]
    after_warmup = compiled.compiled.compilations
    # batch 1, and the symbolic batch >= 2 (split once more where the MoE backend changes path with the batch)
    assert 2 <= after_warmup <= 3
    for size, steps in ((3, 6), (8, 5), (2, 9), (5, 4), (1, 3)):   # padded 3 -> 4, 5 -> 8; contexts grow
        prompts = [tokens(5 + 3 * i, seed=10 * size + i) for i in range(size)]
        decode_both(compiled, eager, prompts, steps)
    assert compiled.compiled.compilations == after_warmup, "a steady-state step recompiled"


def test_direct_dispatch_skips_dynamo_only_where_it_gives_the_guarded_outputs(checkpoint, monkeypatch):
    """On a CPU every bucket's steps go straight to its graph's compiled code (no guard evaluation) and still equal
    eager; code that does not give the guarded outputs (here: the static batch-1 graph offered batch 4's inputs) is
    not adopted; `STRATA_GUARDED_DISPATCH=1` keeps every step behind dynamo."""
    path = checkpoint("qwen3_moe").path
    compiled, eager = runner_pair(path, max_num_seqs=4)
    graph = compiled.compiled
    assert graph.direct_buckets == graph.buckets == [1, 2, 4]
    decode_both(compiled, eager, [tokens(5 + i, seed=30 + i) for i in range(3)], steps=4)   # 3 rows -> bucket 4
    graph._direct.pop(4)
    decode_both(compiled, eager, [tokens(6 + i, seed=40 + i) for i in range(3)], steps=1)   # guarded: records
    right = graph._ran[0]
    assert right != 0 and graph.direct_buckets == [1, 2]
    graph._ran[0] = 0                                    # compilation 0: batch 1, static shapes
    graph._adopt(4)
    assert graph.direct_buckets == [1, 2], "another graph's code was adopted"
    graph._ran[0] = right
    graph._adopt(4)
    assert graph.direct_buckets == [1, 2, 4]
    assert graph.compilations == 2

    monkeypatch.setenv("STRATA_GUARDED_DISPATCH", "1")
    guarded, _ = runner_pair(path, max_num_seqs=4)
    assert guarded.compiled.direct_buckets == []
    decode_both(guarded, eager, [tokens(5 + i, seed=50 + i) for i in range(3)], steps=3)


# A quantized cache: the graph's K/V differ from eager ones in the last float bits (other kernels), which can move
# a value across a quantization rounding boundary (one fp8 / int8 step in one element); measured ~5e-6 here.
QUANT_ATOL = 2e-3


@pytest.mark.parametrize("name, kv_cache_dtype", [("mistral", "fp8"), ("llama", "int8")])
def test_compiled_decode_with_a_quantized_cache_equals_eager(checkpoint, name, kv_cache_dtype):
    """Batch 1 and the symbolic batch (3 rows padded to 4), over block borders (fresh blocks, growing scales) and
    Mistral's 5-token window."""
    compiled, eager = runner_pair(checkpoint(name).path, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    assert compiled.cache.quantized and compiled.compiled.compilations == 2
    decode_both(compiled, eager, [tokens(7, seed=2)], steps=9, atol=QUANT_ATOL)
    decode_both(compiled, eager, [tokens(n, seed=n) for n in (3, 9, 6)], steps=9, atol=QUANT_ATOL)
    assert compiled.compiled.compilations == 2


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_the_graph_write_rule_writes_the_reference_bytes(dtype):
    """Given the same rows, the compiled write (QuantizedGraphAttention._write on the cache's flat bytes) and the
    torch reference (kv_quant.write) leave byte-identical caches: fresh blocks, appends that grow the scales (rows
    growing in size every step) and appends that do not."""
    from engine.attention import kv_quant
    from engine.compiled_decode import QuantizedGraphAttention
    from engine.kv_cache import KVCache

    ref, ours = (KVCache(12, 2, BLOCK, 2, 16, dtype, torch.device("cpu")) for _ in range(2))
    ours.tensor.copy_(torch.randint(0, 256, ours.tensor.shape, generator=torch.Generator().manual_seed(0),
                                    dtype=torch.uint8))      # stale bytes: fresh blocks must not keep them
    ref.tensor.copy_(ours.tensor)
    write = torch.compile(QuantizedGraphAttention(ours)._write, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(3 * BLOCK):
        blocks = torch.tensor([3, 7, 9]) + step // BLOCK
        offsets = torch.full((3,), step % BLOCK)
        x = torch.randn(3, 2, 16, generator=gen) * (1 + step % 5)
        for layer in range(2):
            for i in range(2):
                views = ref.layers[layer]
                kv_quant.write(x, views[i], views[2 + i], kv_quant.write_plan(blocks, offsets))
                write(ours.tensor.view(-1), 2 * layer + i, x, blocks, offsets)
        assert torch.equal(ours.tensor, ref.tensor), f"step {step}"


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_the_cuda_warmup_records_every_table_width_a_step_can_use(checkpoint):
    """On CUDA a CUDA graph is recorded per (bucket, table width); warm-up must leave none for serving to record.
    The width logic runs here with the graph's device set to CUDA (only the width rules read it)."""
    runner = ModelRunner(ModelConfig(str(checkpoint("llama").path), enforce_eager=False),
                         CacheConfig(block_size=BLOCK, num_blocks=160), max_num_seqs=1, log=lambda line: None,
                         max_model_len=61)
    graph = runner.compiled
    assert graph.max_blocks == 16 and graph.warmup_widths() == [2]    # CPU: one dynamic width
    graph.device = torch.device("cuda")
    try:
        widths = graph.warmup_widths()
        assert widths == [2, 4, 8, 16]
        # each warm-up step uses exactly its width, and every width a sequence of 1..16 blocks can use is among them
        assert [graph.table_width(graph.warmup_position(w) // BLOCK + 1) for w in widths] == widths
        assert {graph.table_width(blocks) for blocks in range(1, graph.max_blocks + 1)} == set(widths)
        graph.max_blocks = 17                                          # not a power of two: rounds up to 32
        assert graph.warmup_widths()[-1] == 32 == graph.table_width(17)
    finally:
        graph.device = torch.device("cpu")


def test_engine_generates_the_same_tokens_compiled_and_eager(checkpoint):
    """The whole engine (scheduler, sampler, compiled step for pure decodes, eager prefill and mixed steps): greedy
    and seeded sampling give the same tokens as the eager engine, requests joining and leaving mid-way."""
    path = str(checkpoint("qwen3_moe").path)
    kw = dict(block_size=BLOCK, num_blocks=128, max_num_seqs=4, max_num_batched_tokens=32)
    compiled, eager = LLM(path, enforce_eager=False, **kw), LLM(path, enforce_eager=True, **kw)
    prompts = [tokens(n, seed=n) for n in (3, 9, 17, 30, 5, 12)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 7, 15, 3, 25, 11)]
    params[1] = SamplingParams(max_tokens=7, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True)
    a, b = compiled.generate(prompts, params), eager.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert compiled.engine.runner.compiled.compilations <= 3


def test_enforce_eager_and_the_environment_switch(checkpoint, monkeypatch):
    path = str(checkpoint("llama").path)
    cache = CacheConfig(block_size=BLOCK, num_blocks=8)
    monkeypatch.setenv("STRATA_ENFORCE_EAGER", "1")
    assert ModelRunner(ModelConfig(path), cache).compiled is None                      # unset: the env decides
    assert ModelRunner(ModelConfig(path, enforce_eager=True), cache).compiled is None


_RESTART = """
import json, sys, torch
from torch._dynamo.utils import counters
from engine.config import CacheConfig, ModelConfig
from engine.model_runner import ModelRunner
runner = ModelRunner(ModelConfig(sys.argv[1], enforce_eager=False), CacheConfig(block_size=4, num_blocks=8),
                     max_num_seqs=1, log=lambda line: None)
print(json.dumps({"compilations": runner.compiled.compilations, **counters["inductor"]}))
"""


def test_a_restart_loads_the_compiled_step_from_the_disk_cache(checkpoint, tmp_path):
    path = str(checkpoint("qwen3").path)
    env = {**os.environ, "STRATA_COMPILE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _RESTART, path], env=env, capture_output=True, text=True,
                             timeout=600, cwd=REPO)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0
    assert any((tmp_path / "cache").rglob("*")), "nothing was written to the cache folder"
