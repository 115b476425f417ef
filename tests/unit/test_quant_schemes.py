"""Weight quantization schemes and the modules that run them (engine/quant/schemes, linear.py, packed.py).

Tolerances stated once:
- round trip (quantize -> dequantize), element-wise and exact from each format's grid: int8 and int4 within half
  a step (scale / 2); fp8 within max(|w| * 2**-4, scale * 2**-10); mxfp4 equals the nearest e2m1 grid value
  (ties to the even code) of w / 2**e, with e the smallest exponent that fits the block's amax into 6.
- a quantized linear vs `x @ dequantize().T + b` computed in float32: max abs diff <= 1e-5 x max |ref| when
  the layer computes in float32, 2e-2 x max |ref| when it computes in bfloat16 (bf16 activations, and on CPU
  int8/int4 always: torch's CPU kernels are fast in bf16 only, see engine/quant/kernels.py). fp8 is W8A8: its
  reference multiplies the per-token e4m3 activations (`quantize_per_token`) instead of x. The int8/int4 CPU
  kernels are also checked bit-exact against their bf16 arithmetic (`test_int_cpu_kernels_compute_in_bf16`).
"""
from __future__ import annotations

import logging

import pytest
import torch

from engine import cpu_kernels

import engine.quant.linear as linear_module
from engine.config import quantization_label
from engine.quant.kernels import fp8_mm_cuda, int4_mm_cuda, mxfp4_mm_cuda, quantize_per_token
from engine.quant.linear import (DequantLinear, Fp8Linear, Int4Linear, Int8Linear, Mxfp4Linear,
                                 quantized_linear, triton_int4_layout)
from engine.quant.dequant_tables import dequant_table, mxfp4_dequant
from engine.quant.packed import E2M1_VALUES, Fp8Weight, IntWeight, Mxfp4Weight, concat_rows
from engine.quant.schemes import SCHEMES, make_scheme
from engine.quant.schemes.mxfp4 import e2m1_codes

SCHEME_NAMES = ["int8", "int4", "fp8", "mxfp4"]
MODULES = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear, "mxfp4": Mxfp4Linear}
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_weight(n: int = 96, k: int = 256, seed: int = 0, spread: bool = True) -> torch.Tensor:
    """Gaussian rows; `spread` scales rows and columns over three decades so scales and groups differ."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    if spread:
        w = w * torch.logspace(-2, 1, n)[:, None] * torch.logspace(0, 1, k)[torch.randperm(k, generator=gen)]
    return w


def make_input(*lead: int, k: int = 256, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(*lead, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(name: str, x: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 `x @ dequantize().T + b` (fp8: with x quantized per token as the module does)."""
    x2 = x.reshape(-1, x.shape[-1])
    if name == "fp8":
        a, scale = quantize_per_token(x2)
        x2 = a.float() * scale
    out = x2.float() @ qw.dequantize().T + (0 if bias is None else bias.float())
    return out.view(*x.shape[:-1], -1)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    diff, scale = (out.float() - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3e} > {rel:g} x {scale:.3e}"


# ------------------------------------------------------------------------------------------------ round trips

def test_int8_is_symmetric_per_channel_within_half_a_step():
    w = make_weight()
    qw = make_scheme("int8").quantize(w)
    assert qw.bits == 8 and qw.zero is None and qw.group_size == w.shape[1] and qw.scale.shape == (96, 1)
    assert qw.q.abs().max() == 127 and torch.allclose(qw.scale[:, 0], w.abs().amax(1) / 127)
    assert ((qw.dequantize() - w).abs() <= qw.scale / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_have_integer_zero_points_and_error_within_half_a_step(group_size):
    w = make_weight()
    qw = make_scheme("int4", group_size).quantize(w)
    assert qw.bits == 4 and qw.group_size == group_size and qw.scale.shape == (96, 256 // group_size)
    assert qw.q.min() >= 0 and qw.q.max() <= 15 and qw.zero.min() >= 0 and qw.zero.max() <= 15
    assert qw.zero.dtype == torch.int32
    step = qw.scale.repeat_interleave(group_size, dim=1)                       # [n, k]
    assert ((qw.dequantize() - w).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (IntWeight(qw.q, qw.scale, qw.zero, group_size, 4).dequantize()[w == 0] == 0).all()


def test_int4_refuses_a_group_size_that_does_not_divide_in_features():
    with pytest.raises(ValueError, match=r"in_features 96 is not a multiple of quant_group_size 64.*\[32\]"):
        make_scheme("int4", 64).quantize(make_weight(16, 96))


def test_fp8_is_per_channel_amax_over_448_within_half_an_e4m3_step():
    w = make_weight()
    qw = make_scheme("fp8").quantize(w)
    assert qw.weight.dtype == torch.float8_e4m3fn and torch.allclose(qw.scale, w.abs().amax(1) / 448)
    assert qw.weight.float().abs().amax(1).eq(448).all()
    bound = torch.maximum(w.abs() * 2 ** -4, qw.scale[:, None] * 2 ** -10)
    assert ((qw.dequantize() - w).abs() <= bound * (1 + 1e-6)).all()


def nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Brute force: the e2m1 value nearest each of v (within [-6, 6]), ties to the even code."""
    grid = torch.tensor(E2M1_VALUES)
    dist = (v.abs()[..., None] - grid).abs()                                  # [..., 8]
    best = dist.min(-1, keepdim=True).values
    ties = dist <= best
    codes = torch.arange(8).expand_as(ties)
    even_pref = torch.where(ties, codes % 2 * 16 + codes, 99)                  # an even code wins a tie
    return grid[even_pref.argmin(-1)] * v.sign()


def test_mxfp4_fits_each_block_amax_to_six_and_rounds_to_nearest_even():
    w = make_weight(32, 256)
    qw = make_scheme("mxfp4").quantize(w)
    assert qw.blocks.shape == (32, 128) and qw.scales.shape == (32, 8) and qw.scales.dtype == torch.uint8
    scale = torch.exp2(qw.scales.float() - 127).repeat_interleave(32, dim=1)   # [n, k]
    amax = w.view(32, 8, 32).abs().amax(-1)
    exp = qw.scales.float() - 127
    assert (amax <= 6 * torch.exp2(exp)).all() and (amax > 6 * torch.exp2(exp - 1)).all()   # smallest that fits
    assert torch.equal(qw.dequantize(), nearest_e2m1(w / scale) * scale)


def test_e2m1_codes_on_the_grid_ties_and_signs():
    values = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.5, -0.2, -5.0, 0.3, 5.1])
    expect = [0, 0, 2, 2, 4, 4, 6, 6, 7, 8 | 1, 0, 8 | 6, 1, 7]
    assert e2m1_codes(values).tolist() == expect


def test_mxfp4_known_block():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([12.0, -1.0, 3.0, 0.4])          # amax 12 -> e = 1 (12 / 2 = 6 fits)
    qw = make_scheme("mxfp4").quantize(w)
    assert qw.scales.tolist() == [[128]]
    assert qw.blocks[0, :2].tolist() == [7 | (8 | 1) << 4, 3]   # (6, -0.5) and (1.5, 0.2 -> 0)
    assert qw.dequantize()[0, :4].tolist() == [12.0, -1.0, 3.0, 0.0]


def test_mxfp4_refuses_in_features_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="in_features 48 must be a multiple of the MX block size 32"):
        make_scheme("mxfp4").quantize(torch.randn(4, 48))


def test_scheme_registry_and_fingerprint_tags():
    assert sorted(SCHEMES) == sorted(SCHEME_NAMES)
    assert [make_scheme(n, 64).tag for n in SCHEME_NAMES] == ["int8", "int4-g64", "fp8", "mxfp4"]
    assert quantization_label(None, 128, {}) == "none" and quantization_label("int4", 128, {}) == "int4-g128"
    with pytest.raises(ValueError, match="quantization 'nf4' is unknown"):
        make_scheme("nf4")


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_concat_rows_equals_the_cat_of_dequantized_parts(name):
    scheme = make_scheme(name, 32)
    parts = [scheme.quantize(make_weight(n, 128, seed=n)) for n in (32, 16, 16)]
    joined = concat_rows(parts)
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_concat_rows_refuses_mixed_layouts():
    a = make_scheme("int4", 32).quantize(make_weight(16, 128))
    b = make_scheme("int4", 64).quantize(make_weight(16, 128))
    with pytest.raises(ValueError, match="same .*group_size"):
        concat_rows([a, b])
    perm = torch.randperm(128)
    with pytest.raises(ValueError, match="act-order perms"):
        concat_rows([IntWeight(a.q, a.scale, a.zero, 32, 4, perm), a])
    with pytest.raises(ValueError, match="mix types"):
        concat_rows([a, make_scheme("fp8").quantize(make_weight(16, 128))])


# -------------------------------------------------------------------------------------------- quantized linear

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_quantized_linear_equals_the_dequantized_reference(name, dtype):
    qw = make_scheme(name, 64).quantize(make_weight())
    bias = torch.randn(96)
    module = quantized_linear(qw, bias, dtype, "cpu")
    assert type(module) is MODULES[name]
    x = make_input(3, 5, dtype=dtype)                                           # [3, 5, k]: any leading dims
    out = module(x)
    assert out.shape == (3, 5, 96) and out.dtype == dtype
    bf16_kernel = name in ("int8", "int4")
    assert_close(out, reference(name, x, qw, module.bias), REL_TOL[torch.bfloat16 if bf16_kernel else dtype])


@pytest.mark.parametrize("name", ["int4"] if cpu_kernels.int8_kernel(torch.device("cpu")) else ["int8", "int4"])
def test_int_cpu_kernels_compute_in_bf16(name):
    """float32 activations: bf16(bf16(x) @ W.T) with W's scales (int4: torch's float zeros too) in bf16, exactly."""
    qw = make_scheme(name, 64).quantize(make_weight())
    scale = qw.scale.bfloat16().float().repeat_interleave(qw.group_size, dim=1)           # [n, k]
    if name == "int8":
        w = qw.q.float() * scale
    else:
        zero = ((8 - qw.zero.float()) * qw.scale).bfloat16().float().repeat_interleave(64, dim=1)
        w = (qw.q.float() - 8) * scale + zero
    x = make_input(7)
    out = quantized_linear(qw, None, torch.float32, "cpu")(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, (x.bfloat16().float() @ w.T).bfloat16().float())


def test_int8_runs_strata_cpu_kernel_in_fp32_where_torch_would_round_to_bf16():
    """On a CPU without native bf16 an int8 layer runs `cpu_kernels.int8_linear`: x @ (q * scale).T with the
    activations, scales and sums in fp32 (torch's kernel rounds x, the scales and the output to bf16), as fast or
    faster (engine/cpu_kernels)."""
    qw = make_scheme("int8", 64).quantize(make_weight())
    module = quantized_linear(qw, None, torch.float32, "cpu")
    x = make_input(7)
    want = x @ (qw.q.float() * qw.scale.float().reshape(-1, 1)).T
    if not module.kernel:
        pytest.skip("this CPU multiplies bf16 natively: int8 runs torch's bf16 kernel (the test above)")
    torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(module(x[:1]), want[:1], rtol=1e-5, atol=1e-4)   # one row: the same numbers


def test_int4_symmetric_weight_runs_with_zero_point_8():
    """A symmetric int4 checkpoint weight (signed q in -8..7, no zero) runs on the same kernel."""
    gen = torch.Generator().manual_seed(3)
    qw = IntWeight(torch.randint(-8, 8, (32, 128), generator=gen, dtype=torch.int32),
                   torch.rand(32, 4, generator=gen) + 0.01, None, 32, 4)
    module = quantized_linear(qw, None, torch.float32, "cpu")
    assert type(module) is Int4Linear
    x = make_input(4, k=128)
    assert_close(module(x), reference("int4", x, qw, None), REL_TOL[torch.bfloat16])


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_act_order_perm_is_applied_to_the_input(name):
    base = make_scheme(name, 32).quantize(make_weight(32, 128))
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    qw = IntWeight(base.q, base.scale, base.zero, base.group_size, base.bits, perm)
    x = make_input(4, k=128)
    out = quantized_linear(qw, None, torch.float32, "cpu")(x)
    assert_close(out, reference(name, x[:, perm], qw, None), REL_TOL[torch.bfloat16])


def test_shapes_no_kernel_takes_fall_back_to_dequantize_and_say_why(caplog, monkeypatch):
    """int4 out_features must be a multiple of 16 on CPU; int8 with groups has no kernel."""
    monkeypatch.setattr(linear_module, "_LOGGED", set())
    cases = [make_scheme("int4", 32).quantize(make_weight(24, 64)),
             IntWeight(torch.randint(-127, 128, (16, 64), dtype=torch.int32), torch.rand(16, 2), None, 32, 8)]
    with caplog.at_level(logging.WARNING, logger="engine.quant.linear"):
        modules = [quantized_linear(qw, torch.randn(qw.shape[0]), torch.float32, "cpu") for qw in cases]
    assert all(type(m) is DequantLinear for m in modules)
    assert "int4 out_features 24" in caplog.text and "int8 with groups" in caplog.text
    for qw, module in zip(cases, modules):
        x = make_input(3, k=64)
        assert_close(module(x), reference("int8", x, qw, module.bias), REL_TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mx_table_dequant_equals_the_reference(dtype):
    qw = make_scheme("mxfp4").quantize(make_weight(48, 256))
    assert torch.equal(mxfp4_dequant(qw.blocks, qw.scales, dequant_table("mxfp4", dtype, torch.device("cpu"))),
                       qw.dequantize().to(dtype))


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_quantized_linear_compiles_fullgraph_to_the_same_output(name):
    torch._dynamo.reset()
    module = quantized_linear(make_scheme(name, 32).quantize(make_weight(32, 128)), torch.randn(32),
                              torch.float32, "cpu")
    x = make_input(5, k=128)
    compiled = torch.compile(module, fullgraph=True)
    assert_close(compiled(x), module(x).float(), 1e-5)


def test_fp8_and_mxfp4_weights_keep_their_packed_sizes():
    fp8 = quantized_linear(Fp8Weight(torch.zeros(32, 64).to(torch.float8_e4m3fn), torch.ones(32)), None,
                           torch.float32, "cpu")
    mx = quantized_linear(Mxfp4Weight(torch.zeros(32, 32, dtype=torch.uint8), torch.full((32, 2), 127,
                                      dtype=torch.uint8)), None, torch.bfloat16, "cpu")
    assert fp8.weight.element_size() == 1 and mx.blocks.shape == (32, 32) and mx.scales.shape == (32, 2)


# ------------------------------------------------------------------------ CUDA paths, through CPU references
# No GPU here: engine.quant.triton_gemm runs its torch references on CPU, and torch._scaled_mm has a CPU kernel,
# so the arguments the CUDA branches pass (layouts, zero-point convention, scales, bf16 output) are checked.

@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_int4_and_mxfp4_arguments_match_the_dequantized_reference(compiled):
    torch._dynamo.reset()
    int4 = make_scheme("int4", 32).quantize(make_weight(32, 128))
    mx = make_scheme("mxfp4").quantize(make_weight(32, 128))
    qpacked, scale, zero = triton_int4_layout(int4)
    assert qpacked.shape == (32, 64) and qpacked.dtype == torch.uint8 and zero.dtype == torch.float32

    def both(x):
        return int4_mm_cuda(x, qpacked, scale, zero, 32), mxfp4_mm_cuda(x, mx.blocks, mx.scales)
    x = make_input(3, k=128)
    out4, outmx = (torch.compile(both, fullgraph=True) if compiled else both)(x)
    assert_close(out4, reference("int4", x, int4, None), REL_TOL[torch.float32])
    assert_close(outmx, reference("mxfp4", x, mx, None), REL_TOL[torch.float32])


def test_cuda_fp8_scaled_mm_arguments_match_the_reference():
    qw = make_scheme("fp8").quantize(make_weight())
    x = make_input(5)
    out = fp8_mm_cuda(x, qw.weight, qw.scale.reshape(1, -1))
    assert out.dtype == torch.float32
    assert_close(out, reference("fp8", x, qw, None), REL_TOL[torch.bfloat16])     # bf16 out on CUDA


def test_the_fallback_keeps_the_weight_packed_and_compiles():
    torch._dynamo.reset()
    qw = IntWeight(torch.randint(0, 16, (24, 64), dtype=torch.int32), torch.rand(24, 2) + 0.1,
                   torch.randint(0, 16, (24, 2), dtype=torch.int32), 32, 4, torch.randperm(64))
    module = quantized_linear(qw, None, torch.float32, "cpu")
    assert type(module) is DequantLinear and module.w_q.dtype == torch.int8      # 4-bit codes: one byte each
    x = make_input(3, k=64)
    assert_close(module(x), reference("int4", x[:, qw.perm], qw, None), REL_TOL[torch.float32])
    assert_close(torch.compile(module, fullgraph=True)(x), module(x), REL_TOL[torch.float32])
