"""Quantized (fp8 e4m3 / int8) KV cache with per-block, per-head scales (engine/attention/kv_quant.py).

- The write rule equals a straightforward per-(block, head) Python reference byte for byte: fresh blocks (stale
  bytes and scales never survive), appends that grow the scale and appends that do not (then the other slots are
  untouched, exactly), several rows into one block in one call, a chunk spanning blocks.
- The cache layout: one uint8 span per block, scales first, per-layer strided views; read/write_blocks move spans.
- Attention over a quantized cache stays within a stated tolerance of the float cache, on random data and in the
  engine (logits of a tiny model), and the DecodeBuffer stays exact while decode appends grow block scales.
- A block-aligned prompt gives the same greedy tokens (and logits) from a prefix-cache hit as computed cold.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import kv_quant
from engine.attention.torch_paged import TorchPagedAttention
from engine.batch import ScheduledSeq, StepBatch
from engine.config import CacheConfig, ModelConfig
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from worker_common.engine_setup import build_engine_from

QDTYPES = [torch.float8_e4m3fn, torch.int8]
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
BS, HKV, HQ, D = 4, 2, 4, 8
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------------- factories
def make_cache(dtype: torch.dtype, num_blocks: int = 8, layers: int = 1) -> KVCache:
    return KVCache(num_blocks, layers, BS, HKV, D, dtype, CPU)


def make_rows(n: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    return torch.randn(n, HKV, D, generator=torch.Generator().manual_seed(seed)) * spread     # [n, Hkv, D]


def fill_stale(cache: KVCache, seed: int) -> None:
    """Random bytes everywhere (some decode to NaN in fp8), like a block another request held before."""
    cache.tensor.copy_(torch.randint(0, 256, cache.tensor.shape, generator=torch.Generator().manual_seed(seed),
                                     dtype=torch.uint8))
    for layer in cache.layers:   # finite positive scales, so a wrongly kept stale slot shows as a mismatch
        layer.k_scale.copy_(torch.rand(layer.k_scale.shape, generator=torch.Generator().manual_seed(seed)) + 0.1)


def quant_ref(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec: int8 = round-half-even(clamp(y, -127, 127)); fp8 = clamp(y, -448, 448) as float8_e4m3fn."""
    if dtype == torch.int8:
        return torch.round(torch.clamp(y, -127, 127)).to(torch.int8)
    return torch.clamp(y, -448, 448).to(torch.float8_e4m3fn)


def reference_write(values: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, blocks: list[int],
                    offsets: list[int]) -> None:
    """The write rule one (block, head) at a time, in float32 like the spec; `values` uint8 `[nb, bs, H, D]`."""
    dtype = values.dtype
    raw = values.view(torch.uint8)
    for b in dict.fromkeys(blocks):
        written = {offsets[t]: t for t in range(len(blocks)) if blocks[t] == b}
        for h in range(x.shape[1]):
            old = torch.tensor(0.0) if 0 in written else scales[b, h].clone()
            amax = max(x[t, h].float().abs().max() for t in written.values())
            new = torch.maximum(old, amax / QMAX[dtype])
            for slot in range(values.shape[1]):
                if new == 0 or (slot not in written and 0 in written):   # scale 0, or a fresh block's other slots
                    q = torch.zeros(values.shape[-1], dtype=dtype)
                elif slot in written:
                    q = quant_ref(x[written[slot], h].float() / new, dtype)
                else:
                    q = quant_ref(raw[b, slot, h].view(dtype).float() * (old / new), dtype)
                raw[b, slot, h] = q.view(torch.uint8)
            scales[b, h] = new


def write_both(cache: KVCache, x: torch.Tensor, blocks: list[int], offsets: list[int]) -> tuple:
    """Write `x` as K with kv_quant and with the reference into a copy; (ours, reference) (values, scales)."""
    layer = cache.layers[0]
    ref_values, ref_scales = layer.k.view(torch.uint8).clone(), layer.k_scale.clone()
    plan = kv_quant.write_plan(torch.tensor(blocks), torch.tensor(offsets))
    kv_quant.write(x, layer.k, layer.k_scale, plan)
    reference_write(ref_values.view(layer.k.dtype), ref_scales, x, blocks, offsets)
    return (layer.k.view(torch.uint8), layer.k_scale), (ref_values, ref_scales)


def assert_same_bytes(ours: tuple, ref: tuple) -> None:
    assert torch.equal(ours[0], ref[0]), "quantized values differ from the reference"
    assert torch.equal(ours[1], ref[1]), "scales differ from the reference"


# ------------------------------------------------------------------------------------------------ the write rule
@pytest.mark.parametrize("dtype", QDTYPES)
def test_fresh_block_zeroes_stale_slots_and_takes_the_rows_amax(dtype):
    cache = make_cache(dtype)
    fill_stale(cache, seed=1)
    x = make_rows(2, seed=2)
    ours, ref = write_both(cache, x, [5, 5], [0, 1])
    assert_same_bytes(ours, ref)
    layer = cache.layers[0]
    assert torch.equal(layer.k_scale[5], x.abs().amax(dim=(0, 2)) / QMAX[dtype])
    assert not layer.k.view(torch.uint8)[5, 2:].any(), "unwritten slots of a fresh block are zeros"
    assert torch.equal(layer.k.view(torch.uint8)[4], ref[0][4]) and torch.equal(layer.k_scale[4], ref[1][4]), \
        "no other block is touched"


@pytest.mark.parametrize("dtype", QDTYPES)
def test_append_that_grows_the_scale_requantizes_the_older_slots(dtype):
    cache = make_cache(dtype)
    write_both(cache, make_rows(2, seed=3), [1, 1], [0, 1])
    before = cache.layers[0].k_scale[1].clone()
    ours, ref = write_both(cache, make_rows(1, seed=4, spread=10.0), [1], [2])
    assert_same_bytes(ours, ref)
    assert (cache.layers[0].k_scale[1] > before).all(), "a 10x larger row grows every head's scale"


@pytest.mark.parametrize("dtype", QDTYPES)
def test_append_that_does_not_grow_the_scale_leaves_the_other_slots_exactly(dtype):
    cache = make_cache(dtype)
    write_both(cache, make_rows(3, seed=5, spread=10.0), [2, 2, 2], [0, 1, 2])
    layer = cache.layers[0]
    values, scales = layer.k.view(torch.uint8)[2].clone(), layer.k_scale[2].clone()
    ours, ref = write_both(cache, make_rows(1, seed=6, spread=0.01), [2], [3])
    assert_same_bytes(ours, ref)
    assert torch.equal(layer.k_scale[2], scales), "the scale does not change"
    assert torch.equal(layer.k.view(torch.uint8)[2, :3], values[:3]), "re-quantizing at ratio 1 is the identity"


@pytest.mark.parametrize("dtype", QDTYPES)
def test_several_rows_into_one_block_and_a_chunk_spanning_blocks(dtype):
    """A chunk from offset 2 of block 6 over block 3 into offset 1 of block 0: the first block is not fresh (its
    older slots are kept, re-quantized), the other two are."""
    cache = make_cache(dtype)
    fill_stale(cache, seed=7)
    write_both(cache, make_rows(2, seed=8), [6, 6], [0, 1])
    ours, ref = write_both(cache, make_rows(8, seed=9, spread=3.0), [6, 6, 3, 3, 3, 3, 0, 0], [2, 3, 0, 1, 2, 3, 0, 1])
    assert_same_bytes(ours, ref)
    assert not cache.layers[0].k.view(torch.uint8)[0, 2:].any()


@pytest.mark.parametrize("dtype", QDTYPES)
def test_all_zero_rows_keep_scale_zero_and_store_zeros(dtype):
    cache = make_cache(dtype)
    fill_stale(cache, seed=10)
    ours, ref = write_both(cache, torch.zeros(2, HKV, D) * torch.tensor([1.0, -1.0])[:, None, None], [4, 4], [0, 1])
    assert_same_bytes(ours, ref)
    assert not cache.layers[0].k_scale[4].any() and not cache.layers[0].k.view(torch.uint8)[4].any()


@pytest.mark.parametrize("dtype", QDTYPES)
def test_many_random_calls_match_the_reference(dtype):
    """Sequences growing by random chunks (prefill, chunks, decode appends) over shuffled blocks."""
    cache = make_cache(dtype, num_blocks=12)
    fill_stale(cache, seed=11)
    gen = torch.Generator().manual_seed(12)
    tables = [[7, 2, 9], [0, 11, 4]]
    lengths = [0, 0]
    for step in range(10):
        blocks, offsets = [], []
        for s, table in enumerate(tables):
            n = int(torch.randint(1, 5, (1,), generator=gen)) if step < 3 else 1
            n = min(n, len(table) * BS - lengths[s])
            for pos in range(lengths[s], lengths[s] + n):
                blocks.append(table[pos // BS])
                offsets.append(pos % BS)
            lengths[s] += n
        if not blocks:
            break
        spread = float(torch.rand(1, generator=gen)) * 4
        ours, ref = write_both(cache, make_rows(len(blocks), seed=100 + step, spread=spread), blocks, offsets)
        assert_same_bytes(ours, ref)


# ------------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("dtype", QDTYPES)
def test_each_block_is_one_uint8_span_scales_first(dtype):
    cache = make_cache(dtype, num_blocks=3, layers=2)
    scale_bytes, value_bytes = 2 * 2 * HKV * 4, 2 * 2 * BS * HKV * D
    assert cache.quantized and cache.tensor.dtype == torch.uint8
    assert cache.tensor.shape == (3, scale_bytes + value_bytes) == (3, cache.block_bytes)
    assert cache.scale_bytes == scale_bytes and cache.block_shape == (scale_bytes + value_bytes,)
    layer = cache.layers[1]
    assert layer.k.shape == (3, BS, HKV, D) and layer.k.dtype == dtype and layer.k_scale.dtype == torch.float32
    layer.v_scale[2, 1] = 2.5                                  # scales [layers, 2, heads]: layer 1, V, head 1
    assert cache.tensor[2, :scale_bytes].view(torch.float32).tolist() == [0.0] * 7 + [2.5]
    layer.k.view(torch.uint8)[1, 3, 0, 0] = 7                  # values [layers, 2, bs, heads, D]: layer 1, K
    assert cache.tensor[1].nonzero().flatten().tolist() == [scale_bytes + (2 * BS + 3) * HKV * D]


def test_an_unquantized_cache_is_unchanged():
    cache = make_cache(torch.float32, num_blocks=3, layers=2)
    assert not cache.quantized and cache.scale_bytes == 0 and cache.tensor.shape == (3, 2, 2, BS, HKV, D)
    assert isinstance(cache.layers[0], tuple) and not kv_quant.is_quantized(cache.layers[0])


@pytest.mark.parametrize("dtype", QDTYPES)
def test_read_and_write_blocks_move_whole_spans_exactly(dtype):
    cache, other = make_cache(dtype), make_cache(dtype)
    fill_stale(cache, seed=13)
    spans = cache.read_blocks([5, 1])
    assert spans.dtype == torch.uint8 and spans.shape == (2, cache.block_bytes)
    other.write_blocks([0, 6], spans)
    assert torch.equal(other.tensor[0], cache.tensor[5]) and torch.equal(other.tensor[6], cache.tensor[1])
    assert torch.equal(other.layers[0].k_scale[0], cache.layers[0].k_scale[5])
    with pytest.raises(ValueError, match="dtype"):
        other.write_blocks([0], spans[:1].float())


# ---------------------------------------------------------------------------------------------- attention error
def attend_steps(dtype: torch.dtype) -> torch.Tensor:
    """A prefill of two sequences, a pure decode, then a decode mixed with a chunk (start_pos > 0)."""
    cache = KVCache(16, 1, BS, HKV, D, dtype, CPU)
    backend, gen = TorchPagedAttention(), torch.Generator().manual_seed(1)
    batches = [StepBatch([ScheduledSeq("a", [0] * 10, 0, [3, 5, 7]), ScheduledSeq("b", [0] * 6, 0, [1, 2])]),
               StepBatch([ScheduledSeq("a", [0], 10, [3, 5, 7]), ScheduledSeq("b", [0], 6, [1, 2])]),
               StepBatch([ScheduledSeq("a", [0], 11, [3, 5, 7]), ScheduledSeq("b", [0] * 3, 7, [1, 2, 9])])]
    outs = []
    for batch in batches:
        t = sum(len(s.token_ids) for s in batch.seqs)
        q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
        meta = backend.build_metadata(batch, BS, CPU)
        outs.append(backend.forward(q, k * 2, v, cache.layers[0], meta, D ** -0.5))
    return torch.cat(outs)                                                                  # [T, Hq, D]


# Per element, e4m3's 3 mantissa bits round to within 2^-4 relative (int8: half a step of amax / 127); averaged
# over the keys that gives about 3% (fp8) and 0.8% (int8) relative error in the output on random data.
ATTENTION_TOLERANCE = {torch.float8_e4m3fn: 0.05, torch.int8: 0.015}


@pytest.mark.parametrize("dtype", QDTYPES)
def test_attention_over_a_quantized_cache_is_close_to_the_float_cache(dtype):
    ref, got = attend_steps(torch.float32), attend_steps(dtype)
    relative = ((got - ref).norm() / ref.norm()).item()
    assert relative <= ATTENTION_TOLERANCE[dtype], f"relative error {relative:.4f}"
    assert (got - ref).abs().max() <= 3 * ATTENTION_TOLERANCE[dtype] * ref.abs().max()


# ------------------------------------------------------------------------------------------------ engine level
@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama").path)


def make_runner(path: str, kv_cache_dtype: str, num_blocks: int = 32) -> ModelRunner:
    return ModelRunner(ModelConfig(path), CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                      kv_cache_dtype=kv_cache_dtype))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int, rebuild: bool = False,
                  feed: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill the prompts in one step, then `steps` pure-decode steps of the batch feeding back greedy tokens (or
    the greedy tokens of `feed`, another run's logits). `rebuild`: drop the DecodeBuffer before every step (it is
    then re-gathered from the cache)."""
    tables = [list(range(8 * i, 8 * (i + 1))) for i in range(len(prompts))]
    logits = [runner.execute(StepBatch([ScheduledSeq(f"r{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]))]
    lengths = [len(p) for p in prompts]
    for step in range(steps):
        if rebuild:
            runner.attention.invalidate()
        nexts = (logits[-1] if feed is None else feed[step]).argmax(-1).tolist()
        batch = StepBatch([ScheduledSeq(f"r{i}", [nexts[i]], lengths[i], tables[i]) for i in range(len(prompts))])
        logits.append(runner.execute(batch))
        lengths = [n + 1 for n in lengths]
    return torch.stack(logits)                                                              # [steps + 1, B, V]


# (max |error| / max |logit|, relative norm of the error). Measured on the tiny random llama, whose weights have a
# large spread that amplifies K/V error through its layers: fp8 0.081 / 0.055, int8 0.020 / 0.014.
LOGIT_TOLERANCE = {"fp8": (0.12, 0.08), "int8": (0.03, 0.02)}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_tiny_model_logits_stay_close_to_the_model_dtype_cache(llama, kv_cache_dtype):
    """Prefill and 6 decode steps, both runners fed the model-dtype run's greedy tokens."""
    prompts = [tokens(10, 1), tokens(7, 2)]
    runner = make_runner(llama, kv_cache_dtype)
    assert runner.kv_dtype == {"fp8": "float8_e4m3fn", "int8": "int8"}[kv_cache_dtype] and runner.compiled is None
    assert runner.scale_bytes == 2 * 2 * 2 * 4 and runner.block_bytes == runner.scale_bytes + 2 * 2 * BS * 2 * 16
    ref = decode_logits(make_runner(llama, "auto"), prompts, steps=6)
    got = decode_logits(runner, prompts, steps=6, feed=ref)
    max_error = ((got - ref).abs().max() / ref.abs().max()).item()
    norm_error = ((got - ref).norm() / ref.norm()).item()
    assert max_error <= LOGIT_TOLERANCE[kv_cache_dtype][0] and norm_error <= LOGIT_TOLERANCE[kv_cache_dtype][1], \
        f"max {max_error:.4f}, norm {norm_error:.4f}"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_decode_buffer_stays_exact_while_block_scales_grow(llama, kv_cache_dtype):
    """Appending through the DecodeBuffer gives the same logits, bit for bit, as re-gathering every step, while
    decode appends grow the scales of partly filled blocks (so older slots are re-quantized)."""
    prompts = [tokens(5, 3), tokens(9, 4), tokens(2, 5)]
    appended_runner = make_runner(llama, kv_cache_dtype)
    appended = decode_logits(appended_runner, prompts, steps=9)
    rebuilt = decode_logits(make_runner(llama, kv_cache_dtype), prompts, steps=9, rebuild=True)
    assert torch.equal(appended, rebuilt)
    assert appended_runner.attention.buffer.rows == 3, "the steps went through the DecodeBuffer"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_blocks_moved_to_another_runner_continue_identically(llama, kv_cache_dtype):
    """The P->D hand-off for a quantized cache: whole spans (scales included) out of one runner, into other block
    ids of another, and the next decode step's logits are equal."""
    prompt, nxt = tokens(10, 6), tokens(1, 7)
    prefill, decode = make_runner(llama, kv_cache_dtype), make_runner(llama, kv_cache_dtype)
    prefill.execute(StepBatch([ScheduledSeq("a", prompt, 0, [1, 2, 3])]))
    expected = prefill.execute(StepBatch([ScheduledSeq("a", nxt, 10, [1, 2, 3])]))
    spans = prefill.read_blocks([1, 2, 3])
    assert spans.dtype == torch.uint8 and spans.shape == (3, prefill.block_bytes)
    decode.write_blocks([7, 4, 12], spans)
    assert torch.equal(decode.read_blocks([7, 4, 12]), spans)
    assert torch.equal(decode.execute(StepBatch([ScheduledSeq("a", nxt, 10, [7, 4, 12])])), expected)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_prefix_cache_hit_gives_the_cold_greedy_tokens(llama, kv_cache_dtype):
    """A block-aligned prefix (3 blocks) computed by an earlier request and taken from the prefix cache gives the
    same greedy tokens as computing the whole prompt in one call: a fresh prefill attends over the quantized cache,
    so both attend over the same bytes."""
    prefix = tokens(3 * BS, 8)
    prompt, other = prefix + tokens(5, 9), prefix + tokens(6, 10)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1)
    cold = build_engine_from(llama, block_size=BS, num_blocks=64, kv_cache_dtype=kv_cache_dtype).engine
    want = cold.generate([prompt], params)[0]
    warm = build_engine_from(llama, block_size=BS, num_blocks=64, kv_cache_dtype=kv_cache_dtype).engine
    warm.generate([other], params)
    got = warm.generate([prompt], params)[0]
    assert got.num_cached_tokens == 3 * BS and want.num_cached_tokens == 0
    assert got.token_ids == want.token_ids
    # as close as with a model-dtype cache (1e-6 here); attending over the prefill's own unquantized K/V instead
    # differs by ~1 in these logprobs and changes the tokens
    assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_tiny_model_generates_with_a_quantized_cache(llama, kv_cache_dtype):
    bundle = build_engine_from(llama, block_size=BS, num_blocks=64, kv_cache_dtype=kv_cache_dtype)
    assert bundle.kv_dtype == bundle.runner.kv_dtype and bundle.quantized
    outs = bundle.engine.generate([tokens(13, 11), tokens(30, 12)], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12, 12]
    bundle.engine.block_manager.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_sliding_window_layers_read_the_quantized_cache_through_their_masks(tmp_path, kv_cache_dtype):
    """Mistral with a 5-token window over 10-16 token contexts: the windowed prefill and decode paths read the
    dequantized cache like the full-attention ones (close to the model-dtype cache; DecodeBuffer exact)."""
    from tests.unit.test_sliding_window import build_checkpoint as build_sliding

    path = str(build_sliding("mistral", tmp_path).path)
    prompts = [tokens(10, 13), tokens(6, 14)]
    ref = decode_logits(make_runner(path, "auto"), prompts, steps=6)
    got = decode_logits(make_runner(path, kv_cache_dtype), prompts, steps=6, feed=ref)
    max_error = ((got - ref).abs().max() / ref.abs().max()).item()
    assert max_error <= LOGIT_TOLERANCE[kv_cache_dtype][0], f"max {max_error:.4f}"
    rebuilt = decode_logits(make_runner(path, kv_cache_dtype), prompts, steps=6, feed=ref, rebuild=True)
    assert torch.equal(got, rebuilt)
