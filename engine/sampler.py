"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with randomness keyed by (seed, output position).

A seeded request draws the token at output position `pos` with one uniform number `u = U(seed, pos)` from a
counter-based generator (splitmix64, computed for the whole batch at once), by inverse-CDF over the row's filtered
distribution. Nothing depends on a stream's state, so the same request gives the same tokens in any batch, on any
worker, after a preemption or a failover mid-generation. Requests without a seed take `u` from the sampler's RNG.
Greedy rows are exactly argmax (the first index on ties).

Before anything else the rows' logits are rewritten in one copy, in vLLM's order: min_tokens bans (eos and stop
token ids at -inf while a row is short of `min_tokens`), logit bias, then penalties (repetition, presence,
frequency; vLLM's and OpenAI's definitions) from per-request token counts that `TokenCounts` keeps between steps.

Each row's arithmetic is independent of the other rows: weights are `exp(x - row max)` (elementwise), the CDF is a
sequential cumsum, so a row's draw is bit-identical alone or in any batch. Rows are drawn in two groups, each in a
few tensor ops over all its rows: plain rows over the whole vocabulary in token order; top-k / top-p rows over their
best K candidates (top-p-only rows: `_TOP_P_CANDIDATES`, or the whole vocabulary sorted when the nucleus is wider):

    candidates (top-k/top-p rows: the top K logits, best first):
    | w0 | w1 | w2 | ... kept ... |  dropped (rank >= top_k, w < min_p, or mass before it >= top_p * mass)  |
    cdf:  c0   c1   c2 ...  c[n-1]    pick the first index with cdf > u * c[n-1]
"""
from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import numpy as np
import torch

from engine.penalties import SeenTokens, TokenCounts
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_TOP_P_CANDIDATES = 256  # top-p-only rows look here first; a wider nucleus falls back to the whole vocabulary


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform in [0, 1) that depends only on (seed, position, stream); `stream` separates uses (e.g. a
    speculative accept test from the draw itself)."""
    x = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ stream)
    return (x >> 11) * (1.0 / (1 << 53))


_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S27, _S30, _S31 = np.uint64(11), np.uint64(27), np.uint64(30), np.uint64(31)
_SCALAR_ROWS = 12  # below this many rows the scalar generator is faster than numpy's per-call overhead


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` on a uint64 array: numpy's unsigned arithmetic wraps mod 2**64 and shifts are logical."""
    x = x + _GOLDEN
    x ^= x >> _S30
    x *= _MIX1
    x ^= x >> _S27
    x *= _MIX2
    x ^= x >> _S31
    return x


def seeded_uniforms(seeds: Sequence[int], positions: Sequence[int], stream: int = 0) -> np.ndarray:
    """float64 [n]: `seeded_uniform(seeds[i], positions[i], stream)` for every i, bit-identical, in one pass."""
    if len(seeds) < _SCALAR_ROWS:
        return np.array([seeded_uniform(s, p, stream) for s, p in zip(seeds, positions)], dtype=np.float64)
    x = _splitmix64_array(np.array(seeds, dtype=np.uint64))
    x ^= np.array(positions, dtype=np.uint64)
    x = _splitmix64_array(x)
    x ^= np.uint64(stream)
    x = _splitmix64_array(x)
    return (x >> _S11).astype(np.float64) * (1.0 / (1 << 53))  # < 2**53: exact in float64


class _SortedDraw(NamedTuple):
    token_ids: torch.Tensor      # [rows]
    short: list[int]             # rows whose top-p mass the candidates do not reach (drawn too early)


class Sampler:
    """`sample(logits, params, positions) -> token ids`; does not modify `logits`.

    `eos_token_ids` are banned, with each row's `stop_token_ids`, while the row is short of `min_tokens` (unless
    it ignores eos). Penalised rows need `seen`; with keyed entries (`SeenTokens(..., key)`) their counts persist
    in `self.token_counts` until `release(key)`.
    """

    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        self._rng = np.random.default_rng(seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self.token_counts = TokenCounts()

    def release(self, key: Hashable) -> None:
        """Forget a finished request's penalty counts."""
        self.token_counts.release(key)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
               seen: Sequence[SeenTokens | tuple | None] | None = None) -> list[int]:
        """`logits` [rows, vocab]; `params[i]`, `positions[i]` (the output index being drawn, i.e. the number of
        outputs so far) describe row i; `seen[i]` = (prompt ids, output ids[, key]) of row i, needed only for rows
        whose params set a penalty."""
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(positions)
        logits = self._adjust(logits, params, positions, seen)
        random_rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if not random_rows:
            return _argmax(logits).tolist()
        tokens = _argmax(logits) if len(random_rows) < len(params) else np.zeros(len(params), dtype=np.int64)
        vocab = logits.shape[1]
        groups: tuple[list[int], list[int]] = ([], [])  # plain, filtered (top-k or top-p)
        for i in random_rows:
            groups[0 < params[i].top_k < vocab or params[i].top_p < 1.0].append(i)
        for rows, draw in zip(groups, (self._draw_plain, self._draw_filtered)):
            if len(rows) == len(params):
                return draw(logits, params, positions).tolist()
            if rows:
                index = torch.tensor(rows, device=logits.device)
                drawn = draw(logits.index_select(0, index), [params[i] for i in rows], [positions[i] for i in rows])
                tokens[rows] = drawn.cpu().numpy()
        return tokens.tolist()

    def probabilities(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                      seen: Sequence[SeenTokens | tuple | None] | None = None) -> torch.Tensor:
        """[rows, vocab] float32: the distribution `sample` draws each row from (bans, bias, penalties, temperature,
        top-k, top-p, min-p as there; greedy rows a point mass at the argmax). Speculative verification's p."""
        logits = self._adjust(logits, params, positions, seen)
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)       # [rows, vocab]
        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        if greedy:
            index = torch.tensor(greedy, device=logits.device)
            argmax = torch.from_numpy(_argmax(logits.index_select(0, index))).to(logits.device)
            out[index, argmax] = 1.0
        rows = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            out[index] = _filtered_distribution(logits.index_select(0, index).float(), [params[i] for i in rows])
        return out

    # ----- rewriting the logits

    def _adjust(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                seen: Sequence | None) -> torch.Tensor:
        """One copy of `logits` with bans, bias and penalties applied; `logits` itself when no row needs any."""
        if not any(p.min_tokens or p.logit_bias or p.penalized for p in params):
            return logits
        early = [i for i, (p, n) in enumerate(zip(params, positions)) if n < p.min_tokens]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.penalized]
        banned = self._banned(params, early, logits.shape[1])
        if not (banned or biased or penalized):
            return logits
        out = logits.clone()                                   # [rows, vocab]
        flat, vocab = out.view(-1), out.shape[1]
        if banned:
            flat.index_fill_(0, torch.tensor(banned, device=out.device), float("-inf"))
        if biased:
            entries = [(i * vocab + t, b) for i in biased for t, b in params[i].logit_bias if t < vocab]
            if entries:
                ids, values = zip(*entries)
                flat.index_add_(0, torch.tensor(ids, device=out.device),
                                torch.tensor(values, dtype=out.dtype, device=out.device))
        if penalized:
            if seen is None:
                raise ValueError("penalties need the tokens each row has seen (pass `seen`)")
            self._penalize(out, [params[i] for i in penalized], [SeenTokens(*seen[i]) for i in penalized],
                           penalized)
        return out

    def _banned(self, params: Sequence[SamplingParams], early: list[int], vocab: int) -> list[int]:
        """Flat indices (row * vocab + token) of the eos and stop tokens that rows short of min_tokens may not draw."""
        return [i * vocab + t for i in early
                for t in (*params[i].stop_token_ids, *(() if params[i].ignore_eos else self.eos_token_ids))
                if t < vocab]

    def _penalize(self, out: torch.Tensor, params: list[SamplingParams], seen: list[SeenTokens],
                  rows: list[int]) -> None:
        """Repetition (HF/vLLM): a token seen in the prompt or the output has a positive logit divided by the
        penalty and a negative one multiplied by it. Presence / frequency (OpenAI): minus `presence` once and
        `frequency` per occurrence, over the output tokens only. Only the seen tokens' logits are touched."""
        device, vocab = out.device, out.shape[1]
        keyed = all(s.key is not None for s in seen)
        if not keyed:   # NOTE: unkeyed callers are counted afresh, in a throwaway table (tests, one-off calls)
            seen = [s._replace(key=j) for j, s in enumerate(seen)]
        pairs = (self.token_counts if keyed else TokenCounts()).pairs(seen, vocab, device)
        settings = torch.tensor([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
                                dtype=out.dtype, device=device).index_select(0, pairs.row)  # [pairs, 3]
        flat = out.view(-1)
        at = torch.tensor(rows, device=device).index_select(0, pairs.row) * vocab + pairs.token  # [pairs] flat
        x = flat.index_select(0, at)                                                      # [pairs]
        if any(p.repetition_penalty != 1.0 for p in params):
            r = settings[:, 0]
            x = torch.where(x > 0, x / r, x * r)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            count = pairs.count.to(x.dtype)
            x = x - (count * settings[:, 1] + (count > 0).to(x.dtype) * settings[:, 2])
        flat.index_copy_(0, at, x)

    # ----- drawing

    def _uniforms(self, params: Sequence[SamplingParams], positions: Sequence[int],
                  device: torch.device) -> torch.Tensor:
        """[rows, 1] float32: U(seed, position) for seeded rows, the sampler's RNG for the others."""
        seeded = [j for j, p in enumerate(params) if p.seed is not None]
        if len(seeded) == len(params):
            u = seeded_uniforms([p.seed for p in params], positions)
        else:
            u = self._rng.random(len(params))
            if seeded:
                u[seeded] = seeded_uniforms([params[j].seed for j in seeded], [positions[j] for j in seeded])
        # NOTE: u <= 1 - 2**-20 keeps u * total strictly below total in float32: a zero-weight tail is never picked.
        return torch.from_numpy(u).to(device=device, dtype=torch.float32).clamp_(max=1.0 - 2.0**-20).unsqueeze(1)

    def _draw_plain(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                    positions: Sequence[int]) -> torch.Tensor:
        """[rows]: inverse CDF over the whole vocabulary, in token order."""
        inv_t = 1.0 / _column(params, "temperature", logits.device)  # [rows, 1]
        shift = logits.amax(dim=-1, keepdim=True).mul_(inv_t).neg_()  # [rows, 1]
        w = torch.addcmul(shift, logits, inv_t).exp_()  # [rows, vocab] exp((x - max) / t), max weight 1
        _apply_min_p(w, params)
        cdf = w.cumsum_(dim=-1)
        return _inverse_cdf(cdf, self._uniforms(params, positions, logits.device) * cdf[:, -1:]).squeeze(1)

    def _draw_filtered(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                       num_candidates: int | None = None) -> torch.Tensor:
        """[rows]: rows with top-k or top-p, over their sorted candidates. Top-p is relative to the top-k mass where
        top-k applies, else to the whole vocabulary's (whose top-p-only rows look at `_TOP_P_CANDIDATES` first)."""
        device, vocab = logits.device, logits.shape[1]
        scaled = logits / _column(params, "temperature", device)  # [rows, vocab]
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: no top-k
        candidates = min(vocab, num_candidates or max(max(ks), _TOP_P_CANDIDATES if 0 in ks else 0))
        values, order = _top_candidates(scaled, candidates)  # [rows, K], best first
        kk = torch.tensor([k or candidates for k in ks], device=device).unsqueeze(1)  # [rows, 1]
        mass = None
        if 0 in ks:
            full = (scaled - values[:, :1]).exp_()  # [rows, vocab]
            _apply_min_p(full, params)
            mass = full.sum(dim=-1, keepdim=True)  # [rows, 1]; taken for the rows without top-k
        picked, short = self._draw_sorted(values, order, params, positions, kk, mass, ks)
        if short and candidates < vocab:  # a nucleus that does not end inside the candidates: redraw over all
            index = torch.tensor(short, device=device)
            picked[index] = self._draw_filtered(logits.index_select(0, index), [params[i] for i in short],
                                                [positions[i] for i in short], vocab)
        return picked

    def _draw_sorted(self, values: torch.Tensor, order: torch.Tensor, params: Sequence[SamplingParams],
                     positions: Sequence[int], kk: torch.Tensor, mass: torch.Tensor | None,
                     ks: list[int]) -> _SortedDraw:
        """Inverse CDF over sorted candidates `values` [rows, K] (token ids `order`), the first `kk` [rows, 1] of each
        row allowed; top-p relative to their mass where ks[i] > 0, else to `mass[i]`."""
        device = values.device
        w = (values - values[:, :1]).exp_()  # [rows, K]
        allowed = torch.arange(values.shape[1], device=device).unsqueeze(0) < kk if any(ks) else None  # [rows, K]
        if allowed is not None:
            w.masked_fill_(~allowed, 0.0)
        _apply_min_p(w, params)
        cdf = torch.cumsum(w, dim=-1)  # [rows, K]
        top_k_mass = cdf.gather(1, kk - 1)  # [rows, 1]
        if mass is not None and any(ks):
            mass = torch.where(torch.tensor(ks, device=device).unsqueeze(1) > 0, top_k_mass, mass)
        limit = _column(params, "top_p", device) * (top_k_mass if mass is None else mass)  # [rows, 1]
        keep = (cdf - w) < limit  # a prefix of each row; rank 0 always kept
        if allowed is not None:
            keep &= allowed
        num_kept = keep.sum(dim=-1, keepdim=True)  # [rows, 1]
        target = self._uniforms(params, positions, device) * cdf.gather(1, num_kept - 1)  # [rows, 1]
        short = [] if mass is None else (cdf[:, -1] < limit[:, 0]).nonzero().squeeze(1).tolist()
        return _SortedDraw(order.gather(1, _inverse_cdf(cdf, target)).squeeze(1), short)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[tuple]:
    """Per row of raw `logits` [rows, vocab]: (token id, its log-softmax, its rank (1 = most likely), the
    `num_top[i]` most likely (id, logprob) pairs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)                                         # [rows, vocab]
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device).unsqueeze(1))          # [rows, 1]
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    k = max(num_top, default=0)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)                           # [rows, k]
    out = []
    for i, (token_id, n) in enumerate(zip(token_ids, num_top)):
        top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else []
        out.append((token_id, chosen[i, 0].item(), ranks[i], top))
    return out


def apply_penalties(logits: torch.Tensor,
                    rows: Sequence[tuple[int, SamplingParams, tuple[Sequence[int], Sequence[int]] | None]]
                    ) -> torch.Tensor:
    """A copy of `logits` with each listed row (index, params, (prompt ids, output ids)) biased, then penalised,
    as `Sampler.sample` does before drawing."""
    params, seen = [SamplingParams()] * logits.shape[0], [None] * logits.shape[0]
    for i, p, tokens in rows:
        params[i], seen[i] = p, tokens
    adjusted = Sampler()._adjust(logits, params, [p.min_tokens for p in params], seen)
    return adjusted.clone() if adjusted is logits else adjusted


def _filtered_distribution(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] probabilities after temperature, top-k, min-p and top-p, as `_draw_sorted` keeps them."""
    vocab = logits.shape[1]
    values, order = torch.sort(logits / _column(params, "temperature", logits.device), dim=-1, descending=True)
    w = (values - values[:, :1]).exp_()                                                   # [rows, V] sorted
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    allowed = torch.arange(vocab, device=logits.device).unsqueeze(0) < ks.unsqueeze(1)   # [rows, V]
    w.masked_fill_(~allowed, 0.0)
    _apply_min_p(w, params)
    cdf = torch.cumsum(w, dim=-1)
    mass = cdf.gather(1, (ks - 1).unsqueeze(1))                                          # [rows, 1]
    w.masked_fill_((cdf - w) >= _column(params, "top_p", logits.device) * mass, 0.0)    # rank 0 always kept
    sorted_p = w / w.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_p).scatter_(1, order, sorted_p)


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """[rows] int64: row argmax, first index on ties. On CPU numpy's SIMD argmax is several times faster than
    torch's."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return logits.detach().numpy().argmax(axis=-1)
    return logits.argmax(dim=-1).cpu().numpy()


def _top_candidates(scaled: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [rows, k] of each row's k largest, best first. torch's topk where it takes its partial
    sort (k * 64 <= vocab), else numpy's selection and sort: several times faster on the CPU (a full sort: ~5x)."""
    vocab = scaled.shape[1]
    if scaled.device.type != "cpu" or scaled.dtype != torch.float32 or k * 64 <= vocab:
        return torch.topk(scaled, k, dim=-1)
    neg = -scaled.detach().numpy()                                               # [rows, vocab]
    if k < vocab:
        part = np.argpartition(neg, k - 1, axis=-1)[:, :k]                       # [rows, k], unordered
        order = np.take_along_axis(part, np.argsort(np.take_along_axis(neg, part, -1), axis=-1), -1)
    else:
        order = np.argsort(neg, axis=-1)
    return torch.from_numpy(-np.take_along_axis(neg, order, -1)), torch.from_numpy(order)


def _column(params: Sequence[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    """[rows, 1] float32 of one setting."""
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device).unsqueeze(1)


def _apply_min_p(w: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Zero the weights below min_p (weights are probabilities over the row's most likely one, which has 1)."""
    if any(p.min_p > 0.0 for p in params):
        w.masked_fill_(w < _column(params, "min_p", w.device), 0.0)


def _inverse_cdf(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the first index whose cumulative weight exceeds target (zero-weight entries never win)."""
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
