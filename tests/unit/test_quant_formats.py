"""Pre-quantized checkpoint readers (engine/quant/formats): config.json declarations are parsed or refused with a
ConfigFieldError naming the field; GPTQ, AWQ and compressed-tensors tensors, packed here by small packers written
from each format's reference writer (AutoGPTQ / GPTQModel `pack`, AutoAWQ `WQLinear_GEMM.from_linear`,
compressed-tensors `pack_to_int32`), read back to the exact integers, scales and zeros.

The packers build words with numpy shifts and ORs, independently of engine/quant/formats/packing.py.
Real checkpoints written by the compressed-tensors library: tests/integration/test_quant_checkpoints.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.models.errors import ConfigFieldError, MissingTensorError, TensorShapeError
from engine.quant.formats import ActivationQuant, CheckpointQuant, checkpoint_quantization
from engine.quant.formats.ct_config import group_of
from engine.quant.packed import Fp8Weight, IntWeight

SOURCE = "ckpt/config.json"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # AutoAWQ WQLinear_GEMM.from_linear's order_map
P = "model.layers.0.mlp.down_proj"


# ---------------------------------------------------------------------------------------------------- factories
class DictReader:
    """A TensorReader over an in-memory dict, as engine.loader.SafetensorsReader over one file."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        return tuple(self.tensors[name].shape) if name in self.tensors else None

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def file_of(self, name: str) -> str:
        return "model-00001-of-00002.safetensors"


def quant(qc: dict) -> CheckpointQuant:
    q = checkpoint_quantization({"quantization_config": qc}, SOURCE)
    assert q is not None
    return q


def refusal(qc: dict) -> str:
    with pytest.raises(ConfigFieldError) as e:
        checkpoint_quantization({"quantization_config": qc}, SOURCE)
    assert str(e.value).startswith(f"{SOURCE}: ")
    return str(e.value)


def ints(shape: tuple[int, ...], high: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, size=shape).astype(np.uint64)


def words(values: np.ndarray) -> torch.Tensor:
    """uint64 numpy words (< 2**32) -> the int32 tensor a safetensors file holds."""
    return torch.from_numpy((values & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def pack_rows(values: np.ndarray, bits: int = 4) -> torch.Tensor:
    """GPTQ qweight: [k, n] -> [k * bits / 32, n]; word r holds rows r*per + j at bits [bits*j, bits*(j+1))."""
    per = 32 // bits
    out = np.zeros((values.shape[0] // per, values.shape[1]), dtype=np.uint64)
    for row in range(out.shape[0]):
        for j in range(per):
            out[row] |= values[row * per + j] << np.uint64(bits * j)
    return words(out)


def pack_cols(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """GPTQ qzeros and AWQ qweight / qzeros: [r, n] -> [r, n / 8]; nibble i of word c holds column 8c + order[i]."""
    out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= values[:, col * 8 + order[i]] << np.uint64(4 * i)
    return words(out)


def scales_fp16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) * 0.02 + 0.001).half()


def act_order_g_idx(k: int, g: int, seed: int) -> np.ndarray:
    """GPTQ with desc_act: columns are quantized in a permuted order; g_idx[c] = (position of c in it) // g."""
    order = np.random.default_rng(seed).permutation(k)
    g_idx = np.empty(k, dtype=np.int64)
    g_idx[order] = np.arange(k) // g
    return g_idx


def unpermute(w: IntWeight) -> torch.Tensor:
    """`w.dequantize()` back in the checkpoint's input-column order (column j of w is input perm[j])."""
    deq = w.dequantize()
    if w.perm is None:
        return deq
    back = torch.empty_like(deq)
    back[:, w.perm] = deq
    return back


# ---------------------------------------------------------------------------------------------------- config
def test_no_quantization_config_is_none():
    assert checkpoint_quantization({"architectures": ["LlamaForCausalLM"]}, SOURCE) is None


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quantization_config.quant_method"),
    ({"bits": 4}, "quantization_config.quant_method"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "quantization_config.bits"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "quantization_config.bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "quantization_config.group_size"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "format": "gptq_p"}, "quantization_config.format"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "quantization_config.is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int64"}, "quantization_config.pack_dtype"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"re:.*down.*": {"bits": 8}}}, "quantization_config.dynamic"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": "yes"}, "quantization_config.desc_act"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "quantization_config.version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, "quantization_config.version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "format": "gemv_fast"}, "quantization_config.format"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "backend": "llm-awq"}, "quantization_config.backend"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "quantization_config.zero_point"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "quantization_config.bits"),
    ({"quant_method": "awq", "bits": 4}, "quantization_config.group_size"),
])
def test_unsupported_quantization_is_refused_naming_the_field(qc, field):
    message = refusal(qc)
    assert f" {field} is " in message and "supported" in message


def test_refusal_lists_what_is_supported():
    assert "['compressed-tensors', 'gptq', 'awq']" in refusal({"quant_method": "bitsandbytes"})
    assert "['gemm']" in refusal({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    assert "[4]" in refusal({"quant_method": "gptq", "bits": 3, "group_size": 128})


def test_gptq_and_awq_configs_map_to_int4():
    gptq = quant({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True})
    assert (gptq.scheme, gptq.name, gptq.activations) == ("int4", "gptq-int4-g64", None)
    act = quant({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": False,
                 "checkpoint_format": "gptq_v2"})
    assert act.name == "gptq-int4-g128-act-asym-v2"
    assert quant({"quant_method": "gptq", "bits": 4, "group_size": -1}).name == "gptq-int4-ch"
    awq = quant({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"})
    assert (awq.scheme, awq.name) == ("int4", "awq-int4-g128")
    # transformers v5 writes `format` next to the legacy `version`, and backend names a kernel, not a layout
    assert quant({"quant_method": "awq", "bits": 4, "group_size": 64, "format": "gemm", "backend": "auto"}).name \
        == "awq-int4-g64"


def ct_config(weights: dict, fmt: str, activations: dict | None = None, **top) -> dict:
    """One group targeting "Linear"; with a global `fmt` of "mixed-precision" the group says pack-quantized."""
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations,
             "output_activations": None, "format": "pack-quantized" if fmt == "mixed-precision" else fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "quantization_status": "compressed", **top}


W4_G128 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, "dynamic": False}
W8_CHANNEL = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
INT8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
G0 = "quantization_config.config_groups.group_0"


def test_compressed_tensors_presets_map_to_schemes_and_names():
    w4a16 = quant(ct_config(W4_G128, "pack-quantized"))
    assert (w4a16.scheme, w4a16.name, w4a16.activations) == ("int4", "ct-int4-g128", None)
    asym = quant(ct_config({**W4_G128, "symmetric": False, "group_size": 64}, "pack-quantized"))
    assert asym.name == "ct-int4-g64-asym"
    w8a8 = quant(ct_config(W8_CHANNEL, "int-quantized", INT8_TOKEN))
    assert (w8a8.scheme, w8a8.name, w8a8.activations) == ("int8", "ct-int8-ch-a8", ActivationQuant("int8", "token"))
    fp8 = quant(ct_config(FP8_CHANNEL, "float-quantized", FP8_TOKEN))
    assert (fp8.scheme, fp8.name, fp8.activations) == ("fp8", "ct-fp8", ActivationQuant("fp8", "token"))
    fp8_tensor = quant(ct_config({**FP8_CHANNEL, "strategy": "tensor"}, "float-quantized", FP8_TOKEN))
    assert fp8_tensor.name == "ct-fp8-t"
    assert quant(ct_config(FP8_CHANNEL, "naive-quantized")).name == "ct-fp8-a16"


def test_compressed_tensors_strategy_is_inferred_from_group_size_when_absent():
    weights = {"num_bits": 4, "type": "int", "group_size": 32, "symmetric": True}
    assert quant(ct_config(weights, "pack-quantized")).name == "ct-int4-g32"
    assert quant(ct_config({**weights, "group_size": -1}, "pack-quantized")).name == "ct-int4-ch"


@pytest.mark.parametrize("qc, field", [
    (ct_config({**FP8_CHANNEL, "strategy": "block", "block_structure": [128, 128]}, "float-quantized",
               {**FP8_TOKEN, "strategy": "group", "group_size": 128}), f"{G0}.weights.strategy"),
    (ct_config({**W4_G128, "num_bits": 3}, "pack-quantized"), f"{G0}.weights.num_bits"),
    (ct_config({**FP8_CHANNEL, "num_bits": 4}, "nvfp4-pack-quantized"), "quantization_config.format"),
    (dict(ct_config(FP8_CHANNEL, "mxfp4-pack-quantized"), format="mixed-precision"), f"{G0}.format"),
    (ct_config(W4_G128, "pack-quantized", {**INT8_TOKEN}), f"{G0}.input_activations"),
    (ct_config(W4_G128, "pack-quantized", {**FP8_TOKEN}), f"{G0}.input_activations"),
    (ct_config({**FP8_CHANNEL, "strategy": "tensor"}, "float-quantized",
               {**FP8_TOKEN, "strategy": "tensor", "dynamic": False}), f"{G0}.input_activations.dynamic"),
    (ct_config(FP8_CHANNEL, "float-quantized", {**FP8_TOKEN, "symmetric": False}),
     f"{G0}.input_activations.symmetric"),
    (ct_config(W4_G128, "pack-quantized", kv_cache_scheme={"num_bits": 8, "type": "float"}),
     "quantization_config.kv_cache_scheme"),
    (ct_config(W4_G128, "pack-quantized", transform_config={"config_groups": {"u": {}}}),
     "quantization_config.transform_config"),
    (ct_config(W4_G128, "pack-quantized", sparsity_config={"format": "sparse-24-bitmask"}),
     "quantization_config.sparsity_config"),
    (ct_config({**W4_G128, "strategy": "group", "group_size": None}, "pack-quantized"),
     f"{G0}.weights.group_size"),
    (ct_config({**FP8_CHANNEL, "symmetric": False}, "float-quantized", FP8_TOKEN), f"{G0}.weights.symmetric"),
    (ct_config(W4_G128, "dense"), "quantization_config.format"),
])
def test_compressed_tensors_unsupported_is_refused_naming_the_field(qc, field):
    assert f" {field} is " in refusal(qc)


def test_compressed_tensors_format_that_cannot_hold_the_weights_is_refused():
    qc = ct_config(FP8_CHANNEL, "pack-quantized", FP8_TOKEN)
    assert f"{G0}.format is 'pack-quantized'" in refusal(qc)
    del qc["config_groups"]["group_0"]["format"]
    assert "quantization_config.format is 'pack-quantized'" in refusal(qc)


def test_compressed_tensors_groups_of_different_schemes_are_refused():
    qc = ct_config(W4_G128, "mixed-precision")
    qc["config_groups"]["group_1"] = {"targets": ["re:.*down_proj"], "weights": W8_CHANNEL,
                                      "format": "pack-quantized"}
    message = refusal(qc)
    assert "quantization_config.config_groups mixes" in message and "int8-ch" in message


def test_compressed_tensors_preset_group_reference_is_refused():
    qc = ct_config(W4_G128, "pack-quantized")
    qc["config_groups"] = {"W4A16": ["Linear"]}
    assert "quantization_config.config_groups.W4A16 is ['Linear']" in refusal(qc)


def test_compressed_tensors_matching_follows_targets_ignore_and_priority():
    """Exact names beat patterns beat "Linear"; `ignore` wins over everything; patterns use re.match."""
    w4_g32 = {**W4_G128, "group_size": 32}
    qc = ct_config(w4_g32, "mixed-precision", ignore=["lm_head", "re:.*mlp.gate$", "model.layers.1.self_attn.o_proj"])
    qc["config_groups"]["group_1"] = {"targets": ["re:.*down_proj", "model.layers.0.mlp.up_proj"],
                                      "weights": {**W4_G128, "group_size": 64}, "format": "pack-quantized"}
    q = quant(qc)
    name_of = {p: (g.name if (g := group_of(p, q.groups, q.ignore)) else None) for p in (
        "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.gate", "model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.o_proj", "lm_head")}
    assert name_of == {"model.layers.0.self_attn.q_proj": "group_0", "model.layers.0.mlp.down_proj": "group_1",
                       "model.layers.0.mlp.up_proj": "group_1", "model.layers.0.mlp.gate": None,
                       "model.layers.0.mlp.gate_proj": "group_0", "model.layers.1.self_attn.o_proj": None,
                       "lm_head": None}
    reader = DictReader({})
    assert q.is_quantized(reader, "model.layers.0.self_attn.q_proj") and not q.is_quantized(reader, "lm_head")
    assert q.name == "ct-int4-g32+int4-g64"


# ---------------------------------------------------------------------------------------------------- GPTQ
def gptq_tensors(n: int, k: int, g: int, zeros: np.ndarray, g_idx: np.ndarray | None, v1: str, seed: int):
    """A GPTQ linear: q [k, n] in 0..15, zeros [k/g, n], scales [k/g, n]; v1 "gptqmodel" (one word subtraction of
    0x11111111), "autogptq" (zeros - 1 per nibble), or "" (gptq_v2: zeros as they are)."""
    q = ints((k, n), 16, seed)
    scales = scales_fp16((k // g, n), seed + 1)
    if v1 == "gptqmodel":
        qzeros = words((pack_cols(zeros).numpy().view(np.uint32).astype(np.uint64) - 0x11111111) & 0xFFFFFFFF)
    elif v1 == "autogptq":
        qzeros = pack_cols(zeros - np.uint64(1))
    else:
        qzeros = pack_cols(zeros)
    tensors = {f"{P}.qweight": pack_rows(q), f"{P}.qzeros": qzeros, f"{P}.scales": scales}
    g_idx = np.arange(k) // g if g_idx is None else g_idx
    tensors[f"{P}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
    gi = torch.from_numpy(g_idx.astype(np.int64))
    # AutoGPTQ's reference: W[c, o] = scales[g_idx[c], o] * (q[c, o] - zeros[g_idx[c], o]); ours is W.T
    qt, zt = torch.from_numpy(q.astype(np.int64)), torch.from_numpy(zeros.astype(np.int64))
    reference = ((qt - zt[gi]).float() * scales.float()[gi]).T                 # [n, k]
    return tensors, q, reference


GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False}


@pytest.mark.parametrize("v1", ["gptqmodel", "autogptq", ""])
def test_gptq_asymmetric_reads_exact_ints_scales_and_zeros(v1):
    n, k, g = 24, 64, 16
    zeros = ints((k // g, n), 15, seed=3) + np.uint64(1)        # 1..15: AutoGPTQ's writer cannot store 0
    tensors, q, reference = gptq_tensors(n, k, g, zeros, None, v1, seed=5)
    qc = {**GPTQ_CONFIG, **({} if v1 else {"checkpoint_format": "gptq_v2"})}
    w = quant(qc).read(DictReader(tensors), P)
    assert isinstance(w, IntWeight) and (w.bits, w.group_size, w.perm) == (4, g, None)
    assert torch.equal(w.q, torch.from_numpy(q.astype(np.int32)).T)
    assert torch.equal(w.zero, torch.from_numpy(zeros.astype(np.int32)).T)
    assert torch.equal(w.scale, tensors[f"{P}.scales"].float().T)
    assert torch.equal(w.dequantize(), reference)


def test_gptq_v1_zero_point_of_zero_round_trips_through_the_word_subtraction():
    """GPTQModel writes v1 with one 32-bit subtraction, so a zero of 0 borrows from the next nibble; the word
    addition undoes it exactly (a per-nibble `+ 1` would read 16 and corrupt the neighbour)."""
    n, k, g = 16, 32, 16
    zeros = ints((k // g, n), 16, seed=7)
    zeros[0, :8] = [0, 15, 0, 0, 7, 0, 15, 15]
    tensors, _, reference = gptq_tensors(n, k, g, zeros, None, "gptqmodel", seed=9)
    w = quant(GPTQ_CONFIG).read(DictReader(tensors), P)
    assert torch.equal(w.zero, torch.from_numpy(zeros.astype(np.int32)).T)
    assert torch.equal(w.dequantize(), reference)


def test_gptq_symmetric_is_read_as_signed_ints_without_zero():
    n, k, g = 16, 64, 32
    zeros = np.full((k // g, n), 8, dtype=np.uint64)              # sym: the midpoint, stored as 7 in v1
    tensors, q, reference = gptq_tensors(n, k, g, zeros, None, "autogptq", seed=11)
    assert tensors[f"{P}.qzeros"][0, 0].item() == 0x77777777
    w = quant({**GPTQ_CONFIG, "group_size": g, "sym": True}).read(DictReader(tensors), P)
    assert w.zero is None
    assert torch.equal(w.q, torch.from_numpy(q.astype(np.int32)).T - 8)
    assert torch.equal(w.dequantize(), reference)


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_desc_act_shuffled_g_idx_becomes_perm_with_contiguous_groups(sym):
    n, k, g = 16, 128, 32
    g_idx = act_order_g_idx(k, g, seed=13)
    zeros = np.full((k // g, n), 8, dtype=np.uint64) if sym else ints((k // g, n), 15, seed=14) + np.uint64(1)
    tensors, q, reference = gptq_tensors(n, k, g, zeros, g_idx, "autogptq", seed=15)
    w = quant({**GPTQ_CONFIG, "group_size": g, "desc_act": True, "sym": sym}).read(DictReader(tensors), P)
    assert w.perm is not None and w.perm.dtype == torch.int64
    assert torch.equal(torch.from_numpy(g_idx)[w.perm], torch.arange(k) // g)    # groups now contiguous
    q_signed = torch.from_numpy(q.astype(np.int32)).T - (8 if sym else 0)
    assert torch.equal(w.q, q_signed[:, w.perm])
    assert torch.equal(unpermute(w), reference)
    x = torch.randn(3, k)
    torch.testing.assert_close(x[:, w.perm] @ w.dequantize().T, x @ reference.T)


def test_gptq_per_channel_group_size_minus_one():
    n, k = 16, 64
    zeros = ints((1, n), 15, seed=17) + np.uint64(1)
    tensors, _, reference = gptq_tensors(n, k, k, zeros, np.zeros(k, dtype=np.int64), "autogptq", seed=19)
    w = quant({**GPTQ_CONFIG, "group_size": -1}).read(DictReader(tensors), P)
    assert (w.group_size, tuple(w.scale.shape), w.perm) == (k, (n, 1), None)
    assert torch.equal(w.dequantize(), reference)


def test_gptq_word_layout_is_eight_rows_per_word_lowest_nibble_first():
    tensors = {f"{P}.qweight": torch.tensor([[0x76543210]], dtype=torch.int32).expand(1, 8).contiguous(),
               f"{P}.qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
               f"{P}.scales": torch.ones(1, 8, dtype=torch.float16)}
    w = quant({**GPTQ_CONFIG, "group_size": 8, "sym": True}).read(DictReader(tensors), P)
    assert w.q[0].tolist() == [v - 8 for v in range(8)]


def test_gptq_is_quantized_by_its_tensors():
    q = quant(GPTQ_CONFIG)
    reader = DictReader({f"{P}.qweight": torch.zeros(2, 8, dtype=torch.int32), "lm_head.weight": torch.zeros(4, 4)})
    assert q.is_quantized(reader, P) and not q.is_quantized(reader, "lm_head")


def test_gptq_g_idx_whose_groups_are_not_equal_sized_is_refused():
    n, k, g = 8, 32, 16
    zeros = ints((k // g, n), 15, seed=21) + np.uint64(1)
    g_idx = np.array([0] * 20 + [1] * 12)[np.random.default_rng(0).permutation(k)]
    tensors, _, _ = gptq_tensors(n, k, g, zeros, g_idx, "autogptq", seed=23)
    with pytest.raises(TensorShapeError, match=rf"'{P}.g_idx' in model-00001-of-00002.safetensors.*group_size=16"):
        quant(GPTQ_CONFIG).read(DictReader(tensors), P)


def test_gptq_missing_or_misshaped_tensors_name_tensor_and_file():
    n, k, g = 8, 32, 16
    tensors, _, _ = gptq_tensors(n, k, g, ints((k // g, n), 15, seed=1) + np.uint64(1), None, "autogptq", seed=2)
    q = quant(GPTQ_CONFIG)
    missing = {name: t for name, t in tensors.items() if not name.endswith("qzeros")}
    with pytest.raises(MissingTensorError, match=rf"'{P}.qzeros'"):
        q.read(DictReader(missing), P)
    bad = {**tensors, f"{P}.scales": tensors[f"{P}.scales"][:1]}
    with pytest.raises(TensorShapeError, match=rf"'{P}.scales' in model-00001-of-00002.safetensors has shape \[1, 8\], "
                                               r"expected \[2, 8\]"):
        q.read(DictReader(bad), P)
    wrong_dtype = {**tensors, f"{P}.qweight": tensors[f"{P}.qweight"].to(torch.int64)}
    with pytest.raises(TensorShapeError, match="dtype torch.int64"):
        q.read(DictReader(wrong_dtype), P)


# ---------------------------------------------------------------------------------------------------- AWQ
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}


def awq_tensors(n: int, k: int, g: int, seed: int):
    """AutoAWQ GEMM: intweight [k, n] (= W.T quantized), zeros and scales [k/g, n], columns interleaved."""
    q, zeros = ints((k, n), 16, seed), ints((k // g, n), 16, seed + 1)
    scales = scales_fp16((k // g, n), seed + 2)
    tensors = {f"{P}.qweight": pack_cols(q, AWQ_ORDER), f"{P}.qzeros": pack_cols(zeros, AWQ_ORDER),
               f"{P}.scales": scales}
    rows = torch.arange(k) // g
    qt, zt = torch.from_numpy(q.astype(np.int64)), torch.from_numpy(zeros.astype(np.int64))
    reference = ((qt - zt[rows]).float() * scales.float()[rows]).T              # [n, k]
    return tensors, q, zeros, reference


def test_awq_reads_exact_ints_scales_and_zeros():
    n, k, g = 32, 64, 16
    tensors, q, zeros, reference = awq_tensors(n, k, g, seed=31)
    w = quant(AWQ_CONFIG).read(DictReader(tensors), P)
    assert isinstance(w, IntWeight) and (w.bits, w.group_size, w.perm) == (4, g, None)
    assert torch.equal(w.q, torch.from_numpy(q.astype(np.int32)).T)
    assert torch.equal(w.zero, torch.from_numpy(zeros.astype(np.int32)).T)
    assert torch.equal(w.scale, tensors[f"{P}.scales"].float().T)
    assert torch.equal(w.dequantize(), reference)


def test_awq_word_layout_is_interleaved_0_2_4_6_1_3_5_7():
    """Columns 0..7 holding the values 0..7 pack to nibbles (low first) 0, 2, 4, 6, 1, 3, 5, 7."""
    assert pack_cols(np.arange(8, dtype=np.uint64)[None, :], AWQ_ORDER).item() == 0x75316420
    tensors = {f"{P}.qweight": torch.tensor([[0x75316420]] * 8, dtype=torch.int32),
               f"{P}.qzeros": torch.tensor([[0]], dtype=torch.int32),
               f"{P}.scales": torch.ones(1, 8, dtype=torch.float16)}
    w = quant({**AWQ_CONFIG, "group_size": 8}).read(DictReader(tensors), P)
    assert w.q[:, 0].tolist() == list(range(8))


def test_awq_k_not_a_multiple_of_group_size_is_refused():
    tensors, *_ = awq_tensors(8, 48, 16, seed=3)
    with pytest.raises(TensorShapeError, match=rf"'{P}.qweight'.*group_size=32"):
        quant({**AWQ_CONFIG, "group_size": 32}).read(DictReader(tensors), P)


# ------------------------------------------------------------------------------------------ compressed-tensors
def ct_pack(values: np.ndarray, bits: int) -> torch.Tensor:
    """compressed-tensors pack_to_int32 along the last dim: value + 2**(bits-1), element i of each word at bit
    bits * i (32 // bits per word, the last word zero-padded)."""
    per, offset = 32 // bits, 1 << (bits - 1)
    rows, cols = values.shape
    out = np.zeros((rows, -(-cols // per)), dtype=np.uint64)
    for c in range(cols):
        out[:, c // per] |= (values[:, c] + offset).astype(np.uint64) << np.uint64(bits * (c % per))
    return words(out)


def signed(shape: tuple[int, ...], bits: int, seed: int) -> np.ndarray:
    half = 1 << (bits - 1)
    return np.random.default_rng(seed).integers(-half, half, size=shape).astype(np.int64)


@pytest.mark.parametrize("bits, k", [(4, 64), (4, 40), (8, 64)])
def test_ct_pack_quantized_symmetric_reads_signed_ints(bits, k):
    n, g = 12, 8
    q = signed((n, k), bits, seed=41)
    scale = scales_fp16((n, k // g), 42).bfloat16()
    tensors = {f"{P}.weight_packed": ct_pack(q, bits), f"{P}.weight_scale": scale,
               f"{P}.weight_shape": torch.tensor([n, k])}
    w = quant(ct_config({**W4_G128, "num_bits": bits, "group_size": g}, "pack-quantized")).read(DictReader(tensors), P)
    assert isinstance(w, IntWeight) and w.zero is None and (w.bits, w.group_size) == (bits, g)
    assert torch.equal(w.q, torch.from_numpy(q).int())
    expected = torch.from_numpy(q).float() * scale.float().repeat_interleave(g, dim=1)
    assert torch.equal(w.dequantize(), expected)


def test_ct_pack_quantized_asymmetric_zero_points_are_packed_along_out_features():
    n, k, g = 20, 32, 16
    q, zp = signed((n, k), 4, seed=43), signed((n, k // g), 4, seed=44)
    scale = scales_fp16((n, k // g), 45).float()
    tensors = {f"{P}.weight_packed": ct_pack(q, 4), f"{P}.weight_scale": scale,
               f"{P}.weight_shape": torch.tensor([n, k]),
               f"{P}.weight_zero_point": ct_pack(zp.T.copy(), 4).T.contiguous()}        # [ceil(n / 8), G]
    assert tuple(tensors[f"{P}.weight_zero_point"].shape) == (3, 2)
    w = quant(ct_config({**W4_G128, "group_size": g, "symmetric": False}, "pack-quantized")).read(
        DictReader(tensors), P)
    assert torch.equal(w.q, torch.from_numpy(q + 8).int()) and torch.equal(w.zero, torch.from_numpy(zp + 8).int())
    expected = torch.from_numpy(q - np.repeat(zp, g, axis=1)).float() * scale.repeat_interleave(g, dim=1)
    assert torch.equal(w.dequantize(), expected)


def test_ct_int_quantized_asymmetric_channel_int8():
    n, k = 8, 32
    q, zp = signed((n, k), 8, seed=47), signed((n, 1), 8, seed=48)
    scale = scales_fp16((n, 1), 49)
    tensors = {f"{P}.weight": torch.from_numpy(q).to(torch.int8), f"{P}.weight_scale": scale,
               f"{P}.weight_zero_point": torch.from_numpy(zp).to(torch.int8)}
    w = quant(ct_config({**W8_CHANNEL, "symmetric": False}, "int-quantized", INT8_TOKEN)).read(DictReader(tensors), P)
    assert (w.bits, w.group_size) == (8, k)
    assert torch.equal(w.q, torch.from_numpy(q + 128).int()) and torch.equal(w.zero, torch.from_numpy(zp + 128).int())
    assert torch.equal(w.dequantize(), torch.from_numpy(q - zp).float() * scale.float())


def test_ct_act_order_group_g_idx_becomes_perm():
    n, k, g = 8, 64, 16
    q, g_idx = signed((n, k), 4, seed=51), act_order_g_idx(k, g, seed=52)
    scale = scales_fp16((n, k // g), 53).float()
    tensors = {f"{P}.weight_packed": ct_pack(q, 4), f"{P}.weight_scale": scale,
               f"{P}.weight_shape": torch.tensor([n, k]), f"{P}.weight_g_idx": torch.from_numpy(g_idx).int()}
    w = quant(ct_config({**W4_G128, "group_size": g, "actorder": "group"}, "pack-quantized")).read(
        DictReader(tensors), P)
    reference = torch.from_numpy(q).float() * scale[:, torch.from_numpy(g_idx)]     # [n, k] column c: group g_idx[c]
    assert torch.equal(unpermute(w), reference)


@pytest.mark.parametrize("scale_shape", [(1,), (), (16, 1)])
def test_ct_fp8_scales_are_broadcast_per_output_channel(scale_shape):
    n, k = 16, 32
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 20).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=torch.Generator().manual_seed(1)) + 0.5
    strategy = "channel" if scale_shape == (16, 1) else "tensor"
    tensors = {f"{P}.weight": weight, f"{P}.weight_scale": scale.bfloat16()}
    w = quant(ct_config({**FP8_CHANNEL, "strategy": strategy}, "float-quantized", FP8_TOKEN)).read(
        DictReader(tensors), P)
    assert isinstance(w, Fp8Weight) and w.weight is weight and tuple(w.scale.shape) == (n,)
    assert torch.equal(w.dequantize(), weight.float() * scale.bfloat16().float().reshape(-1, 1))


def test_ct_packed_weight_disagreeing_with_weight_shape_is_refused():
    tensors = {f"{P}.weight_packed": torch.zeros(8, 4, dtype=torch.int32), f"{P}.weight_scale": torch.ones(8, 2),
               f"{P}.weight_shape": torch.tensor([8, 64])}
    with pytest.raises(TensorShapeError, match=rf"'{P}.weight_packed'.*expected \[8, ceil\(64 \* 4 / 32\)\]"):
        quant(ct_config({**W4_G128, "group_size": 32}, "pack-quantized")).read(DictReader(tensors), P)


def test_ct_wrong_weight_dtype_and_ignored_module_are_refused():
    q = quant(ct_config(FP8_CHANNEL, "float-quantized", FP8_TOKEN))
    with pytest.raises(TensorShapeError, match="float8_e4m3fn"):
        q.read(DictReader({f"{P}.weight": torch.zeros(4, 4), f"{P}.weight_scale": torch.ones(4, 1)}), P)
    with pytest.raises(ConfigFieldError, match="lm_head is not quantized"):
        q.read(DictReader({}), "lm_head")
