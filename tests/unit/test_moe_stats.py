"""MoE load metrics: pairs per expert and capacity drops as the sparse layers counted them."""
from __future__ import annotations

import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.config import CacheConfig, ModelConfig, MoEConfig
from engine.model_runner import ModelRunner
from engine.moe.backend import MoESetup
from worker_common.moe_stats import MoECollector


def samples(collector: MoECollector) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in collector.collect():
        out.setdefault(family.name, []).extend(family.samples)
    return out


def run_prefill(path, moe: MoEConfig, tokens: int) -> ModelRunner:
    runner = ModelRunner(ModelConfig(str(path), enforce_eager=True), CacheConfig(block_size=4, num_blocks=16),
                         moe_backend=MoESetup(moe))
    prompt = torch.randint(3, 320, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.execute(StepBatch([ScheduledSeq("a", prompt, 0, list(range(-(-tokens // 4))), 1)]))
    return runner


def test_expert_tokens_sum_to_tokens_times_top_k_per_layer(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3_moe")
    runner = run_prefill(ckpt.path, MoEConfig(), 10)
    got = samples(MoECollector("w", runner.model))
    per_layer: dict[str, float] = {}
    for s in got["strata_moe_expert_tokens"]:
        per_layer[s.labels["layer"]] = per_layer.get(s.labels["layer"], 0) + s.value
    sparse = {str(i) for i in runner.spec.moe.sparse_layers}
    assert sparse and per_layer == {layer: 20.0 for layer in sparse}      # 10 tokens x top-2 in every sparse layer
    assert all(s.value == 0 for s in got["strata_moe_capacity_dropped"])
    assert "strata_moe_rank_tokens" not in got            # one process: no per-rank figures


def test_capacity_drops_are_counted_and_leave_the_expert_counts(tiny_checkpoint):
    """Capacity 0.5 over 4 experts, 12 tokens, top-2: each expert takes at most 3 pairs, so at most 12 of the 24
    pairs stay; dropped pairs are counted and not routed."""
    ckpt = tiny_checkpoint("qwen3_moe")
    runner = run_prefill(ckpt.path, MoEConfig(capacity_factor=0.5), 12)
    got = samples(MoECollector("w", runner.model))
    for layer in {str(i) for i in runner.spec.moe.sparse_layers}:
        routed = sum(s.value for s in got["strata_moe_expert_tokens"] if s.labels["layer"] == layer)
        dropped = next(s.value for s in got["strata_moe_capacity_dropped"] if s.labels["layer"] == layer)
        assert routed <= 12 and dropped == 24 - routed


def test_a_dense_model_reports_nothing(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3")
    runner = ModelRunner(ModelConfig(str(ckpt.path), enforce_eager=True), CacheConfig(block_size=4, num_blocks=4))
    assert samples(MoECollector("w", runner.model)) == {}
