"""The one decoder every supported architecture runs: pre-norm blocks of attention and a dense or sparse MLP.

`CausalLM.forward` takes a flat batch of tokens (all sequences concatenated) plus the attention backend's
per-step metadata; nothing in here loops over sequences.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine import cpu_kernels
from engine.attention.backend import AttentionBackend
from engine.cpu_features import fp32_gemm_min_rows
from engine.models.layers import Attention, DenseMLP, RMSNorm, SparseMoE, column_major, columns_pay, linear
from engine.models.rope import RotaryTable
from engine.models.spec import ModelSpec
from engine.moe.backend import MoESetup


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, dtype: torch.dtype, device: torch.device,
                 moe_backend: MoESetup | str) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.attn = Attention(spec, dtype, device, spec.layer_windows[index])
        self.post_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        sparse = spec.moe is not None and index in spec.moe.sparse_layers
        self.mlp: nn.Module = SparseMoE(spec, dtype, device, moe_backend) if sparse else \
            DenseMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                cache: tuple[torch.Tensor, torch.Tensor], meta: Any) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, backend, cache, meta)   # [T, H]
        return x + self.mlp(self.post_norm(x))                                   # [T, H]


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 moe_backend: MoESetup | str = "local") -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device, moe_backend)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.lm_head = None if spec.tie_word_embeddings else \
            nn.Parameter(column_major(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device),
                         requires_grad=False)
        self.head_weight: torch.Tensor | None = None      # [V, H] for logits, derived in post_load
        self.head_fp32_from = 0                           # rows from which logits run in fp32 (post_load)
        self.head_kernel_rows = 0                         # rows up to which logits run the CPU kernel (post_load)
        self.quant_head: nn.Module | None = None          # a quantized LM head (engine/quant/apply.quantize_vocab)
        self.rotary = RotaryTable(spec.rope, spec.head_dim, spec.max_position_embeddings, device, dtype)

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                caches: list[tuple[torch.Tensor, torch.Tensor]], meta: Any) -> torch.Tensor:
        """Hidden states `[T, H]` (before the final norm) for input_ids `[T]`; cos/sin `[T, 1, D]` from the rotary
        table (`RotaryTable.lookup_signed`: sin half-negated), looked up by the caller per token."""
        x = self.embed(input_ids)                                         # [T, H]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos, sin, backend, cache, meta)
        return x

    def post_load(self) -> None:
        """Derive fused tensors from the loaded weights (the loader calls this once; call again after any weight
        swap)."""
        for layer in self.layers:
            layer.attn.post_load()
            experts = getattr(layer.mlp, "experts", None)
            if hasattr(experts, "post_load"):
                experts.post_load()     # an expert-parallel layer keeps its own slots
        if self.quant_head is not None:
            self.head_weight = None
            return
        self.head_weight = (self.embed.weight if self.lm_head is None else self.lm_head).detach()  # [V, H]
        head = self.head_weight
        self.head_fp32_from = fp32_gemm_min_rows(head.dtype, head.device)
        self.head_kernel_rows = cpu_kernels.linear_max_rows(head.dtype, head.device)
        if self.lm_head is None and head.device.type == "cpu" and columns_pay(head.dtype, head.device):
            # NOTE: tied weights: the embedding lookup wants rows contiguous, the logits GEMM wants columns (see
            # column_major; [32,256]x[256,4096] 886 -> 709 us on 1 thread), so CPU keeps a second, transposed copy.
            self.head_weight = self.head_weight.t().contiguous().t()   # [V, H], column-major storage

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[N, vocab]` for hidden rows `[N, H]`."""
        if self.quant_head is not None:
            return self.quant_head(self.norm(hidden)).float()             # [N, V]
        return linear(self.norm(hidden), self.head_weight, None, self.head_fp32_from,
                      self.head_kernel_rows).float()                      # [N, V]
