"""On CUDA `LocalMoE` runs the Triton kernels (eager and compiled) and matches the per-expert loop."""
from __future__ import annotations

import pytest
import torch

from engine.moe.local import LocalMoE
from engine.moe.paths import loop
from tests.unit.test_moe_paths import assert_matches_loop, make_batch, make_experts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_cuda_picks_triton_and_matches_loop(dtype, rel, tokens):
    w13, w2 = (w.cuda() for w in make_experts(experts=8, hidden=256, inter=128, dtype=dtype))
    x, ids, weights = (t.cuda() for t in make_batch(tokens, experts=8, hidden=256, dtype=dtype))
    moe = LocalMoE(w13, w2)
    assert moe.choose(x, 2) == "triton" and moe.choose(x, 2, compiling=True) == "triton"
    ref = loop(x.float(), w13.float(), w2.float(), ids, weights.float())
    assert_matches_loop(moe(x, ids, weights).float(), ref, rel=rel)
    compiled = torch.compile(moe, fullgraph=True, dynamic=False, mode="reduce-overhead")   # CUDA graphs
    for _ in range(3):
        assert_matches_loop(compiled(x, ids, weights).float(), ref, rel=rel)
