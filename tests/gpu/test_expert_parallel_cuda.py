"""Expert parallelism over NCCL: two ranks, each on its own GPU (NCCL cannot put two ranks on one device), give the
local backend's outputs, and experts move between the GPUs. Needs two CUDA devices; skipped with fewer."""
from __future__ import annotations

import pytest
import torch

from engine.config import MoEConfig
from engine.moe.backend import MoESetup, make_moe_backend
from engine.moe.ep_step import ExpertParallelStep
from engine.moe.router import route_topk
from tests.integration.ep_ranks import run_group

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (one rank each)")]


def ep_layer_on_gpus(group, rank):
    torch.manual_seed(0)
    device = group.device
    experts, hidden, inter, k = 8, 64, 32, 2
    w13 = torch.randn(experts, 2 * inter, hidden, device=device)
    w2 = torch.randn(experts, hidden, inter, device=device)
    config = MoEConfig(backend="expert_parallel", num_redundant_experts=1)
    layer = make_moe_backend(MoESetup(config, group), w13.clone(), w2.clone())
    layer.post_load()
    local = make_moe_backend("local", w13, w2)
    x = torch.randn(5 + 3 * rank, hidden, device=device)
    weights, ids = route_topk(torch.randn(x.shape[0], experts, device=device), k, True, torch.float32)
    errors = []
    for move in (False, True):
        if move:
            layer.window.add([100, 1, 1, 1, 50, 1, 1, 1])
            ExpertParallelStep(group, [layer], config, k, torch.float32).rebalance()
        group.join_step(x.shape[0])
        out = layer(x, ids, weights)
        group.end_step()
        errors.append((out - local(x, ids, weights)).abs().max().item() / local(x, ids, weights).abs().max().item())
    return errors


def test_ep2_over_nccl_equals_local_before_and_after_experts_move():
    for errors in run_group(2, ep_layer_on_gpus, backend="nccl"):
        assert max(errors) <= 1e-5
