"""What the engine does on a CPU without native bf16 GEMMs (no AVX-512 BF16, no AMX): `engine/cpu_features.py`.
`STRATA_NATIVE_BF16` stands in for either kind of CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, ModelConfig
from engine.cpu_features import native_bf16_gemm
from engine.model_runner import ModelRunner
from engine.models.layers import Linear
from engine.moe.plan import MoEShape, choose_path


@pytest.mark.parametrize("native", [False, True])
def test_bf16_weights_are_stored_by_rows_without_native_bf16(monkeypatch, native):
    """Without native bf16 a linear layer's weight is stored by rows (its bf16 GEMM 5-12x faster so), with it by
    columns; the product is the same `F.linear` either way."""
    monkeypatch.setenv("STRATA_NATIVE_BF16", "1" if native else "0")
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    layer = Linear(64, 32, True, torch.bfloat16, torch.device("cpu"))
    layer.weight.copy_(w)
    layer.bias.copy_(b)
    assert layer.weight.stride() == ((1, 32) if native else (64, 1))
    assert torch.allclose(layer(x).float(), F.linear(x, w.bfloat16(), b.bfloat16()).float(), atol=0.05)
    fp32 = Linear(64, 32, False, torch.float32, torch.device("cpu"))
    assert fp32.weight.stride() == (1, 32)                  # fp32 keeps the column-major storage everywhere


@pytest.mark.parametrize("native,dtype,warns", [(False, "bfloat16", True), (True, "bfloat16", False),
                                                (False, "float32", False)])
def test_runner_warns_of_bf16_without_native_bf16(tiny_checkpoint, monkeypatch, caplog, native, dtype, warns):
    monkeypatch.setenv("STRATA_NATIVE_BF16", "1" if native else "0")
    ckpt = tiny_checkpoint("qwen3_moe")
    with caplog.at_level("WARNING", logger="engine.model_runner"):
        ModelRunner(ModelConfig(str(ckpt.path), dtype=dtype, enforce_eager=True),
                    CacheConfig(block_size=4, num_blocks=4))
    assert any("without native bf16" in r.getMessage() for r in caplog.records) == warns


def test_native_bf16_override(monkeypatch):
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("STRATA_NATIVE_BF16", value)
        assert native_bf16_gemm() is expected
        assert (choose_path(MoEShape(8, 256, 256), 32, 2, torch.bfloat16, False, True, True) == "dense") is expected
