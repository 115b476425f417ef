"""Every fused MoE path computes what the per-expert loop computes (fp32: max abs diff <= 1e-5 of the output's
scale), eager and under `torch.compile(fullgraph=True)`, and `LocalMoE` picks a sync-free path when compiling."""
from __future__ import annotations

import pytest
import torch

from engine.moe.local import LocalMoE
from engine.moe.paths import PATHS, SYNC_FREE, grouped_mm_supported, loop
from engine.moe import plan
from engine.moe.plan import MoEShape, choose_path

FUSED = ["dense", "gather", "grouped", "padded"]
REL_TOL = 1e-5
BUCKETS = [1, 2, 4, 8, 16, 32, 64]


def make_experts(experts: int = 8, hidden: int = 32, inter: int = 16, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, hidden, generator=gen).to(dtype),
            torch.randn(experts, hidden, inter, generator=gen).to(dtype))


def make_batch(tokens: int, experts: int = 8, top_k: int = 2, hidden: int = 32, dtype=torch.float32, seed: int = 1):
    """x and a softmax top-k routing of random logits, weights renormalised (Mixtral's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), top_k, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def routing_cases() -> dict[str, tuple]:
    """name -> (x, ids, weights) for E=8, k=2, H=32."""
    x5, _, w5 = make_batch(5)
    x6 = make_batch(6)[0]
    tied_logits = torch.zeros(4, 8)                      # every expert ties: top-k picks some, weights 1/2 each
    tied_w, tied_ids = torch.topk(torch.softmax(tied_logits, -1), 2, dim=-1)
    return {
        "one token": make_batch(1),
        "many tokens": make_batch(37),
        "experts with zero tokens": (x5, torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]]), w5),
        "all tokens on one expert": (x6, torch.tensor([[5, 0], [1, 5], [5, 2], [3, 5], [5, 4], [6, 5]]),
                                     make_batch(6)[2]),
        "top-k ties": (make_batch(4)[0], tied_ids, tied_w / tied_w.sum(-1, keepdim=True)),
        "no tokens": make_batch(0),
    }


def assert_matches_loop(out: torch.Tensor, ref: torch.Tensor, rel: float = REL_TOL) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if ref.numel():
        diff, scale = (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
        assert diff <= rel * scale, f"max abs diff {diff:.3e} > {rel:g} x scale {scale:.3e}"


@pytest.mark.parametrize("case", list(routing_cases()))
@pytest.mark.parametrize("path", FUSED)
def test_path_matches_loop_fp32(path, case):
    w13, w2 = make_experts()
    x, ids, weights = routing_cases()[case]
    assert_matches_loop(PATHS[path](x, w13, w2, ids, weights), loop(x, w13, w2, ids, weights))


@pytest.mark.parametrize("path", FUSED)
def test_path_matches_loop_with_top1_and_many_experts(path):
    w13, w2 = make_experts(experts=64, hidden=64, inter=32)
    x, ids, weights = make_batch(9, experts=64, top_k=1, hidden=64)
    assert_matches_loop(PATHS[path](x, w13, w2, ids, weights), loop(x, w13, w2, ids, weights))


@pytest.mark.parametrize("path", FUSED)
def test_path_bf16_close_to_fp32_loop(path):
    w13, w2 = make_experts(dtype=torch.bfloat16)
    x, ids, weights = make_batch(12, dtype=torch.bfloat16)
    out = PATHS[path](x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    ref = loop(x.float(), w13.float(), w2.float(), ids, weights.float())
    assert_matches_loop(out.float(), ref, rel=2e-2)


def test_local_moe_forward_matches_loop_at_every_bucket():
    w13, w2 = make_experts()
    moe = LocalMoE(w13, w2)
    for tokens in BUCKETS:
        x, ids, weights = make_batch(tokens, seed=tokens)
        assert_matches_loop(moe(x, ids, weights), loop(x, w13, w2, ids, weights))


@pytest.mark.parametrize("shape", [(8, 2, 256, 256), (64, 8, 1024, 512), (8, 2, 30, 14)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiling_picks_a_sync_free_path_at_every_bucket(shape, dtype):
    experts, top_k, hidden, inter = shape
    moe = LocalMoE(torch.empty(experts, 2 * inter, hidden, dtype=dtype), torch.empty(experts, hidden, inter,
                                                                                       dtype=dtype))
    for tokens in BUCKETS:
        assert moe.choose(torch.empty(tokens, hidden, dtype=dtype), top_k, compiling=True) in SYNC_FREE


def test_grouped_is_never_picked_where_grouped_mm_rejects_the_strides():
    """torch._grouped_mm wants every stride a multiple of 16 bytes: H=30 fp32 is not."""
    w13, w2 = make_experts(hidden=30, inter=14)
    moe, x = LocalMoE(w13, w2), torch.empty(64, 30)
    assert not grouped_mm_supported(x, w13, w2)
    assert {moe.choose(x[:t], 2, compiling=c) for t in BUCKETS for c in (False, True)}.isdisjoint({"grouped"})


def test_unknown_path_is_rejected():
    with pytest.raises(ValueError, match="moe path 'fast' is unknown"):
        LocalMoE(*make_experts(), path="fast")


@pytest.mark.parametrize("path,token_counts", [(path, (5,)) for path in FUSED] + [(None, (1, 64))])
def test_compiled_fullgraph_matches_loop(path, token_counts):
    """Each sync-free path, and the by-shape choice (path None), traces with fullgraph=True and static shapes."""
    torch._dynamo.reset()
    w13, w2 = make_experts()
    compiled = torch.compile(LocalMoE(w13, w2, path), fullgraph=True, dynamic=False)
    for tokens in token_counts:
        x, ids, weights = make_batch(tokens, seed=tokens)
        assert_matches_loop(compiled(x, ids, weights), loop(x, w13, w2, ids, weights))


@pytest.mark.parametrize("shape,dtype,compiling,expected", [
    ((8, 2, 256, 256), torch.float32, True, {1: "gather", 8: "gather", 64: "gather"}),
    ((8, 2, 256, 256), torch.bfloat16, True, {1: "gather", 16: "gather", 32: "dense", 64: "grouped"}),
    ((64, 8, 1024, 512), torch.float32, True, {1: "gather", 16: "gather", 32: "grouped", 64: "grouped"}),
    ((64, 8, 1024, 512), torch.bfloat16, True, {8: "gather", 16: "gather", 32: "grouped"}),
    ((8, 2, 256, 256), torch.float32, False, {1: "loop", 2: "grouped", 64: "grouped", 1024: "loop"}),
    ((8, 2, 256, 256), torch.bfloat16, False, {1: "loop", 2: "dense", 32: "dense", 64: "grouped", 1024: "grouped"}),
    ((64, 8, 1024, 512), torch.bfloat16, False, {1: "loop", 2: "grouped", 64: "grouped"}),
])
def test_plan_picks_what_measured_fastest(shape, dtype, compiling, expected, monkeypatch):
    """The table in docs/moe.md (benchmarks/moe_bench.py, a CPU with AVX-512 BF16): the fastest compiled path in
    every measured cell."""
    monkeypatch.setattr(plan, "native_bf16_gemm", lambda: True)
    experts, top_k, hidden, inter = shape
    picked = {t: choose_path(MoEShape(experts, hidden, inter), t, top_k, dtype, False, compiling, True)
              for t in expected}
    assert picked == expected


@pytest.mark.parametrize("compiling,expected", [
    (True, {1: "gather", 8: "gather", 16: "gather", 32: "gather", 64: "gather"}),
    (False, {1: "loop", 2: "grouped", 32: "grouped", 64: "grouped", 1024: "loop"}),
])
def test_plan_without_native_bf16_takes_the_fp32_choices(compiling, expected, monkeypatch):
    """On a CPU without AVX-512 BF16 or AMX, bf16 GEMMs are slow conversions and the dense path (one bf16 GEMM over
    every expert) lost everywhere it was measured (docs/moe.md, AVX2 table): bf16 picks what fp32 picks."""
    monkeypatch.setattr(plan, "native_bf16_gemm", lambda: False)
    shape = MoEShape(8, 256, 256)
    picked = {t: choose_path(shape, t, 2, torch.bfloat16, False, compiling, True) for t in expected}
    assert picked == expected
    assert picked == {t: choose_path(shape, t, 2, torch.float32, False, compiling, True) for t in expected}

