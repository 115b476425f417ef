"""The quantized-KV Triton kernels (write rule, decode attention) equal their torch references, on CPU under the
Triton interpreter (`TRITON_INTERPRET=1`, set per test: the kernels are jitted on first use). The write kernel does
the same float32 operations as the reference, so its bytes (codes and scales) must be identical; attention may
differ by float32 summation order. Shapes stay tiny: the interpreter runs every program in Python."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.triton_kv_quant import (  # noqa: E402
    QMAX, paged_decode_attention_quant, paged_decode_attention_quant_ref, write_quantized_kv,
    write_quantized_kv_ref, write_runs)

try:  # the engine's own torch implementation of the same spec, written alongside these kernels
    from engine.attention import kv_quant as engine_kv
except ImportError:
    engine_kv = None
needs_engine_kv = pytest.mark.skipif(engine_kv is None, reason="engine/attention/kv_quant.py is not there yet")

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 2, 16
DTYPES = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)


class QuantCache(NamedTuple):
    buffer: torch.Tensor      # uint8, everything below views into it
    k: torch.Tensor           # [NB, BS, H, D] fp8/int8, strided
    v: torch.Tensor
    k_scale: torch.Tensor     # [NB, H] float32, strided
    v_scale: torch.Tensor


def make_cache(dtype: torch.dtype, buffer: torch.Tensor | None = None, block_size: int = BLOCK_SIZE,
               heads: int = KV_HEADS, dim: int = HEAD_DIM, num_blocks: int = NUM_BLOCKS) -> QuantCache:
    """Views into one block-major uint8 buffer (per block | K codes | V codes | K scales | V scales |), so every
    view is strided, as the engine's are. Filled with random bytes (NaN codes included): fresh blocks must not read
    them."""
    codes = block_size * heads * dim
    row = 2 * codes + 8 * heads
    if buffer is None:
        buffer = torch.randint(0, 256, (num_blocks, row), dtype=torch.uint8)
        buffer[:, 2 * codes:] = torch.rand(num_blocks, 2 * heads).view(torch.uint8)   # valid float scales
    def codes_view(start: int) -> torch.Tensor:
        return buffer[:, start:start + codes].view(dtype).view(num_blocks, block_size, heads, dim)
    def scale_view(start: int) -> torch.Tensor:
        return buffer[:, start:start + 4 * heads].view(torch.float32)
    scales = 2 * codes
    return QuantCache(buffer, codes_view(0), codes_view(codes), scale_view(scales), scale_view(scales + 4 * heads))


def clone(cache: QuantCache, dtype: torch.dtype, **shape) -> QuantCache:
    return make_cache(dtype, cache.buffer.clone(), **shape)


def write_both(cache: QuantCache, ref: QuantCache, new: torch.Tensor, blocks: list[int], offsets: list[int]) -> None:
    ids, offs = torch.tensor(blocks), torch.tensor(offsets)
    write_quantized_kv(cache.k, cache.k_scale, new, ids, offs)
    write_quantized_kv_ref(ref.k, ref.k_scale, new, ids, offs)


def prefilled(dtype: torch.dtype) -> tuple[QuantCache, QuantCache]:
    """Kernel and reference caches after one prefill: seq A 6 rows (block 1 full, block 3 slots 0-1), seq B 3 rows
    (block 4 slots 0-2)."""
    cache = make_cache(dtype)
    ref = clone(cache, dtype)
    write_both(cache, ref, torch.randn(9, KV_HEADS, HEAD_DIM), [1, 1, 1, 1, 3, 3, 4, 4, 4], [0, 1, 2, 3, 0, 1, 0, 1, 2])
    return cache, ref


def test_write_runs_cut_the_batch_into_runs_per_block():
    runs = write_runs(torch.tensor([7, 7, 7, 2, 9, 9]))
    assert runs.first_row.tolist() == [0, 3, 4, 6, 6, 6]
    assert runs.count.tolist() == [3, 1, 2, 0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_spanning_two_blocks_matches_reference_bytes(dtype):
    cache, ref = prefilled(dtype)
    assert torch.equal(cache.buffer, ref.buffer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_block_zeroes_its_unwritten_slots_over_garbage(dtype):
    cache, _ = prefilled(dtype)
    assert cache.k[3, 2:].float().eq(0).all() and cache.k[4, 3:].float().eq(0).all()
    assert not cache.k[3, :2].float().isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_that_grows_the_scale_requantizes_old_rows(dtype):
    """Block 3 (slots 0-1 written) gets slots 2-3 with 10x larger values; block 4 gets one larger row."""
    cache, ref = prefilled(dtype)
    old_scale = cache.k_scale[3].clone()
    new = torch.randn(3, KV_HEADS, HEAD_DIM) * 10
    write_both(cache, ref, new, [3, 3, 4], [2, 3, 3])
    assert torch.equal(cache.buffer, ref.buffer)
    assert (cache.k_scale[3] > old_scale).all()
    assert torch.equal(cache.k_scale[3], new[:2].abs().amax(dim=(0, 2)) / QMAX[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_within_the_scale_keeps_old_codes_and_scale(dtype):
    cache, ref = prefilled(dtype)
    before, scale = cache.k[4, :3].clone(), cache.k_scale[4].clone()
    new = torch.full((1, KV_HEADS, HEAD_DIM), 1e-3)
    write_both(cache, ref, new, [4], [3])
    assert torch.equal(cache.buffer, ref.buffer)
    assert torch.equal(cache.k_scale[4], scale)
    assert torch.equal(cache.k[4, :3].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_batch_and_bf16_rows_match_reference_bytes(dtype):
    """Three sequences, one row each, into three blocks (one of them fresh), from bfloat16 activations."""
    cache, ref = prefilled(dtype)
    new = (torch.randn(3, KV_HEADS, HEAD_DIM) * 2).bfloat16()
    write_both(cache, ref, new, [3, 4, 5], [2, 3, 0])
    assert torch.equal(cache.buffer, ref.buffer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_rows_keep_scale_zero_and_store_positive_zeros(dtype):
    """-0.0 inputs too: e4m3 has a -0 byte (0x80), but a block with scale 0 holds only 0x00."""
    cache, ref = prefilled(dtype)
    write_both(cache, ref, -torch.zeros(2, KV_HEADS, HEAD_DIM), [2, 2], [0, 1])
    assert torch.equal(cache.buffer, ref.buffer)
    write_both(cache, ref, -torch.zeros(1, KV_HEADS, HEAD_DIM), [2], [2])           # append, scale stays 0
    assert torch.equal(cache.buffer, ref.buffer)
    assert cache.k_scale[2].eq(0).all() and cache.k[2].view(torch.uint8).eq(0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_new_rows_from_a_fused_projection(dtype):
    """k sliced out of a fused [T, 3, H, D] projection output is not contiguous."""
    cache, ref = prefilled(dtype)
    qkv = torch.randn(2, 3, KV_HEADS, HEAD_DIM)
    write_both(cache, ref, qkv[:, 1], [5, 5], [0, 1])
    assert torch.equal(cache.buffer, ref.buffer)


def test_encoding_rounds_half_to_even_and_matches_torch_casts():
    """A block whose largest value is QMAX has scale exactly 1, so the codes are the values rounded: ties, e4m3
    subnormals, mantissa carries and -0 must come out as torch's own casts."""
    ties = torch.tensor([0.5, 1.5, 2.5, -2.5, -3.5, 1.0625, 1.1875, 1.95, 15.9, 0.001, 0.0153, -1e-4, -0.0, 300.0])
    for dtype in DTYPES:
        qmax = QMAX[dtype]
        values = torch.cat((ties, torch.randn(BLOCK_SIZE * HEAD_DIM - ties.numel() - 1) * 40)).clamp(-qmax, qmax)
        values = torch.cat((values, torch.tensor([qmax])))
        new = values.view(BLOCK_SIZE, 1, HEAD_DIM).expand(BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        cache = make_cache(dtype)
        write_quantized_kv(cache.k, cache.k_scale, new, torch.full((BLOCK_SIZE,), 2), torch.arange(BLOCK_SIZE))
        assert cache.k_scale[2].eq(1).all()
        expected = values.to(dtype) if dtype == torch.float8_e4m3fn else torch.round(values).to(dtype)
        assert torch.equal(cache.k[2, :, 0].reshape(-1).view(torch.uint8), expected.view(torch.uint8))


def attention_case(dtype: torch.dtype, q_dtype: torch.dtype = torch.float32) -> tuple:
    """Kernel-written cache with three sequences: 7 keys over blocks 1, 3 (A), 2 keys in block 4 (B), 4 keys
    exactly filling block 2 (C); plus a padding row with no keys. GQA: 4 query heads over 2 kv heads."""
    cache = make_cache(dtype)
    k, v = torch.randn(13, KV_HEADS, HEAD_DIM), torch.randn(13, KV_HEADS, HEAD_DIM)
    blocks, offsets = torch.tensor([1] * 4 + [3] * 3 + [4] * 2 + [2] * 4), torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1,
                                                                                          0, 1, 2, 3])
    write_quantized_kv(cache.k, cache.k_scale, k, blocks, offsets)
    write_quantized_kv(cache.v, cache.v_scale, v, blocks, offsets)
    tables = torch.tensor([[1, 3], [4, 0], [2, 0], [0, 0]], dtype=torch.int32)
    context = torch.tensor([7, 2, 4, 0], dtype=torch.int32)
    q = torch.randn(4, 2 * KV_HEADS, HEAD_DIM).to(q_dtype)
    return q, cache, tables, context


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * max(ref.float().abs().max().item(), 1.0), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 3, 100])
def test_decode_attention_matches_reference_fp32(dtype, window):
    q, cache, tables, context = attention_case(dtype)
    args = (q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, context, HEAD_DIM ** -0.5, window)
    out = paged_decode_attention_quant(*args)
    assert_close(out, paged_decode_attention_quant_ref(*args), rel=1e-5)
    assert out[3].eq(0).all()                                             # no keys: zeros, not NaN


def test_decode_attention_bf16_queries():
    q, cache, tables, context = attention_case(torch.float8_e4m3fn, torch.bfloat16)
    args = (q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, context, HEAD_DIM ** -0.5, 5)
    assert_close(paged_decode_attention_quant(*args), paged_decode_attention_quant_ref(*args), rel=1e-2)


def test_decode_attention_window_hides_old_keys():
    """With window 1 a query sees only its own key: the output is that key's value row, for every head."""
    q, cache, tables, context = attention_case(torch.int8)
    out = paged_decode_attention_quant(q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, context, 1.0, 1)
    last_a = cache.v[3, 2].float() * cache.v_scale[3][:, None]                       # seq A's key 6: block 3 slot 2
    assert_close(out[0], last_a.repeat_interleave(2, dim=0), rel=1e-6)


def test_bad_inputs_are_refused_with_the_field_named():
    cache = make_cache(torch.int8)
    with pytest.raises(ValueError, match="new must be"):
        write_quantized_kv(cache.k, cache.k_scale, torch.zeros(2, 3, HEAD_DIM), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="int8"):
        write_quantized_kv(cache.k.float(), cache.k_scale, torch.zeros(1, 2, HEAD_DIM), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention_quant(torch.zeros(1, 3, HEAD_DIM), cache.k, cache.v, cache.k_scale, cache.v_scale,
                                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


def test_cpu_without_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    cache = make_cache(torch.int8)
    ref = clone(cache, torch.int8)
    write_both(cache, ref, torch.randn(3, KV_HEADS, HEAD_DIM), [0, 0, 5], [0, 1, 0])
    assert torch.equal(cache.buffer, ref.buffer)


WRITES = [  # (rows' scale, block ids, offsets): prefill over two blocks + a second sequence, a growing append, a
            # decode batch with a fresh block, an append within the scale, all-zero rows into a fresh block
    (1.0, [1, 1, 1, 1, 3, 3, 4, 4, 4], [0, 1, 2, 3, 0, 1, 0, 1, 2]),
    (10.0, [3, 3, 4], [2, 3, 3]),
    (3.0, [1, 3, 5], [3, 3, 0]),
    (1e-3, [5], [1]),
    (0.0, [2, 2], [0, 1]),
]


@needs_engine_kv
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kernel_matches_the_engine_torch_write_bytes(dtype):
    cache = make_cache(dtype)
    engine = clone(cache, dtype)
    for spread, blocks, offsets in WRITES:
        ids, offs = torch.tensor(blocks), torch.tensor(offsets)
        new = torch.randn(len(blocks), KV_HEADS, HEAD_DIM) * spread
        write_quantized_kv(cache.k, cache.k_scale, new, ids, offs)
        engine_kv.write(new, engine.k, engine.k_scale, engine_kv.write_plan(ids, offs))
        assert torch.equal(cache.buffer, engine.buffer), (spread, blocks)


@needs_engine_kv
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_attention_over_the_engine_gather(dtype):
    q, cache, tables, context = attention_case(dtype)
    out = paged_decode_attention_quant(q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, context, 0.25)
    for b, ctx in enumerate(context.tolist()[:3]):
        blocks = tables[b, :-(-ctx // BLOCK_SIZE)].long()
        k = engine_kv.gather(cache.k, cache.k_scale, blocks, torch.float32).flatten(0, 1)[:ctx]   # [ctx, Hkv, D]
        v = engine_kv.gather(cache.v, cache.v_scale, blocks, torch.float32).flatten(0, 1)[:ctx]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[b].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=0.25, enable_gqa=True)   # [Hq, 1, D]
        assert_close(out[b], expected.squeeze(1), rel=1e-5)
