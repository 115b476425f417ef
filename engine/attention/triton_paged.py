"""`TritonPagedAttention` ("triton"): the torch backend's paths with the Triton kernels of `triton_kv_quant.py`
wherever the cache is quantized (fp8/int8): the KV write of every step, and the attention of pure-decode steps,
which reads the quantized blocks in place (no gather, no DecodeBuffer). Prefill, chunked-prefill and mixed steps
attend through torch over the dequantized blocks, as the torch backend does. An unquantized cache takes the torch
backend's paths unchanged.

ModelRunner picks it on CUDA for a quantized cache. On a CPU the kernels run only under `TRITON_INTERPRET=1`
(tests); without it they fall back to their torch references.
NOTE: the write kernel writes exactly the bytes of `kv_quant.write` (tests/unit/test_triton_kv_quant.py), so the
cache, the stored blocks and every transfer are the same whichever backend wrote them.
"""
from __future__ import annotations

import torch

from engine.attention.backend import register_attention_backend
from engine.attention.kv_quant import QuantizedLayerKV
from engine.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from engine.attention.triton_kv_quant import paged_decode_attention_quant, write_quantized_kv


class TritonPagedAttention(TorchPagedAttention):
    name = "triton"

    def write(self, k: torch.Tensor, v: torch.Tensor, cache, meta: TorchPagedMetadata) -> torch.Tensor | None:
        if not isinstance(cache, QuantizedLayerKV):
            return super().write(k, v, cache, meta)
        write_quantized_kv(cache.k, cache.k_scale, k, meta.write_blocks, meta.write_offsets)
        write_quantized_kv(cache.v, cache.v_scale, v, meta.write_blocks, meta.write_offsets)
        return None     # NOTE: nothing reads the DecodeBuffer here (pure decodes run the kernel)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, meta: TorchPagedMetadata,
               scale: float, window: int | None, requantized: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(cache, QuantizedLayerKV) or meta.prefills:
            return super().attend(q, k, v, cache, meta, scale, window, requantized)
        bsz = q.shape[0]
        tables = meta.decode_tables.view(bsz, -1).to(torch.int32)                          # [B, W]
        ctx = torch.tensor(meta.decode_ctx, dtype=torch.int32, device=q.device)            # [B]
        return paged_decode_attention_quant(q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables, ctx,
                                            scale, window)                                 # [B, Hq, D]


register_attention_backend("triton", TritonPagedAttention)
