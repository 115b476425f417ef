"""The Triton fused-MoE kernels (CUDA's path) compute what the per-expert loop computes; on CPU the Triton
interpreter runs them (`TRITON_INTERPRET=1`, set per test: the kernels are jitted on first use). Shapes stay tiny:
the interpreter runs every program instance in Python."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.moe.local import LocalMoE  # noqa: E402
from engine.moe.paths import loop  # noqa: E402
from engine.moe.plan import MoEShape, choose_path  # noqa: E402
from engine.moe.triton_moe import BlockConfig, align_pairs, fused_moe_triton  # noqa: E402
from tests.unit.test_moe_paths import assert_matches_loop, make_batch, make_experts  # noqa: E402

SMALL = BlockConfig(16, 16, 16)      # tl.dot's smallest blocks; H=40 and I=24 leave partial K and N blocks


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_align_pairs_pads_each_expert_run_to_block_m():
    """Pairs (token*k + rank): 0:e0 1:e3 2:e3 3:e1 4:e0 5:e3; e2 has none; pad id is P=6; 5 blocks at most."""
    aligned = align_pairs(torch.tensor([[0, 3], [3, 1], [0, 3]]), num_experts=4, block_m=2)
    assert aligned.pair_ids.tolist() == [0, 4, 3, 6, 1, 2, 5, 6, 6, 6]
    assert aligned.block_expert.tolist() == [0, 1, 3, 3, 4]


def tiny_cases() -> dict[str, tuple]:
    x4, _, w4 = make_batch(4, hidden=40)
    return {
        "one token": make_batch(1, hidden=40),
        "many tokens": make_batch(19, hidden=40),
        "experts with zero tokens": (x4, torch.tensor([[1, 6], [6, 1], [1, 6], [6, 1]]), w4),
        "all tokens on one expert": (x4, torch.stack([torch.arange(4), torch.full((4,), 7)], 1), w4),
    }


@pytest.mark.parametrize("case", list(tiny_cases()))
def test_triton_kernels_match_loop_fp32(case):
    w13, w2 = make_experts(hidden=40, inter=24)
    x, ids, weights = tiny_cases()[case]
    out = fused_moe_triton(x, w13, w2, ids, weights, SMALL)
    assert_matches_loop(out, loop(x, w13, w2, ids, weights))


def test_triton_kernels_bf16_close_to_fp32_loop():
    w13, w2 = make_experts(hidden=40, inter=24, dtype=torch.bfloat16)
    x, ids, weights = make_batch(9, hidden=40, dtype=torch.bfloat16)
    out = fused_moe_triton(x, w13, w2, ids, weights, SMALL)
    assert out.dtype == torch.bfloat16
    assert_matches_loop(out.float(), loop(x.float(), w13.float(), w2.float(), ids, weights.float()), rel=2e-2)


def test_triton_path_with_default_blocks_traces_fullgraph():
    """The kernels sit behind one custom op, so a compiled (CUDA-graphed) step traces through them."""
    torch._dynamo.reset()
    w13, w2 = make_experts()
    x, ids, weights = make_batch(3)
    compiled = torch.compile(LocalMoE(w13, w2, path="triton"), fullgraph=True, dynamic=False)
    assert_matches_loop(compiled(x, ids, weights), loop(x, w13, w2, ids, weights))


def test_cuda_with_triton_picks_triton_eager_and_compiled():
    for tokens in (1, 64):
        for compiling in (False, True):
            assert choose_path(MoEShape(8, 256, 256), tokens, 2, torch.bfloat16, True, compiling, True) == "triton"


def test_cuda_takes_the_grouped_gemm_at_a_few_pairs_per_expert_where_it_measured_faster():
    """128 experts, top 8: up to 2 tokens (<= 0.125 pairs per expert) run torch._grouped_mm (222 vs 370 us at one
    token on an H200), more run Triton (378 vs 475 us at 32); without a usable grouped GEMM, always Triton."""
    wide = MoEShape(128, 2048, 768)
    for compiling in (False, True):
        assert [choose_path(wide, t, 8, torch.bfloat16, True, compiling, True) for t in (1, 2, 3, 32)] == \
            ["grouped", "grouped", "triton", "triton"]
        assert choose_path(wide, 1, 8, torch.bfloat16, True, compiling, False) == "triton"
