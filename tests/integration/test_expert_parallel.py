"""Expert parallelism across real processes (two ranks joined over gloo): the `expert_parallel` MoE backend gives the
local backend's outputs, in every architecture's gating, while experts move between ranks, with quantized experts
and with speculation; a rank that dies makes the others fail fast instead of hanging."""
from __future__ import annotations

import os
import time

import pytest
import torch

from engine.batch import ScheduledSeq, StepBatch
from engine.config import CacheConfig, ModelConfig, MoEConfig, SpeculativeConfig
from engine.model_runner import ModelRunner
from engine.moe.backend import MoESetup
from engine.moe.ep_group import EPGroupError
from engine.sampling_params import SamplingParams
from tests.integration.ep_ranks import run_group
from worker_common.engine_setup import build_engine_from

BLOCK = 4
EP = {"backend": "expert_parallel"}


def make_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_runner(path, moe: MoESetup | str = "local", quantization: str | None = None) -> ModelRunner:
    model = ModelConfig(str(path), enforce_eager=True, quantization=quantization)
    return ModelRunner(model, CacheConfig(block_size=BLOCK, num_blocks=64), moe_backend=moe)


def prefill_batch(prompt: list[int]) -> StepBatch:
    return StepBatch([ScheduledSeq("a", prompt, 0, list(range(-(-len(prompt) // BLOCK))), len(prompt))])


def forward_logits(group, rank, path, prompts, moe, quantization=None):
    """Rank r prefills prompts[r] (an empty prompt: the rank idles and still joins the exchanges)."""
    runner = make_runner(path, MoESetup(MoEConfig(**moe), group), quantization)
    batch = prefill_batch(prompts[rank]) if prompts[rank] else StepBatch([])
    assert runner.ep_begin(batch)
    try:
        logits = runner.execute(batch) if batch.seqs else None
        if logits is None:
            runner.ep_idle()
    finally:
        runner.ep_end()
    counts = [m.capacity_counts.tolist() for m in runner.model.modules() if hasattr(m, "capacity_counts")]
    return logits, counts


def local_logits(path, prompt, moe=None, quantization=None):
    runner = make_runner(path, MoESetup(MoEConfig(**(moe or {}))), quantization)
    return runner.execute(prefill_batch(prompt))


@pytest.mark.parametrize("arch,shm", [("mixtral", True), ("qwen2_moe", True), ("qwen3_moe", True),
                                      ("qwen3_moe", False)])
def test_ep2_logits_equal_local_logits_for_each_gating(tiny_checkpoint, arch, shm):
    """Mixtral (top-2 renormalised), Qwen2-MoE (shared expert with its sigmoid gate, no renormalisation) and
    Qwen3-MoE (renormalised): float32 logits within 1e-5 of the local backend, ranks with different batch sizes;
    exchanges through shared memory, and once all through gloo."""
    path = tiny_checkpoint(arch).path
    prompts = [make_prompt(7, 1), make_prompt(12, 2)]
    results = run_group(2, forward_logits, path, prompts, EP, shm_bytes=(8 << 20) if shm else 0)
    for prompt, (logits, _) in zip(prompts, results):
        expected = local_logits(path, prompt)
        assert (logits - expected).abs().max().item() <= 1e-5


def test_ep2_rank_without_requests_joins_and_the_other_rank_is_unchanged(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe").path
    prompts = [make_prompt(9, 3), []]
    (logits, _), (idle, _) = run_group(2, forward_logits, path, prompts, EP)
    assert idle is None
    assert (logits - local_logits(path, prompts[0])).abs().max().item() <= 1e-5


def test_ep2_capacity_drops_are_counted_and_applied_as_locally(tiny_checkpoint):
    """Capacity is per rank and step: each rank drops exactly what the local backend drops on the same batch."""
    path = tiny_checkpoint("qwen3_moe").path
    moe = {"capacity_factor": 0.5, "overflow": "drop"}
    prompts = [make_prompt(16, 4), make_prompt(10, 5)]
    results = run_group(2, forward_logits, path, prompts, {**EP, **moe})
    for prompt, (logits, counts) in zip(prompts, results):
        assert sum(dropped for dropped, _ in counts) > 0
        assert (logits - local_logits(path, prompt, moe)).abs().max().item() <= 1e-5


def test_ep2_int8_experts_equal_local_int8(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe").path
    prompts = [make_prompt(8, 6), make_prompt(5, 7)]
    results = run_group(2, forward_logits, path, prompts, EP, "int8")
    for prompt, (logits, _) in zip(prompts, results):
        assert (logits - local_logits(path, prompt, quantization="int8")).abs().max().item() <= 1e-4


def generate_tokens(group, rank, path, prompts, moe, speculative=None, quantization=None):
    """Each rank generates its share of the prompts greedily; rebalances happen while they decode."""
    spec = None if speculative is None else SpeculativeConfig(speculative, adaptive=False)
    bundle = build_engine_from(str(path), block_size=BLOCK, num_blocks=128, enforce_eager=True,
                               moe=MoEConfig(**moe), ep_group=group, speculative=spec, quantization=quantization,
                               quant_group_size=32)
    mine = prompts[rank::group.world_size]
    outputs = bundle.engine.generate(mine, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ep = bundle.runner.ep
    return [o.token_ids for o in outputs], ep.rebalances, ep.last_rebalance


def local_tokens(path, prompts, quantization=None):
    bundle = build_engine_from(str(path), block_size=BLOCK, num_blocks=128, enforce_eager=True,
                               quantization=quantization, quant_group_size=32)
    outputs = bundle.engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outputs]


def interleave(per_rank: list[list]) -> list:
    out = [None] * sum(map(len, per_rank))
    for rank, items in enumerate(per_rank):
        out[rank::len(per_rank)] = items
    return out


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_ep2_greedy_tokens_equal_local_while_experts_move(tiny_checkpoint, quantization):
    """EPLB every 4 forwards with a spare slot per rank: experts (float, or their packed quantized state) are
    replicated and moved while requests decode (prefill and decode steps, three prompts so one rank idles at the
    end), and no token changes."""
    path = tiny_checkpoint("qwen3_moe").path
    prompts = [make_prompt(6 + 3 * i, 10 + i) for i in range(3)]
    moe = {**EP, "num_redundant_experts": 1, "eplb_interval": 4, "eplb_window": 8}
    results = run_group(2, generate_tokens, path, prompts, moe, None, quantization)
    assert interleave([tokens for tokens, _, _ in results]) == local_tokens(path, prompts, quantization)
    rebalances, last = results[0][1], results[0][2]
    assert rebalances >= 2 and results[1][1] == rebalances      # the same steps on both ranks
    assert last.experts_moved > 0


def test_ep2_with_ngram_speculation_greedy_tokens_equal_local(tiny_checkpoint):
    """Verify steps (several tokens per sequence) run through the exchange like any other forward."""
    path = tiny_checkpoint("qwen3_moe").path
    prompts = [make_prompt(5, 20) * 3, make_prompt(4, 21) * 4]
    results = run_group(2, generate_tokens, path, prompts, EP, "ngram")
    assert interleave([tokens for tokens, _, _ in results]) == local_tokens(path, prompts)


def exchange_both_ways(group, rank):
    """Blocks that fit the shared-memory buffers go through them; a larger exchange through gloo; both exact."""
    small = torch.arange(2 * 1000, dtype=torch.float32).view(2, 1000) + 10_000 * rank
    large = torch.arange(2 * 600_000, dtype=torch.float32).view(2, 600_000) + 10_000_000 * rank   # 4.8 MB
    fits = [group.shm.fits(t.numel() * 4) for t in (small, large)]
    return fits, group.all_to_all(small), group.all_to_all(large), small, large


def test_ep2_exchanges_through_shared_memory_and_gloo_give_every_rank_its_blocks():
    results = run_group(2, exchange_both_ways, shm_bytes=1 << 20)
    for rank, (fits, got_small, got_large, _, _) in enumerate(results):
        assert fits == [True, False]
        for got, index in ((got_small, 3), (got_large, 4)):
            assert torch.equal(got, torch.stack([results[j][index][rank] for j in range(2)]))


def die_after_first_step(group, rank, path):
    """Rank 1 exits without a word after one step; rank 0's next step must raise EPGroupError, not hang."""
    runner = make_runner(path, MoESetup(MoEConfig(**EP), group))
    batch = prefill_batch(make_prompt(6, rank))
    runner.ep_begin(batch)
    runner.execute(batch)
    runner.ep_end()
    if rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        runner.ep_begin(batch)
        runner.execute(batch)
    except EPGroupError as exc:
        return str(exc), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_ep2_dead_rank_fails_the_next_step_fast(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe").path
    [(message, seconds)] = run_group(2, die_after_first_step, path, expect=(0,))
    assert "expert-parallel group" in message and "rank 0 of 2" in message
    assert seconds < 20      # gloo sees the closed socket; the group timeout (120 s here) is never reached
