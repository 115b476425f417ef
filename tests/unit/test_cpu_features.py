"""What the engine does on a CPU without native bf16 GEMMs (no AVX-512 BF16, no AMX): `engine/cpu_features.py`.
`STRATA_NATIVE_BF16` stands in for either kind of CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import CacheConfig, ModelConfig
from engine.cpu_features import FP32_GEMM_MIN_ROWS, fp32_gemm_min_rows, native_bf16_gemm
from engine.model_runner import ModelRunner
from engine.models.layers import Linear
from engine.moe.plan import MoEShape, choose_path


@pytest.mark.parametrize("native", [False, True])
def test_bf16_linear_without_native_bf16(monkeypatch, native):
    """Without native bf16 a linear layer's weight is stored by rows (its bf16 GEMM 5-12x faster so) and from
    FP32_GEMM_MIN_ROWS rows its product runs in fp32, rounded to bf16 (exactly `F.linear` of the converted
    operands); below that, and on a native-bf16 CPU (weights by columns), the bf16 `F.linear`."""
    monkeypatch.setenv("STRATA_NATIVE_BF16", "1" if native else "0")
    gen = torch.Generator().manual_seed(0)
    wb, bb = torch.randn(32, 64, generator=gen).bfloat16(), torch.randn(32, generator=gen).bfloat16()
    layer = Linear(64, 32, True, torch.bfloat16, torch.device("cpu"))
    layer.weight.copy_(wb)
    layer.bias.copy_(bb)
    assert layer.weight.stride() == ((1, 32) if native else (64, 1))
    assert layer.fp32_from == (0 if native else FP32_GEMM_MIN_ROWS)
    for rows in (1, FP32_GEMM_MIN_ROWS - 1, FP32_GEMM_MIN_ROWS, 33):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        y = layer(x)
        assert y.dtype == torch.bfloat16
        if native or rows < FP32_GEMM_MIN_ROWS:
            assert torch.equal(y, F.linear(x, layer.weight, bb))
        else:
            assert torch.equal(y, F.linear(x.float(), wb.float(), bb.float()).bfloat16())
    fp32 = Linear(64, 32, False, torch.float32, torch.device("cpu"))
    assert fp32.weight.stride() == (1, 32) and fp32.fp32_from == 0    # fp32 as before on every CPU


def test_fp32_rows_override(monkeypatch):
    monkeypatch.setenv("STRATA_NATIVE_BF16", "0")
    monkeypatch.setenv("STRATA_FP32_GEMM_MIN_ROWS", "0")
    assert fp32_gemm_min_rows(torch.bfloat16, torch.device("cpu")) == 0
    monkeypatch.setenv("STRATA_FP32_GEMM_MIN_ROWS", "16")
    assert fp32_gemm_min_rows(torch.bfloat16, torch.device("cpu")) == 16
    assert fp32_gemm_min_rows(torch.float32, torch.device("cpu")) == 0


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
