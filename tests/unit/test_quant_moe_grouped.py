"""The quantized MoE's CUDA path (two grouped Triton GEMMs over stacked packed experts, engine/quant/moe_grouped.py)
against the per-expert loop over the same experts dequantized, on CPU under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

from engine.moe.paths import loop
from engine.quant.linear import triton_int4_layout
from engine.quant.moe import quantized_experts
from engine.quant.moe_grouped import GroupedExperts, _stack
from engine.quant.schemes import make_scheme

E, H, I, T, K = 4, 64, 32, 5, 2


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def experts(scheme: str, seed: int = 0):
    torch.manual_seed(seed)
    quant = make_scheme(scheme, 32)
    w13 = [quant.quantize(torch.randn(2 * I, H) * 0.2) for _ in range(E)]
    w2 = [quant.quantize(torch.randn(H, I) * 0.2) for _ in range(E)]
    return w13, w2


def stacked(scheme: str, parts) -> tuple[torch.Tensor, ...]:
    if scheme == "int4":
        layouts = [triton_int4_layout(qw) for qw in parts]
        return tuple(torch.stack([layout[i] for layout in layouts]) for i in range(3))
    return torch.stack([qw.blocks for qw in parts]), torch.stack([qw.scales for qw in parts])


@pytest.mark.parametrize("scheme", ["int4", "mxfp4"])
def test_grouped_quantized_experts_equal_the_loop_over_dequantized_experts(scheme):
    w13, w2 = experts(scheme)
    grouped = GroupedExperts(scheme, stacked(scheme, w13), stacked(scheme, w2), 32)
    x = torch.randn(T, H)
    ids = torch.tensor([[0, 2], [2, 3], [0, 3], [3, 2], [2, 0]])     # expert 1 gets no token
    weights = torch.softmax(torch.randn(T, K), dim=-1)
    want = loop(x, torch.stack([qw.dequantize() for qw in w13]), torch.stack([qw.dequantize() for qw in w2]),
                ids, weights)
    got = grouped.forward(x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_stacking_points_every_expert_at_its_slice_without_a_second_copy():
    modules = [torch.nn.Module() for _ in range(3)]
    for i, m in enumerate(modules):
        m.register_buffer("blocks", torch.full((4, 2), i, dtype=torch.uint8))
    (stack,) = _stack(modules, ("blocks",))
    assert stack.shape == (3, 4, 2) and [int(m.blocks[0, 0]) for m in modules] == [0, 1, 2]
    assert all(m.blocks.data_ptr() == stack[i].data_ptr() for i, m in enumerate(modules))
    assert all("blocks" in dict(m.named_buffers()) for m in modules)


def test_cpu_experts_keep_the_per_expert_path():
    w13, w2 = experts("int4")
    moe = quantized_experts(w13, w2)
    assert moe.grouped is None
