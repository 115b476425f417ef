"""Strata's CPU kernels (engine/cpu_kernels) against the torch code they replace: the MoE kernel against the
per-expert loop, the linear kernel against F.linear, paged decode attention against the compiled step's own
gather + softmax; odd sizes (tails of the vector width and of the tiles), GQA, sliding windows, bf16. Also: which
MoE path the plan picks with the kernel, the switch that turns the kernels off, and a failed build falling back."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.compiled_decode import _attend, gather_blocks
from engine.moe import plan
from engine.moe.paths import loop
from engine.moe.plan import MoEShape, choose_path

REPO = Path(__file__).resolve().parents[2]



def test_the_kernels_build_here():
    """CI has a compiler and ninja (the project depends on ninja): the kernels must build, not be skipped."""
    assert cpu_kernels.available(), cpu_kernels.error()


def moe_inputs(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(dtype)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("tokens, experts, k, hidden, inter", [
    (1, 8, 2, 64, 64), (3, 4, 1, 24, 20), (17, 8, 2, 256, 256), (40, 6, 3, 72, 40), (64, 8, 2, 64, 96)])
def test_the_moe_kernel_equals_the_per_expert_loop(tokens, experts, k, hidden, inter):
    x, w13, w2, ids, weights = moe_inputs(tokens, experts, k, hidden, inter, torch.float32)
    torch.testing.assert_close(cpu_kernels.moe(x, w13, w2, ids, weights), loop(x, w13, w2, ids, weights),
                               rtol=1e-5, atol=1e-5)


def test_the_moe_kernel_in_bf16_reads_bf16_and_multiplies_in_fp32():
    x, w13, w2, ids, weights = moe_inputs(24, 8, 2, 64, 48, torch.bfloat16)
    out = cpu_kernels.moe(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    exact = loop(x.float(), w13.float(), w2.float(), ids, weights.float())   # the same bf16 values, in fp32
    torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=1e-2)     # one rounding to bf16
    assert (out.float() - exact).abs().max() <= exact.abs().max() * 2 ** -7


def test_the_moe_kernel_names_a_bad_expert_id():
    x, w13, w2, ids, weights = moe_inputs(4, 4, 2, 16, 16, torch.float32)
    ids[2, 1] = 4
    with pytest.raises(RuntimeError, match="expert id 4 out of range"):
        cpu_kernels.moe(x, w13, w2, ids, weights)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("n_in, n_out", [(64, 96), (24, 7), (256, 770)])
def test_the_linear_kernel_equals_f_linear(rows, n_in, n_out):
    gen = torch.Generator().manual_seed(rows * n_out)
    x, b = torch.randn(rows, n_in, generator=gen), torch.randn(n_out, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen) / n_in ** 0.5              # outputs of unit scale
    torch.testing.assert_close(cpu_kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    got = cpu_kernels.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    exact = F.linear(x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-3)   # rounded once, at the end


def test_the_linear_kernel_refuses_a_weight_stored_by_columns():
    with pytest.raises(RuntimeError, match="stored by rows"):
        cpu_kernels.linear(torch.randn(2, 8), torch.randn(8, 4).t())


def reference_attention(q, cache6, layer, tables, lengths, scale, window):
    """The compiled step's torch attention (gather + masked softmax) on the same cache."""
    keys, values = (x[:, :, None] for x in gather_blocks(cache6, layer, tables))
    positions = lengths - 1
    key_pos = torch.arange(tables.shape[1] * cache6.shape[3])
    visible = key_pos[None, :] <= positions[:, None]
    if window:
        visible &= key_pos[None, :] > positions[:, None] - window
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[:, None, None, :]
    return _attend(q, keys, values, mask, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [
    (4, 2, 64, None), (4, 4, 16, None), (8, 2, 128, None), (4, 1, 32, 7), (2, 2, 256, None)])
def test_decode_attention_equals_the_compiled_steps_torch_attention(dtype, heads, kv_heads, dim, window):
    gen = torch.Generator().manual_seed(dim + heads)
    blocks, layers, bs, batch, width = 40, 3, 4, 5, 6
    cache6 = torch.randn(blocks, layers, 2, bs, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks - 1, generator=gen)[:batch * width].view(batch, width) + 1
    lengths = torch.tensor([1, 5, 13, 24, 17])                 # one key; inside a block; a full table
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    got = cpu_kernels.decode_attention(q, cache6, 1, tables, lengths, scale, window)
    want = reference_attention(q, cache6, 1, tables, lengths, scale, window)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_decode_attention_keeps_softmax_stable_and_exact_for_large_scores():
    """Scores in the hundreds (an exp past float32's range without the max subtracted) and one dominant key."""
    gen = torch.Generator().manual_seed(3)
    cache6 = torch.randn(9, 1, 2, 4, 1, 16, generator=gen)
    tables, lengths = torch.arange(1, 9).view(1, 8), torch.tensor([30])
    q = torch.randn(1, 2, 16, generator=gen) * 40
    got = cpu_kernels.decode_attention(q, cache6, 0, tables, lengths, 1.0, None)
    torch.testing.assert_close(got, reference_attention(q, cache6, 0, tables, lengths, 1.0, None),
                               rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


def test_decode_attention_names_a_length_outside_the_table():
    cache6 = torch.randn(5, 1, 2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu_kernels.decode_attention(torch.randn(1, 1, 16), cache6, 0, torch.tensor([[1, 2]]), torch.tensor([9]),
                                     1.0, None)


def test_the_plan_takes_the_kernel_where_it_measured_faster(monkeypatch):
    shape = MoEShape(8, 256, 256)
    pick = lambda tokens, dtype: choose_path(shape, tokens, 2, dtype, False, True, True, True)  # noqa: E731
    assert [pick(t, torch.float32) for t in (1, 8, 32, 128, 129, 256)] == ["cpu"] * 4 + ["grouped"] * 2
    monkeypatch.setenv("STRATA_NATIVE_BF16", "0")        # bf16 multiplied by conversion: the kernel at every size
    assert {pick(t, torch.bfloat16) for t in (1, 32, 1024)} == {"cpu"}
    monkeypatch.setenv("STRATA_NATIVE_BF16", "1")        # native bf16 GEMMs: only where gather beat them
    bound = plan.CPU_KERNEL_MAX_PAIRS_PER_EXPERT[torch.bfloat16]
    assert pick(bound * 4, torch.bfloat16) == "cpu" and pick(bound * 4 + 4, torch.bfloat16) != "cpu"
    # without the kernel the plan is the one the tables above it give
    assert choose_path(shape, 32, 2, torch.float32, False, True, True, False) == "gather"


def test_the_switch_turns_the_kernels_off(monkeypatch):
    from engine.compiled_decode import GraphAttention
    from engine.kv_cache import KVCache
    x = torch.zeros(2, 8)
    assert cpu_kernels.usable(x)
    assert not cpu_kernels.usable(x.to(torch.float16)) and not cpu_kernels.usable(x, x.bfloat16())
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    assert not cpu_kernels.available() and not cpu_kernels.usable(x)
    cache = KVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.float32,
                    device=torch.device("cpu"))
    assert not GraphAttention(cache).kernel
    monkeypatch.delenv(cpu_kernels.ENV_SWITCH)
    assert GraphAttention(cache).kernel


def test_a_failed_build_falls_back_to_the_torch_code(tmp_path):
    """A source that does not compile: `available()` says no, with the reason, and the MoE plan keeps its paths."""
    broken = tmp_path / "kernels.cpp"
    broken.write_text("this is not C++\n")
    code = (
        "import logging, torch\n"
        "from pathlib import Path\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from engine import cpu_kernels\n"
        f"cpu_kernels.SOURCE = Path({str(broken)!r})\n"
        "assert not cpu_kernels.available()\n"
        "assert cpu_kernels.error() and not cpu_kernels.usable(torch.zeros(1))\n"
        "from engine.moe.local import LocalMoE\n"
        "moe = LocalMoE(torch.randn(4, 8, 8), torch.randn(4, 8, 4))\n"
        "assert moe.choose(torch.zeros(3, 8), 2, compiling=True) != 'cpu'\n"
        "print('fell back')\n")
    env = {**os.environ, "STRATA_COMPILE_CACHE": str(tmp_path / "cache" / "inductor")}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fell back" in run.stdout
    assert "CPU kernels are not available" in run.stderr
