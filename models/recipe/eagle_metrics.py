"""Held-out measurements of the EAGLE head (and, for comparison, of a standalone draft model) against the target.

Step 1 (teacher-forced features): top-1 agreement (argmax of the draft for t_{n+2} == the target's argmax at n+1)
and the expected acceptance at temperature 1, mean sum_v min(p_target, p_draft).

Multi-step greedy: from every start n (context t_0..t_{n+1}) the drafter proposes d_{n+2}, ..., d_{n+1+K} on its
own outputs; the target then VERIFIES the chain exactly as speculative decoding does, one pass over t_0..t_{n+1}
followed by the drafts (``eagle_head.block_mask`` with offset 1), so its greedy token for draft j is conditioned on
drafts 1..j-1, not on the held-out text. P(first j match) is the fraction of starts whose first j drafts all equal
the target's greedy tokens; with k drafts per target forward a greedy step emits 1 + sum_{j<=k} P(first j match)
tokens on average.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from eagle_head import EagleHead, Target, autocast, block_mask, block_positions, shift_left, unroll

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens, mask, positions) -> logits


@torch.inference_mode()
def step1_metrics(head: EagleHead, target: Target, windows: torch.Tensor, chunk: int = 8) -> dict:
    """Top-1 agreement, expected acceptance and the head's perplexity on the true tokens, over ``windows``."""
    sums = {"agree": 0.0, "accept": 0.0, "ce": 0.0}
    positions = ce_positions = 0
    for i in range(0, len(windows), chunk):
        rows = windows[i : i + chunk]  # [b, T + 1]
        out = target.run(rows)
        with autocast():
            g = unroll(head, target, rows[:, 1:], out.feats[:, :-1], steps=1)[0]  # head rows n = 0..T-1
            d = target.draft_logits(g)  # [b, T, vocab]: predicts t_{n+2}
        t = out.logits[:, 1:]  # the target's prediction of t_{n+2}
        sums["agree"] += (d.argmax(-1) == t.argmax(-1)).sum().item()
        sums["accept"] += torch.minimum(d.softmax(-1), t.softmax(-1)).sum(-1).sum().item()
        sums["ce"] += F.cross_entropy(d[:, :-1].reshape(-1, d.size(-1)), rows[:, 2:].reshape(-1),
                                      reduction="sum").item()
        positions += t.shape[0] * t.shape[1]
        ce_positions += rows[:, 2:].numel()
    return {"step1_positions": positions, "top1_agreement": sums["agree"] / positions,
            "expected_acceptance_t1": sums["accept"] / positions,
            "head_heldout_perplexity": math.exp(sums["ce"] / ce_positions)}


def chain_argmax(run: Runner, rows: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of a causal LM over ``rows`` [b, R] and, per row n, the chain ``chain[:, n]`` [b, R, B]
    placed after t_0..t_{n+1}. Returns [b, B + 1, R]: block 0 = teacher-forced, block j row n = after chain[:, n, :j].
    """
    b, r = rows.shape
    blocks = chain.size(-1)
    tokens = torch.cat([rows] + [chain[:, :, j] for j in range(blocks)], dim=1)  # [b, R * (B + 1)]
    mask = block_mask(r, blocks, offset=1).expand(b, -1, -1, -1)
    logits = run(tokens, mask, block_positions(r, blocks, offset=1))
    return logits.argmax(-1).view(b, blocks + 1, r)


def target_runner(target: Target) -> Runner:
    return lambda tokens, mask, positions: target.run(tokens, mask, positions).logits


def model_runner(model: torch.nn.Module) -> Runner:
    def run(tokens, mask, positions):
        with autocast():
            return model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return run


def verify(target: Target, rows: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[b, T, K] bool: draft j of start n equals the target's greedy token after the first j - 1 drafts."""
    t, k = drafts.shape[1], drafts.shape[2]
    padded = torch.cat([drafts, drafts[:, -1:]], dim=1)  # [b, T + 1, K]: row T is never read back
    greedy = chain_argmax(target_runner(target), rows, padded[:, :, : k - 1])  # [b, K, T + 1]
    first = shift_left(greedy[:, 0], 1)  # target after t_0..t_{n+1}: row n + 1 of the teacher-forced block
    expected = torch.stack([first] + [greedy[:, j] for j in range(1, k)], dim=-1)[:, :t]  # [b, T, K]
    return drafts == expected


def eagle_drafts(head: EagleHead, target: Target, rows: torch.Tensor, k: int) -> torch.Tensor:
    """[b, T, K] greedy drafts of the head from every start n = 0..T-1 (its own tokens and features after step 1)."""
    feats = target.run(rows).feats[:, :-1]
    with autocast():
        outs = unroll(head, target, rows[:, 1:], feats, steps=k,
                      next_tokens=lambda s, g: target.draft_logits(g).argmax(-1))
        return torch.stack([target.draft_logits(g).argmax(-1) for g in outs], dim=-1)


def model_drafts(model: torch.nn.Module, rows: torch.Tensor, k: int) -> torch.Tensor:
    """[b, T, K] greedy drafts of a standalone causal LM from every start n, given t_0..t_{n+1}."""
    run = model_runner(model)
    first = shift_left(chain_argmax(run, rows, rows.new_empty((*rows.shape, 0)))[:, 0], 1)  # [b, T + 1]
    drafts = first[:, :, None]
    for j in range(1, k):
        drafts = torch.cat([drafts, chain_argmax(run, rows, drafts)[:, j, :, None]], dim=-1)  # [b, T + 1, j + 1]
    return drafts[:, :-1]


@torch.inference_mode()
def multistep_metrics(drafter: Callable[[torch.Tensor], torch.Tensor], target: Target, windows: torch.Tensor,
                      k: int = 5, chunk: int = 2) -> dict:
    """P(first j drafts match) for j = 1..k and the mean accepted tokens per target forward for k - 1 and k drafts."""
    hits = torch.zeros(k, dtype=torch.float64)
    starts = 0
    for i in range(0, len(windows), chunk):
        rows = windows[i : i + chunk]
        match = verify(target, rows, drafter(rows))  # [b, T, K]
        hits += match.long().cumprod(-1).sum((0, 1)).double()
        starts += match.shape[0] * match.shape[1]
    p = (hits / starts).tolist()
    return {"starts": starts, "p_first_j_match": p,
            f"accepted_per_forward_k{k - 1}": 1 + sum(p[: k - 1]), f"accepted_per_forward_k{k}": 1 + sum(p)}


def load_draft_model(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
