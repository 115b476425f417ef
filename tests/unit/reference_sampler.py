"""The sampler as it was before batching (commit 24cb65f), kept as the oracle that the batched one must equal token
for token: per-row penalties from the prompt and output lists, per-row uniforms, plain and filtered rows apart.
Only greedy and seeded rows are comparable (unseeded rows take another RNG stream). `ban_early_stops` is the
engine's min_tokens ban of that time."""
from __future__ import annotations

import random
from typing import Sequence

import torch

from engine.sampler import seeded_uniform
from engine.sampling_params import SamplingParams


def ban_early_stops(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                    eos_token_ids: Sequence[int]) -> torch.Tensor:
    early = [(j, p) for j, (p, n) in enumerate(zip(params, positions)) if n < p.min_tokens]
    if not early:
        return logits
    out = logits.clone()
    for j, p in early:
        banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if t < out.shape[1]]
        if banned:
            out[j, torch.tensor(banned, dtype=torch.long, device=out.device)] = float("-inf")
    return out


def _argmax(logits: torch.Tensor) -> list[int]:
    return logits.detach().numpy().argmax(axis=-1).tolist()


class ReferenceSampler:
    """`sample(logits, params, positions) -> token ids`; does not modify `logits`."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
               seen: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None) -> list[int]:
        """`logits` [rows, vocab]; `params[i]`, `positions[i]` (the output index being drawn) describe row i;
        `seen[i]` = (prompt ids, output ids) of row i, needed only for rows whose params set a penalty."""
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(positions)
        adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
        if adjusted:
            if seen is None and any(params[i].penalized for i in adjusted):
                raise ValueError("penalties need the tokens each row has seen (pass `seen`)")
            logits = apply_penalties(logits, [(i, params[i], seen[i] if seen is not None else None)
                                              for i in adjusted])
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if not random_rows:
            return _argmax(logits)
        tokens = _argmax(logits) if len(random_rows) < len(params) else [0] * len(params)
        vocab = logits.shape[1]
        filtered = [i for i in random_rows if 0 < params[i].top_k < vocab or params[i].top_p < 1.0]
        plain = [i for i in random_rows if not (0 < params[i].top_k < vocab or params[i].top_p < 1.0)]
        for rows, draw in ((plain, self._draw_plain), (filtered, self._draw_filtered)):
            if len(rows) == len(params):
                return draw(logits, params, positions).view(-1).tolist()
            if rows:
                index = torch.tensor(rows, device=logits.device)
                drawn = draw(logits.index_select(0, index), [params[i] for i in rows], [positions[i] for i in rows])
                for i, token_id in zip(rows, drawn.view(-1).tolist()):
                    tokens[i] = token_id
        return tokens

    def _uniforms(self, params: Sequence[SamplingParams], positions: Sequence[int],
                  device: torch.device) -> torch.Tensor:
        u = [seeded_uniform(p.seed, pos) if p.seed is not None else self._rng.random()
             for p, pos in zip(params, positions)]
        # NOTE: u <= 1 - 2**-20 keeps u * total strictly below total in float32: a zero-weight tail is never picked.
        return torch.tensor(u, dtype=torch.float32, device=device).clamp_(max=1.0 - 2.0**-20).unsqueeze(1)

    def _draw_plain(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                    positions: Sequence[int]) -> torch.Tensor:
        inv_t = 1.0 / _temperatures(params, logits.device)  # [rows, 1]
        shift = logits.amax(dim=-1, keepdim=True).mul_(inv_t).neg_()  # [rows, 1]
        w = torch.addcmul(shift, logits, inv_t).exp_()  # [rows, vocab] exp((x - max) / t), max weight 1
        cdf = w.cumsum_(dim=-1)
        return _inverse_cdf(cdf, self._uniforms(params, positions, logits.device) * cdf[:, -1:])

    def _draw_filtered(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       positions: Sequence[int], num_candidates: int | None = None) -> torch.Tensor:
        device = logits.device
        scaled = logits / _temperatures(params, device)  # [rows, vocab]
        vocab = scaled.shape[1]
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: no top-k
        k_max = num_candidates or max(max(ks), _TOP_P_CANDIDATES if 0 in ks else 0)
        candidates = min(vocab, k_max)
        values, order = torch.topk(scaled, candidates, dim=-1)  # [rows, K], best first
        w = (values - values[:, :1]).exp_()  # [rows, K]
        ranks = torch.arange(candidates, device=device).unsqueeze(0)  # [1, K]
        kk = torch.tensor([k or candidates for k in ks], device=device).unsqueeze(1)  # [rows, 1]
        w.masked_fill_(ranks >= kk, 0.0)
        cdf = torch.cumsum(w, dim=-1)  # [rows, K]
        mass = _reference_mass(scaled, values, cdf, ks, kk)  # [rows, 1]
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)  # [rows, 1]
        keep = ((cdf - w) < top_p * mass) & (ranks < kk)  # a prefix of each row; rank 0 always kept
        num_kept = keep.sum(dim=-1, keepdim=True)  # [rows, 1]
        target = self._uniforms(params, positions, device) * cdf.gather(1, num_kept - 1)  # [rows, 1]
        picked = order.gather(1, _inverse_cdf(cdf, target))  # [rows, 1] token ids
        if candidates < vocab:
            # A top-p-only row whose nucleus does not end inside the candidates redraws over the whole vocabulary.
            # (kk == candidates only for rows without top-k, as every top-k is <= candidates and full mass is theirs.)
            short = ((cdf[:, -1:] < top_p * mass) & (kk == candidates)).squeeze(1).nonzero().squeeze(1).tolist()
            if short:
                index = torch.tensor(short, device=device)
                picked.view(-1)[index] = self._draw_filtered(
                    logits.index_select(0, index), [params[i] for i in short], [positions[i] for i in short], vocab)
        return picked.squeeze(1)



def apply_penalties(logits: torch.Tensor,
                    rows: Sequence[tuple[int, SamplingParams, tuple[Sequence[int], Sequence[int]] | None]]
                    ) -> torch.Tensor:
    """A copy of `logits` with each listed row biased, then penalised (vLLM's order). Logit bias (OpenAI): the value
    added to its token's logit (ids outside the vocabulary are refused at the door). Repetition (HF/vLLM): every token
    in the prompt or the output has a positive logit divided by the penalty and a negative one multiplied by it.
    Presence / frequency (OpenAI): minus `presence` once and `frequency` per occurrence, over the output tokens only."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, p, seen in rows:
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=row.device)
            row.index_add_(0, ids, torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype,
                                                device=row.device))
        if not p.penalized:
            continue
        prompt_ids, output_ids = seen
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
            picked = row.index_select(0, ids)
            row.index_copy_(0, ids, torch.where(picked > 0, picked / p.repetition_penalty,
                                                picked * p.repetition_penalty))
        if output_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long, device=row.device),
                                    minlength=vocab)[:vocab].to(row.dtype)
            row.sub_(counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty)
    return out


_TOP_P_CANDIDATES = 256  # top-p-only rows look here first; a wider nucleus falls back to the whole vocabulary


def _reference_mass(scaled: torch.Tensor, values: torch.Tensor, cdf: torch.Tensor, ks: list[int],
                    kk: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: top-p is relative to the top-k mass where top-k applies, else to the whole vocabulary's mass."""
    mass = cdf.gather(1, kk - 1)  # [rows, 1]
    full = [i for i, k in enumerate(ks) if k == 0]
    if full:
        index = torch.tensor(full, device=scaled.device)
        rows = scaled.index_select(0, index)  # [n, vocab]
        mass[index] = (rows - values[index, :1]).exp_().sum(dim=-1, keepdim=True)
    return mass


def _temperatures(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    return torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device).unsqueeze(1)


def _inverse_cdf(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the first index whose cumulative weight exceeds target (zero-weight entries never win)."""
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
