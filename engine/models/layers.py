"""The pluggable parts of the shared decoder: RMSNorm, attention projections, dense and sparse MLPs.

Weights are fused at load time where one matmul can replace several: q/k/v into `qkv`, gate/up into `gate_up`,
and every expert's gate/up/down into stacked `[E, ...]` tensors behind a MoE backend.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend
from engine.cpu_features import fp32_gemm_min_rows, slow_half_gemm
from engine.models.rope import apply_rotary
from engine.models.spec import ModelSpec
from engine.moe.backend import MoEBackend, MoESetup, make_moe_backend
from engine.moe.capacity import apply_capacity, expert_capacity
from engine.moe.router import route_topk


_SPELLED_OUT_RMS_MIN = 16384     # elements; see rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; `weight` broadcasts against x (`[size]`, or `[heads, size]` for per-head norms)."""
    if x.dtype == torch.float32:                                      # the fp32 hot path: no casts
        if x.numel() >= _SPELLED_OUT_RMS_MIN:
            # NOTE: the same arithmetic as F.rms_norm (bit-identical, checked), but CPU F.rms_norm squares with a
            # slow pow: [2048, 256] 3.0 ms vs 0.8 ms here (1 thread). Below the threshold F.rms_norm is as fast.
            return (x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)).mul_(weight)
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), eps=eps).mul_(weight)      # per-head weights broadcast
    # NOTE: normalize in float32 and cast back before the weight, in the order HF checkpoints were trained.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)           # [..., size]
    return weight * normed.to(x.dtype)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def column_major(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty `[..., rows, cols]` tensor stored with its last two dims transposed (each matrix column-major).

    NOTE: `F.linear(x, W)` computes `x @ W^T`; with W stored this way `W^T` is contiguous and the CPU GEMM takes
    another path. Measured on one decode step's dense weights (4 x qkv+o, lm_head; cold cache, 1 thread):
    1 row 0.99 -> 0.67 ms, 32 rows 2.56 -> 2.30 ms, but 8 rows 1.72 -> 1.91 ms. The loader's `param.copy_` keeps
    the layout; the logical shape, names and values stay those of the checkpoint.
    """
    *batch, rows, cols = shape
    if not columns_pay(dtype, torch.device(device)):
        return torch.empty(*shape, dtype=dtype, device=device)
    return torch.empty(*batch, cols, rows, dtype=dtype, device=device).transpose(-1, -2)


def columns_pay(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `column_major` storage is used: not for bf16/fp16 on a CPU without native bf16 GEMMs.

    NOTE: there the transposed layout sends torch's bf16 GEMM down a path 5-12x slower than the plain one
    (AVX2-only AMD EPYC, 1 thread, `[M, 256] x [256, N]`: M=32 N=4096 115.8 vs 9.5 ms, M=8 N=512 1.66 vs 0.33 ms),
    while in fp32 both layouts run within 10% there."""
    return not slow_half_gemm(dtype, device)


def _weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(column_major(rows, cols, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """`y = x W^T (+ b)`; a plain holder so that fused weights keep one name."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _weight(n_out, n_in, dtype, device)       # [n_out, n_in], column-major storage
        self.bias = _param(n_out, dtype=dtype, device=device) if bias else None
        self.fp32_from = fp32_gemm_min_rows(dtype, torch.device(device))   # cpu_features; 0: never
        self.kernel_rows = cpu_kernels.linear_max_rows(dtype, torch.device(device))   # 0: never

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp32_from, self.kernel_rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_from: int,
           kernel_rows: int = 0) -> torch.Tensor:
    """`F.linear`; for x `[T, in]` of up to `kernel_rows` rows by Strata's CPU kernel (`cpu_kernels.linear`, weights
    stored by rows), else computed in float32 (the result in x's dtype) from `fp32_from` > 0 rows
    (`cpu_features.fp32_gemm_min_rows`)."""
    if kernel_rows and x.dim() == 2 and x.shape[0] <= kernel_rows and weight.is_contiguous():
        return cpu_kernels.linear(x, weight, bias)
    if not fp32_from or x.shape[0] < fp32_from:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm (Qwen3), RoPE, paged attention, output projection.

    `window`: this layer's sliding window (`spec.layer_windows[i]`): the query at position p sees keys in
    (p - window, p]; None is full causal attention."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.head_dim ** -0.5
        self.window = window
        self.qkv = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, spec.qkv_bias, dtype, device)
        self.o = Linear(spec.q_size, spec.hidden_size, spec.o_bias, dtype, device)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.qk_norm_weight: torch.Tensor | None = None     # [Hq + Hkv, D], derived in post_load

    def post_load(self) -> None:
        """Derive fused tensors from loaded weights; call again after any weight swap."""
        if self.q_norm is not None:
            dim = self.head_dim
            self.qk_norm_weight = torch.cat((self.q_norm.weight.expand(self.num_heads, dim),
                                             self.k_norm.weight.expand(self.num_kv_heads, dim)))  # [Hq+Hkv, D]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                cache: tuple[torch.Tensor, torch.Tensor], meta: Any) -> torch.Tensor:
        tokens, hq, qk_size = x.shape[0], self.num_heads, self.q_size + self.kv_size
        qkv = self.qkv(x)                                                 # [T, q + 2 kv]
        qk = qkv[:, :qk_size].view(tokens, hq + self.num_kv_heads, self.head_dim)   # [T, Hq + Hkv, D]
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)         # [T, Hkv, D]
        if self.qk_norm_weight is not None:                               # q_norm and k_norm in one pass
            qk = rms_norm(qk, self.qk_norm_weight, self.q_norm.eps)
        qk = apply_rotary(qk, cos, sin)                                   # q and k rotated in one pass
        out = backend.forward(qk[:, :hq], qk[:, hq:], v, cache, meta, self.scale, window=self.window)  # [T,Hq,D]
        return self.o(out.reshape(tokens, self.q_size))                   # [T, H]


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inter, bias, dtype, device)
        self.down = Linear(inter, hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)                       # [T, I] each
        return self.down(F.silu(gate) * up)                               # [T, H]


class SparseMoE(nn.Module):
    """Router + experts (a MoE backend) + optional shared expert with a sigmoid gate (Qwen2-MoE).

    Gating is the architecture's: softmax over all experts, top-k, renormalised when the config says so (Mixtral
    always, Qwen-MoE with `norm_topk_prob`). With a capacity factor (`MoEConfig`), pairs past an expert's capacity
    are dropped or sent to the token's next choice (`engine/moe/capacity.py`), and counted.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 backend: MoESetup | str = "local") -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        setup = MoESetup.of(backend)
        self.top_k, self.normalize, self.num_experts = moe.top_k, moe.norm_topk_prob, moe.num_experts
        self.capacity_factor, self.overflow = setup.config.capacity_factor, setup.config.overflow
        self.router = Linear(spec.hidden_size, moe.num_experts, False, dtype, device)
        # NOTE: experts stay row-major: per-expert GEMMs see few rows (T*k/E), where the column-major fast path
        # is slower (cold cache, 1 thread, E=8, 32 tokens: 2.58 vs 2.18 ms per layer).
        w13 = torch.empty(moe.num_experts, 2 * moe.intermediate_size, spec.hidden_size, dtype=dtype, device=device)
        w2 = torch.empty(moe.num_experts, spec.hidden_size, moe.intermediate_size, dtype=dtype, device=device)
        self.experts: MoEBackend = make_moe_backend(setup, w13, w2)
        self.shared = None
        self.shared_gate = None
        if moe.shared_intermediate_size:
            self.shared = DenseMLP(spec.hidden_size, moe.shared_intermediate_size, False, dtype, device)
            self.shared_gate = Linear(spec.hidden_size, 1, False, dtype, device)
        # load statistics, cumulative (metrics): (token, expert) pairs routed per expert, pairs dropped / rerouted
        # at capacity. Buffers, so that the compiled step updates them too.
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("capacity_counts", torch.zeros(2, dtype=torch.int64, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)                                                          # [T, E]
        weights, ids = route_topk(logits, self.top_k, self.normalize, x.dtype)          # [T, k] each
        if self.capacity_factor is not None:
            weights, ids = self._capacity(logits, weights, ids)
        self.expert_tokens.scatter_add_(0, ids.reshape(-1), (weights != 0).reshape(-1).long())
        out = self.experts(x, ids, weights)                                              # [T, H]
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out

    def _capacity(self, logits: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)                       # [T, E]
        capacity = expert_capacity(logits.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        result = apply_capacity(probs, ids, weights, capacity, self.overflow, self.normalize)
        self.capacity_counts += torch.stack([result.dropped, result.rerouted]).to(self.capacity_counts.dtype)
        return result.weights, result.ids
