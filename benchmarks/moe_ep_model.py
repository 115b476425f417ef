"""A whole MoE model's decode at EP 1 and EP 2 (moe_bench part `ep-model`).

`model_ranks(group, spec)` runs on every rank of a 2-rank group, one torch thread each. Per model it builds an EP 1
engine on rank 0 (every expert local) and an expert-parallel engine on every rank (`build_engine_from(...,
moe=MoEConfig(backend="expert_parallel"), ep_group=group)`, eager), then alternates rounds: EP 1 runs all `streams`
requests on rank 0 while rank 1 waits in a collective; EP 2 gives each rank `streams / 2` of them (attention is
data-parallel) and every rank steps in lockstep. A round adds fresh random prompts of `prompt_len` tokens (distinct
per round: no prefix-cache hits), greedy, `decode_steps` new tokens each (EOS ignored), and times each step.
Only pure decode steps count (every request of every rank past its prefill); a round's figure is their mean step
time (EP 2: the slower rank's, step by step), and the result is the median over rounds:
tokens/s = streams / step time.

`many_expert_checkpoint(folder, quick)` writes the random-weight many-expert model (quant_fixtures.py's writer:
config.json for Qwen3MoeForCausalLM, bfloat16 safetensors, the bundled tokenizer; nothing is downloaded).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from engine.config import MoEConfig
from engine.llm_engine import LLMEngine
from engine.moe.ep_group import EPGroup
from engine.sampling_params import SamplingParams
from quant_fixtures import Shape, write_random_checkpoint
from worker_common.engine_setup import build_engine_from

# A Qwen3-30B-A3B-like decoder scaled down to fit and run in seconds on CPU: 64 experts, top-8, hidden 1024,
# expert width 512 (the original: 128 experts, top-8, hidden 2048, 768, 48 layers).
MANY_EXPERT = Shape("moe-64e", hidden=1024, layers=4, intermediate=512, heads=16, kv_heads=4, head_dim=64,
                    vocab=4096, experts=64, top_k=8)
MANY_EXPERT_TINY = Shape("moe-16e-tiny", hidden=128, layers=1, intermediate=64, heads=2, kv_heads=1, head_dim=64,
                         vocab=4096, experts=16, top_k=4)
VOCAB_IDS = 4096                   # the bundled tokenizer's ids; prompts draw from [1, VOCAB_IDS)


class ModelSpec(NamedTuple):
    models: tuple[tuple[str, str], ...]      # (name, checkpoint folder)
    dtype: str
    streams: int
    prompt_len: int
    decode_steps: int
    rounds: int


def many_expert_checkpoint(folder: Path, quick: bool) -> Path:
    return write_random_checkpoint(folder, MANY_EXPERT_TINY if quick else MANY_EXPERT)


def model_ranks(group: EPGroup, spec: ModelSpec) -> list[dict]:
    """Every rank returns the same list."""
    return [_measure(group, name, path, spec) for name, path in spec.models]


def _engine(path: str, spec: ModelSpec, group: EPGroup | None) -> LLMEngine:
    blocks = spec.streams * (-(-(spec.prompt_len + spec.decode_steps + 1) // 16) + 1)
    moe = MoEConfig(backend="expert_parallel") if group is not None else None
    return build_engine_from(path, dtype=spec.dtype, num_blocks=blocks, max_num_seqs=spec.streams,
                             max_num_batched_tokens=max(512, spec.streams * spec.prompt_len), enforce_eager=True,
                             moe=moe, ep_group=group).engine


def _prompts(spec: ModelSpec, round_: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + round_)
    return torch.randint(1, VOCAB_IDS, (spec.streams, spec.prompt_len), generator=gen).tolist()


def _decode_round(engine: LLMEngine, prompts: list[list[int]], spec: ModelSpec, tag: str) -> list[tuple[float, bool]]:
    """(seconds, pure decode on this rank) of every step until the requests (of every rank) finish."""
    params = SamplingParams(max_tokens=spec.decode_steps + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, scheduler = [], engine.scheduler
    while True:
        active = scheduler.num_running + scheduler.num_waiting
        pure = active > 0 and len(scheduler.decoding()) == active
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start, pure))
        if not engine.has_unfinished() and (not engine.lockstep or engine.group_idle):
            return steps


def _round_seconds(group: EPGroup | None, steps: list[tuple[float, bool]]) -> float:
    """Mean pure-decode step time; over a group, step by step the slower rank, pure only where every rank is."""
    seconds = torch.tensor([s for s, _ in steps], dtype=torch.float64)             # [S]
    pure = torch.tensor([float(p) for _, p in steps], dtype=torch.float64)         # [S]
    if group is not None:
        lengths = group.all_gather(torch.tensor([len(steps)]))
        if lengths.min() != lengths.max():
            raise RuntimeError(f"ranks stepped different numbers of times: {lengths.tolist()}")
        seconds, pure = group.all_gather(seconds).amax(dim=0), group.all_gather(pure).amin(dim=0)
    if not pure.any():
        raise RuntimeError("no pure decode step in the round; raise decode_steps")
    return float(seconds[pure.bool()].mean())


def _measure(group: EPGroup, name: str, path: str, spec: ModelSpec) -> dict:
    ep1 = _engine(path, spec, None) if group.rank == 0 else None
    ep2 = _engine(path, spec, group)
    share = spec.streams // group.world_size
    ep1_s, ep2_s = [], []
    for r in range(-1, spec.rounds):                        # round -1 warms both engines up, unrecorded
        prompts = _prompts(spec, r + 1)
        for mode in ("ep1", "ep2") if r % 2 == 0 else ("ep2", "ep1"):
            group.all_reduce_sum(torch.zeros(1))            # start together; EP 1's peer waits here
            if mode == "ep1" and ep1 is not None:
                seconds = _round_seconds(None, _decode_round(ep1, prompts, spec, f"ep1-{r}"))
                ep1_s += [seconds] if r >= 0 else []
            elif mode == "ep2":
                mine = prompts[group.rank * share:(group.rank + 1) * share]
                seconds = _round_seconds(group, _decode_round(ep2, mine, spec, f"ep2-{r}"))
                ep2_s += [seconds] if r >= 0 else []
    ep1_all = group.all_gather(torch.tensor(ep1_s or [0.0] * spec.rounds, dtype=torch.float64))[0]
    ep1_step, ep2_step = statistics.median(ep1_all.tolist()), statistics.median(ep2_s)
    return {"model": name, "dtype": spec.dtype, "streams": spec.streams, "prompt_len": spec.prompt_len,
            "decode_steps": spec.decode_steps, "rounds": spec.rounds,
            "ep1_tokens_per_s": spec.streams / ep1_step, "ep2_tokens_per_s": spec.streams / ep2_step,
            "ep2_over_ep1": ep1_step / ep2_step, "ep1_step_ms": [1e3 * t for t in ep1_all.tolist()],
            "ep2_step_ms": [1e3 * t for t in ep2_s]}


def print_model(cells: list[dict]) -> None:
    for c in cells:
        print(f"ep-model {c['model']:>12} {c['dtype']} {c['streams']} streams, decode | EP1 "
              f"{c['ep1_tokens_per_s']:7.0f} tok/s  EP2 {c['ep2_tokens_per_s']:7.0f} tok/s  EP2/EP1 "
              f"{c['ep2_over_ep1']:.2f}x", flush=True)
