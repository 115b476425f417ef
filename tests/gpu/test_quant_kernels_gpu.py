"""On CUDA the quantized-weight matmuls and the quantized-KV kernels (compiled, not interpreted) equal their torch
references at realistic shapes: the write kernel's bytes exactly (it uses IEEE division and its own e4m3 encoder,
so GPU and CPU agree bit for bit), matmuls and attention to float32 / bfloat16 tolerance; and the KV kernels replay
inside a CUDA graph (no host sync)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.triton_kv_quant import (  # noqa: E402
    paged_decode_attention_quant, paged_decode_attention_quant_ref, write_quantized_kv, write_quantized_kv_ref)
from engine.quant.triton_gemm import (  # noqa: E402
    int4_grouped_matmul, int4_grouped_matmul_ref, int4_matmul, int4_matmul_ref, mxfp4_grouped_matmul,
    mxfp4_grouped_matmul_ref, mxfp4_matmul, mxfp4_matmul_ref)
from tests.unit.test_triton_kv_quant import DTYPES, QuantCache, assert_close, make_cache  # noqa: E402
from tests.unit.test_triton_quant_gemm import make_int4, make_mxfp4  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)]
BS, HKV, HQ, D, NUM_BLOCKS = 16, 8, 32, 128, 64


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def cuda(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype,rel", TOLERANCE)
@pytest.mark.parametrize("rows", [1, 3, 37, 512])     # 1 and 3: the GEMV kernel
def test_int4_matmul_cuda(dtype, rel, rows):
    qpacked, scale, zero = cuda(*(t[0] for t in make_int4(n=1024, k=4096, group=128)))
    x = torch.randn(rows, 4096, device="cuda", dtype=dtype)
    assert_close(int4_matmul(x, qpacked, scale, zero, 128), int4_matmul_ref(x, qpacked, scale, zero, 128), rel)


@pytest.mark.parametrize("dtype,rel", TOLERANCE)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_mxfp4_matmul_cuda(dtype, rel, rows):
    blocks, scales = cuda(*(t[0] for t in make_mxfp4(n=2880, k=2880)))
    x = torch.randn(rows, 2880, device="cuda", dtype=dtype)
    assert_close(mxfp4_matmul(x, blocks, scales), mxfp4_matmul_ref(x, blocks, scales), rel)


def expert_ends(experts: int, rows: int) -> torch.Tensor:
    """Random group sizes summing to `rows`, every fourth expert empty."""
    counts = torch.rand(experts) * (torch.arange(experts) % 4 != 0)
    ends = torch.cumsum(torch.floor(counts / counts.sum() * rows), 0)
    ends[-1] = rows
    return ends.to(torch.int32).cuda()


@pytest.mark.parametrize("dtype,rel", TOLERANCE)
def test_grouped_matmuls_cuda(dtype, rel):
    ends, x = expert_ends(32, 300), torch.randn(300, 1024, device="cuda", dtype=dtype)
    qpacked, scale, zero = cuda(*make_int4(experts=32, n=512, k=1024, group=128))
    assert_close(int4_grouped_matmul(x, qpacked, scale, zero, 128, ends),
                 int4_grouped_matmul_ref(x, qpacked, scale, zero, 128, ends), rel)
    blocks, scales = cuda(*make_mxfp4(experts=32, n=512, k=1024))
    assert_close(mxfp4_grouped_matmul(x, blocks, scales, ends), mxfp4_grouped_matmul_ref(x, blocks, scales, ends), rel)


def gpu_cache(dtype: torch.dtype) -> tuple[QuantCache, QuantCache]:
    """(CUDA cache, CPU copy for the reference), garbage-filled."""
    ref = make_cache(dtype, block_size=BS, heads=HKV, dim=D, num_blocks=NUM_BLOCKS)
    return make_cache(dtype, ref.buffer.cuda(), block_size=BS, heads=HKV, dim=D, num_blocks=NUM_BLOCKS), ref


def prefill_then_decode(cache: QuantCache, ref: QuantCache, lengths: list[int], steps: int) -> list[list[int]]:
    """Prefill sequences of `lengths` (blocks handed out in order), then `steps` single-token decodes with growing
    values, writing K and V through the kernel (CUDA) and the reference (CPU); returns the block tables."""
    tables, next_block = [], 1
    for length in lengths:
        tables.append(list(range(next_block, next_block + (length + steps + BS - 1) // BS)))
        next_block += len(tables[-1])
    def write(positions: list[list[int]], spread: float) -> None:
        ids = torch.tensor([t[p // BS] for t, ps in zip(tables, positions) for p in ps])
        offs = torch.tensor([p % BS for ps in positions for p in ps])
        for codes, scale, ref_codes, ref_scale in ((cache.k, cache.k_scale, ref.k, ref.k_scale),
                                                   (cache.v, cache.v_scale, ref.v, ref.v_scale)):
            new = torch.randn(ids.numel(), HKV, D) * spread
            write_quantized_kv(codes, scale, new.cuda(), ids.cuda(), offs.cuda())
            write_quantized_kv_ref(ref_codes, ref_scale, new, ids, offs)
    write([list(range(n)) for n in lengths], 1.0)
    for step in range(steps):
        write([[n + step] for n in lengths], 1.0 + step)
    return tables


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_bytes_equal_reference_cuda(dtype):
    cache, ref = gpu_cache(dtype)
    prefill_then_decode(cache, ref, [40, 16, 7, 1], steps=20)
    assert torch.equal(cache.buffer.cpu(), ref.buffer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_dtype,rel", TOLERANCE)
@pytest.mark.parametrize("window", [None, 24])
def test_decode_attention_cuda(dtype, q_dtype, rel, window):
    cache, ref = gpu_cache(dtype)
    lengths = [200, 40, 16, 7, 1]
    tables = prefill_then_decode(cache, ref, lengths, steps=2)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    context = torch.tensor([n + 2 for n in lengths], dtype=torch.int32, device="cuda")
    q = torch.randn(len(lengths), HQ, D, device="cuda", dtype=q_dtype)
    args = (q, cache.k, cache.v, cache.k_scale, cache.v_scale, block_tables, context, D ** -0.5, window)
    assert_close(paged_decode_attention_quant(*args), paged_decode_attention_quant_ref(*args), rel)


def test_kv_kernels_replay_in_a_cuda_graph():
    """Fresh blocks each step: doubling V doubles its scales, not its codes, so the output doubles."""
    cache, _ = gpu_cache(torch.float8_e4m3fn)
    ids, offs = torch.tensor([1, 1, 2], device="cuda"), torch.tensor([0, 1, 0], device="cuda")
    new_k, new_v = torch.randn(3, HKV, D, device="cuda"), torch.randn(3, HKV, D, device="cuda")
    q = torch.randn(2, HQ, D, device="cuda")
    tables = torch.tensor([[1], [2]], dtype=torch.int32, device="cuda")
    context = torch.tensor([2, 1], dtype=torch.int32, device="cuda")
    def step() -> torch.Tensor:
        write_quantized_kv(cache.k, cache.k_scale, new_k, ids, offs)
        write_quantized_kv(cache.v, cache.v_scale, new_v, ids, offs)
        return paged_decode_attention_quant(q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, context, 0.1)
    expected = step().clone()                           # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new_v.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, 2.0 * expected, 1e-5)


@pytest.mark.parametrize("scheme", ["int4", "mxfp4"])
def test_quantized_moe_on_cuda_runs_grouped_and_equals_the_dequantized_loop(scheme):
    """The engine's CUDA MoE path: experts built on the GPU stack into one grouped GEMM per projection."""
    from engine.moe.paths import loop
    from engine.quant.moe import quantized_experts
    from engine.quant.schemes import make_scheme
    torch.manual_seed(0)
    quant, experts, hidden, inter = make_scheme(scheme, 128), 8, 512, 256
    w13 = [quant.quantize(torch.randn(2 * inter, hidden) * 0.05) for _ in range(experts)]
    w2 = [quant.quantize(torch.randn(hidden, inter) * 0.05) for _ in range(experts)]
    moe = quantized_experts(w13, w2, torch.bfloat16, "cuda")
    assert moe.grouped is not None and moe.grouped.kind == scheme
    x = torch.randn(33, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.topk(torch.randn(33, experts, device="cuda"), 2).indices
    weights = torch.softmax(torch.randn(33, 2, device="cuda"), -1).to(torch.bfloat16)
    want = loop(x.float(), torch.stack([q.dequantize() for q in w13]).cuda(),
                torch.stack([q.dequantize() for q in w2]).cuda(), ids, weights.float())
    torch.testing.assert_close(moe(x, ids, weights).float(), want, rtol=3e-2, atol=3e-2)
