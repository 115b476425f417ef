"""The int4 and MXFP4 Triton matmuls (plain and grouped by expert) equal their torch references (dequantize, then
matmul in float32), on CPU under the Triton interpreter (`TRITON_INTERPRET=1`, set per test: the kernel is jitted on
first use). Dequantization is exact (an identity input reads the weight back bit for bit); matmuls agree to float32
summation order, bfloat16 ones to bfloat16 output rounding. Shapes stay tiny: the interpreter runs every program
in Python."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.quant.packed import E2M1_VALUES  # noqa: E402
from engine.quant.triton_gemm import (  # noqa: E402
    GEMV_MAX_ROWS, GemvConfig, TileConfig, expert_tiles, int4_dequantize, int4_grouped_matmul,
    int4_grouped_matmul_ref, int4_matmul, int4_matmul_ref, mxfp4_grouped_matmul, mxfp4_grouped_matmul_ref,
    mxfp4_matmul, mxfp4_matmul_ref, pack_int4, unpack_int4)

# tl.dot's smallest tiles; N=24 leaves a partial N tile, K=96 with BLOCK_K=64 a partial K tile that spans groups
SMALL = TileConfig(16, 16, 64)
N, K, GROUP = 24, 96, 32


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)


def make_int4(experts: int = 1, n: int = N, k: int = K, group: int = GROUP) -> tuple[torch.Tensor, ...]:
    """(qpacked [E, n, k/2], scale [E, n, k/g], zero [E, n, k/g]) with codes over all of 0..15."""
    q = torch.randint(0, 16, (experts, n, k))
    scale = torch.rand(experts, n, k // group) * 0.05 + 0.01
    zero = torch.randint(0, 16, (experts, n, k // group)).float()
    return pack_int4(q), scale, zero


def make_mxfp4(experts: int = 1, n: int = N, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, n, k/2], scales [E, n, k/32]): every byte value, exponents around 2 ** 0."""
    blocks = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(122, 131, (experts, n, k // 32), dtype=torch.uint8)
    return blocks, scales


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * max(ref.float().abs().max().item(), 1.0), err


def test_pack_int4_puts_even_columns_in_the_low_nibble():
    packed = pack_int4(torch.tensor([[1, 2, 15, 0]]))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert unpack_int4(packed).tolist() == [[1, 2, 15, 0]]


def test_expert_tiles_never_mix_experts():
    """ends [5, 5, 7] over 8 rows, BLOCK_M 4: e0 rows 0-4 in two tiles, e1 none, e2 rows 5-6; rows 7.. unused."""
    tiles = expert_tiles(torch.tensor([5, 5, 7], dtype=torch.int32), rows=8, block_m=4)
    assert tiles.tile_expert.tolist() == [0, 0, 2, 3, 3]
    assert tiles.tile_row.tolist()[:3] == [0, 4, 5]


def test_int4_kernel_dequantizes_exactly():
    """x = I makes out = w.T: each weight read back, bit for bit, against IntWeight.dequantize."""
    qpacked, scale, zero = (t[0] for t in make_int4())
    out = int4_matmul(torch.eye(K), qpacked, scale, zero, GROUP, SMALL)
    assert torch.equal(out, int4_dequantize(qpacked, scale, zero, GROUP).T)


def test_mxfp4_kernel_dequantizes_every_code_exactly():
    blocks, scales = (t[0] for t in make_mxfp4())
    blocks[1, :8] = torch.tensor([(2 * j + 1) << 4 | 2 * j for j in range(8)], dtype=torch.uint8)  # codes 0..15
    out = mxfp4_matmul(torch.eye(K), blocks, scales, SMALL)
    assert torch.equal(out, mxfp4_matmul_ref(torch.eye(K), blocks, scales))
    values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    assert torch.equal(out[:16, 1] / 2.0 ** (scales[1, 0].item() - 127), values)


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_matmul_matches_reference(rows, dtype, rel):
    qpacked, scale, zero = (t[0] for t in make_int4())
    x = torch.randn(rows, K).to(dtype)
    out = int4_matmul(x, qpacked, scale, zero, GROUP, SMALL)
    assert_close(out, int4_matmul_ref(x, qpacked, scale, zero, GROUP), rel)


@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_mxfp4_matmul_matches_reference(rows, dtype, rel):
    blocks, scales = (t[0] for t in make_mxfp4())
    x = torch.randn(rows, K).to(dtype)
    assert_close(mxfp4_matmul(x, blocks, scales, SMALL), mxfp4_matmul_ref(x, blocks, scales), rel)


def test_int4_group_size_not_dividing_the_k_tile():
    """group 48 with BLOCK_K 64: one k tile holds parts of two groups."""
    qpacked, scale, zero = (t[0] for t in make_int4(group=48))
    x = torch.randn(5, K)
    assert_close(int4_matmul(x, qpacked, scale, zero, 48, SMALL), int4_matmul_ref(x, qpacked, scale, zero, 48), 1e-5)


# 4 experts over 21 rows (+2 past the last end): e0 3 rows, e1 none, e2 17 rows (two M tiles), e3 1 row
ENDS = torch.tensor([3, 3, 20, 21], dtype=torch.int32)


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_grouped_matches_reference_with_an_empty_expert(dtype, rel):
    qpacked, scale, zero = make_int4(experts=4)
    x = torch.randn(23, K).to(dtype)
    out = int4_grouped_matmul(x, qpacked, scale, zero, GROUP, ENDS, SMALL)
    assert_close(out, int4_grouped_matmul_ref(x, qpacked, scale, zero, GROUP, ENDS), rel)
    assert out[21:].eq(0).all()


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_mxfp4_grouped_matches_reference_with_an_empty_expert(dtype, rel):
    blocks, scales = make_mxfp4(experts=4)
    x = torch.randn(23, K).to(dtype)
    out = mxfp4_grouped_matmul(x, blocks, scales, ENDS, SMALL)
    assert_close(out, mxfp4_grouped_matmul_ref(x, blocks, scales, ENDS), rel)
    assert out[21:].eq(0).all()


def test_default_tiles_match_reference():
    qpacked, scale, zero = make_int4(experts=2)
    x, ends = torch.randn(9, K), torch.tensor([4, 9], dtype=torch.int32)
    assert_close(int4_grouped_matmul(x, qpacked, scale, zero, GROUP, ends),
                 int4_grouped_matmul_ref(x, qpacked, scale, zero, GROUP, ends), 1e-5)


def test_empty_batch_gives_an_empty_result():
    qpacked, scale, zero = make_int4(experts=2)
    assert int4_matmul(torch.randn(0, K), qpacked[0], scale[0], zero[0], GROUP).shape == (0, N)
    ends = torch.zeros(2, dtype=torch.int32)
    assert int4_grouped_matmul(torch.randn(0, K), qpacked, scale, zero, GROUP, ends).shape == (0, N)


def test_bad_shapes_are_refused_with_the_field_named():
    qpacked, scale, zero = (t[0] for t in make_int4())
    with pytest.raises(ValueError, match="K // 2"):
        int4_matmul(torch.randn(2, K + 2), qpacked, scale, zero, GROUP)
    with pytest.raises(ValueError, match="group_size=64"):
        int4_matmul(torch.randn(2, K), qpacked, scale, zero, 64)


def test_cpu_without_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    blocks, scales = (t[0] for t in make_mxfp4())
    x = torch.randn(3, K)
    assert torch.equal(mxfp4_matmul(x, blocks, scales), mxfp4_matmul_ref(x, blocks, scales))


# The GEMV (at most GEMV_MAX_ROWS rows, one expert): K=96 in BLOCK_K 32 tiles over 2 splits leaves a split of 2
# tiles and one of 1; BLOCK_K 64 with group 32 reads two groups per tile, with group 64 one (one scale per column).
GEMV_SHAPES = [GemvConfig(16, 32, 2), GemvConfig(16, 64, 3), GemvConfig(8, 32, 16)]


@pytest.mark.parametrize("config", GEMV_SHAPES)
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_int4_gemv_matches_reference(config, dtype, rel):
    for group in (32, 96):
        qpacked, scale, zero = (t[0] for t in make_int4(group=group))
        x = torch.randn(3, K).to(dtype)
        assert_close(int4_matmul(x, qpacked, scale, zero, group, config),
                     int4_matmul_ref(x, qpacked, scale, zero, group), rel)


@pytest.mark.parametrize("config", GEMV_SHAPES)
def test_mxfp4_gemv_matches_reference(config):
    blocks, scales = (t[0] for t in make_mxfp4())
    x = torch.randn(2, K)
    assert_close(mxfp4_matmul(x, blocks, scales, config), mxfp4_matmul_ref(x, blocks, scales), 1e-5)


def test_gemv_dequantizes_exactly_and_small_batches_take_it_by_default(monkeypatch):
    """Rows of the identity read the weight back bit for bit; with no config, M <= GEMV_MAX_ROWS runs the GEMV
    (the GEMM kernel is made to fail) and a larger M the GEMM."""
    import engine.quant.triton_gemm as gemm
    qpacked, scale, zero = (t[0] for t in make_int4())
    dense = int4_dequantize(qpacked, scale, zero, GROUP)                          # [N, K]
    for first in range(0, K, GEMV_MAX_ROWS):
        rows = torch.eye(K)[first:first + GEMV_MAX_ROWS]
        with monkeypatch.context() as m:
            m.setattr(gemm, "_kernels", None)                                     # calling it would raise
            assert torch.equal(int4_matmul(rows, qpacked, scale, zero, GROUP), dense[:, first:first + 4].T)
    with monkeypatch.context() as m:
        m.setattr(gemm, "_gemv_kernels", None)
        x = torch.randn(GEMV_MAX_ROWS + 1, K)
        assert_close(int4_matmul(x, qpacked, scale, zero, GROUP), int4_matmul_ref(x, qpacked, scale, zero, GROUP),
                     1e-5)


def test_gemv_refuses_a_split_it_has_no_slot_for():
    qpacked, scale, zero = (t[0] for t in make_int4())
    with pytest.raises(ValueError, match="split_k"):
        int4_matmul(torch.randn(1, K), qpacked, scale, zero, GROUP, GemvConfig(16, 32, 17))
