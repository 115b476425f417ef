"""Pre-quantized checkpoints on disk, read through engine.loader.SafetensorsReader (engine/quant/formats).

- compressed-tensors: written by the compressed-tensors library itself from the tiny random HF models, the way
  llmcompressor's `oneshot` + `save_pretrained(save_compressed=True)` does (apply_quantization_config, min-max
  qparams from the library's `calculate_qparams`, ModelCompressor.compress_model, save_pretrained, update_config);
  MoE checkpoints, whose transformers-v5 experts are not nn.Linear, the way llmcompressor's model-free path does
  (the library's compressors over the safetensors tensors). Every quantized linear must dequantize exactly to the
  library's own decompression, and within quantization error of the original float weights.
- GPTQ (v1, act-order) and AWQ (GEMM): real model weights quantized round-to-nearest and packed by the test packers
  of tests/unit/test_quant_formats.py; AWQ is also cross-checked through compressed-tensors' AutoAWQConverter.

llmcompressor itself is not used: it pins transformers <= 5.17 and compressed-tensors 0.19 (this project runs
transformers 5.2x), and pulls datasets / pandas / pyarrow / auto-round; the library calls below are what its
`oneshot` runs for data-free schemes (W4A16, W8A16, W8A8 weights, FP8_DYNAMIC).
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import weight_files
from engine.loader import SafetensorsReader
from engine.quant.formats import CheckpointQuant, checkpoint_quantization
from engine.quant.packed import Fp8Weight, IntWeight
from tests.unit.test_quant_formats import AWQ_ORDER, act_order_g_idx, pack_cols, pack_rows, unpermute, words

ct = pytest.importorskip("compressed_tensors", reason="pip install -e '.[test]' installs compressed-tensors")
from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.compressors.format import infer_module_format  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,  # noqa: E402
                                             apply_quantization_config)
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from compressed_tensors.utils.match import match_quantizable_tensors  # noqa: E402

GROUP = 32    # the tiny models' hidden size is 64: the presets' 128-column groups would not divide it


# ---------------------------------------------------------------------------------------------------- factories
def scheme_of(preset: str, **weights) -> QuantizationScheme:
    """A compressed-tensors preset targeting "Linear", its group size cut to GROUP, weight args overridden."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights.model_dump()
    if args["strategy"] == "group":
        args["group_size"] = GROUP
    scheme.weights = QuantizationArgs(**{**args, **weights})
    return scheme


SCHEMES = {
    "W4A16": (scheme_of("W4A16"), None),
    "W4A16_ASYM": (scheme_of("W4A16_ASYM"), None),
    "W4A16_CHANNEL_ASYM": (scheme_of("W4A16_ASYM", strategy="channel", group_size=None), None),
    "W8A16": (scheme_of("W8A16"), None),
    "W8A16_NAIVE": (scheme_of("W8A16", strategy="channel", group_size=None), "naive-quantized"),
    "W8A8": (scheme_of("W8A8"), None),
    "W8A8_ASYM": (scheme_of("W8A8", symmetric=False), None),
    "FP8_DYNAMIC": (scheme_of("FP8_DYNAMIC"), None),
    "FP8_TENSOR_DYNAMIC": (scheme_of("FP8_DYNAMIC", strategy="tensor"), None),
}


def weight_qparams(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero point through the library's calculate_qparams (llmcompressor's default observer)."""
    if args.strategy == "group":
        x = weight.reshape(weight.shape[0], -1, args.group_size)              # [n, G, g]
        lo, hi = x.amin(-1), x.amax(-1)                                       # [n, G]
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)   # [n, 1]
    else:
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)           # [1]
    return calculate_qparams(lo, hi, args)


def save_with_model_compressor(model: torch.nn.Module, scheme: QuantizationScheme, fmt: str | None,
                               dest: Path) -> None:
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            scale, zero = weight_qparams(module.weight.data, module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dest)
    compressor.update_config(dest)


MOE_IGNORE = ["lm_head", "model.embed_tokens", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]


def save_model_free(src: Path, scheme: QuantizationScheme, dest: Path) -> None:
    """Quantize a checkpoint's files tensor by tensor with the library's compressor (no nn.Module needed)."""
    tensors = load_file(str(src / "model.safetensors"))
    compressor = BaseCompressor.load_from_registry(_format_of(scheme))
    for module, name in list(match_quantizable_tensors(tensors, MOE_IGNORE, scheme.targets)):
        weight = tensors.pop(name)
        scale, zero = weight_qparams(weight, scheme.weights)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
        tensors.update({f"{module}.{k}": v for k, v in compressor.compress(state, scheme).items()})
    dest.mkdir()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dest / "config.json")
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=MOE_IGNORE, format=_format_of(scheme),
                                quantization_status="compressed")
    ModelCompressor(quantization_config=config).update_config(str(dest))


def _format_of(scheme: QuantizationScheme) -> str:
    return infer_module_format(torch.nn.Linear, scheme).value


def open_checkpoint(folder: Path) -> tuple[CheckpointQuant, SafetensorsReader, dict]:
    config = json.loads((folder / "config.json").read_text())
    quant = checkpoint_quantization(config, str(folder / "config.json"))
    assert quant is not None
    return quant, SafetensorsReader(weight_files(folder)), config["quantization_config"]


def modules_with(reader: SafetensorsReader, suffix: str) -> set[str]:
    return {name.removesuffix(suffix) for name in reader._shapes if name.endswith(suffix)}


def library_decompress(reader: SafetensorsReader, prefix: str, qc: dict) -> torch.Tensor:
    """The library's own dequantization of one module, from the tensors on disk."""
    group = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    state = {n.removeprefix(prefix + "."): reader.get(n) for n in reader._shapes
             if n.rpartition(".")[0] == prefix}
    return BaseCompressor.load_from_registry(group.format or qc["format"]).decompress(state, group)["weight"]


def assert_reads_like_the_library(folder: Path, originals: dict[str, torch.Tensor]) -> int:
    """Every quantized linear: exact against the library, within quantization error of the float weight; every
    other linear weight: not quantized. Returns how many quantized linears were checked."""
    quant, reader, qc = open_checkpoint(folder)
    quantized = modules_with(reader, ".weight_scale")
    plain = {m for m in modules_with(reader, ".weight") - quantized
             if len(reader.shape(f"{m}.weight")) == 2 and "embed_tokens" not in m}
    assert quantized and "lm_head" in plain
    assert all(quant.is_quantized(reader, m) for m in quantized)
    assert not any(quant.is_quantized(reader, m) for m in plain)
    for prefix in sorted(quantized):
        weight = quant.read(reader, prefix)
        reference = library_decompress(reader, prefix, qc)
        assert torch.equal(weight.dequantize().to(reference.dtype), reference), prefix
        assert_within_quantization_error(weight, originals[f"{prefix}.weight"].float(), prefix)
    return len(quantized)


def assert_within_quantization_error(weight: IntWeight | Fp8Weight, original: torch.Tensor, prefix: str) -> None:
    error = (weight.dequantize() - original).abs()                            # [n, k]
    if isinstance(weight, Fp8Weight):      # e4m3: 3 mantissa bits, so half a step is 1/16 of the value
        bound = original.abs() / 16 + weight.scale[:, None] * 2.0 ** -9
    else:                                  # half a step, a whole one where an asymmetric zero point was rounded
        bound = weight.scale.repeat_interleave(weight.group_size, dim=1) * (0.5 if weight.zero is None else 1.0)
    assert bool((error <= bound * (1 + 1e-3) + 1e-7).all()), (prefix, (error - bound).max().item())


# ------------------------------------------------------------------------------------------ compressed-tensors
@pytest.mark.parametrize("preset", sorted(SCHEMES))
def test_compressed_tensors_checkpoint_reads_exactly_like_the_library(preset, tiny_checkpoint, tmp_path):
    tiny = tiny_checkpoint("llama")
    originals = {k: v.clone() for k, v in tiny.hf_model.state_dict().items()}
    scheme, fmt = SCHEMES[preset]
    save_with_model_compressor(copy.deepcopy(tiny.hf_model), scheme, fmt, tmp_path / preset)
    assert assert_reads_like_the_library(tmp_path / preset, originals) == 14      # 2 layers x 7 linears


def test_compressed_tensors_scheme_names_and_formats_on_disk(tiny_checkpoint, tmp_path):
    tiny = tiny_checkpoint("llama")
    expected = {"W4A16": ("int4", "ct-int4-g32", "pack-quantized"),
                "W8A8": ("int8", "ct-int8-ch-a8", "int-quantized"),
                "FP8_DYNAMIC": ("fp8", "ct-fp8", "float-quantized"),
                "W8A16_NAIVE": ("int8", "ct-int8-ch", "naive-quantized")}
    for preset, (scheme, name, fmt) in expected.items():
        save_with_model_compressor(copy.deepcopy(tiny.hf_model), *SCHEMES[preset], tmp_path / preset)
        quant, _, qc = open_checkpoint(tmp_path / preset)
        assert (quant.scheme, quant.name, qc["format"]) == (scheme, name, fmt)


def test_compressed_tensors_bfloat16_checkpoint_keeps_bfloat16_scales_exact(tiny_checkpoint, tmp_path):
    model = copy.deepcopy(tiny_checkpoint("qwen3").hf_model).to(torch.bfloat16)
    originals = {k: v.clone() for k, v in model.state_dict().items()}
    save_with_model_compressor(model, *SCHEMES["W4A16_ASYM"], tmp_path / "bf16")
    _, reader, _ = open_checkpoint(tmp_path / "bf16")
    assert reader.get("model.layers.0.self_attn.q_proj.weight_scale").dtype == torch.bfloat16
    assert assert_reads_like_the_library(tmp_path / "bf16", originals) == 14


@pytest.mark.parametrize("arch, preset", [("qwen2_moe", "W4A16"), ("mixtral", "FP8_DYNAMIC"),
                                          ("qwen2_moe", "W8A8_ASYM")])
def test_compressed_tensors_moe_experts_quantized_and_routers_ignored(arch, preset, tiny_checkpoint, tmp_path):
    tiny = tiny_checkpoint(arch)
    originals = load_file(str(tiny.path / "model.safetensors"))
    save_model_free(tiny.path, SCHEMES[preset][0], tmp_path / arch)
    quant, reader, _ = open_checkpoint(tmp_path / arch)
    assert not quant.is_quantized(reader, "model.layers.0.mlp.gate")
    experts = "mlp.experts.3.down_proj" if arch == "qwen2_moe" else "block_sparse_moe.experts.3.w2"
    assert quant.is_quantized(reader, f"model.layers.1.{experts}")
    assert assert_reads_like_the_library(tmp_path / arch, originals) > 8 * 2


# ---------------------------------------------------------------------------------------------------- GPTQ / AWQ
def rtn_asym(weight: torch.Tensor, g: int) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit over contiguous groups: q [n, k] and zeros [n, G] in 0..15, fp16
    scales [n, G]."""
    n, k = weight.shape
    x = weight.float().reshape(n, k // g, g)                                  # [n, G, g]
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)                 # [n, G]
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(x / scale.float()[..., None] + zero[..., None]).clamp(0, 15).reshape(n, k)
    return q.numpy().astype(np.uint64), zero.numpy().astype(np.uint64), scale


def linear_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in tensors.items() if n.startswith("model.layers.") and n.endswith("_proj.weight")]


def write_quantized(tiny_path: Path, dest: Path, quantization_config: dict, pack) -> dict[str, torch.Tensor]:
    """The tiny checkpoint with every decoder linear replaced by `pack(prefix, weight)`'s tensors; returns each
    prefix's reference dequantization `[n, k]` in input-column order."""
    tensors = load_file(str(tiny_path / "model.safetensors"))
    references = {}
    for name in linear_weights(tensors):
        prefix = name.removesuffix(".weight")
        packed, references[prefix] = pack(prefix, tensors.pop(name))
        tensors.update(packed)
    dest.mkdir()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tiny_path / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return references


def gptq_pack(prefix: str, weight: torch.Tensor, g: int, seed: int):
    """GPTQ with act-order: groups are formed over a permuted column order, tensors stored in the original one;
    v1 zeros as GPTQModel writes them (one word subtraction of 0x11111111)."""
    k = weight.shape[1]
    g_idx = act_order_g_idx(k, g, seed)
    order = np.argsort(g_idx, kind="stable")                                  # act order: groups contiguous
    q_perm, zeros, scale = rtn_asym(weight[:, torch.from_numpy(order)], g)
    q = np.empty_like(q_perm)
    q[:, order] = q_perm                                                      # back to input-column order
    v2 = pack_cols(zeros.T.copy()).numpy().view(np.uint32).astype(np.uint64)
    tensors = {f"{prefix}.qweight": pack_rows(q.T.copy()), f"{prefix}.qzeros": words(v2 - 0x11111111),
               f"{prefix}.scales": scale.T.contiguous(), f"{prefix}.g_idx": torch.from_numpy(g_idx).int()}
    gi = torch.from_numpy(g_idx)
    reference = (torch.from_numpy(q.astype(np.int64)) - torch.from_numpy(zeros.astype(np.int64))[:, gi]).float() \
        * scale.float()[:, gi]                                                # [n, k]
    return tensors, reference


def awq_pack(prefix: str, weight: torch.Tensor, g: int):
    q, zeros, scale = rtn_asym(weight, g)                                     # [n, k], [n, G], [n, G]
    tensors = {f"{prefix}.qweight": pack_cols(q.T.copy(), AWQ_ORDER), f"{prefix}.scales": scale.T.contiguous(),
               f"{prefix}.qzeros": pack_cols(zeros.T.copy(), AWQ_ORDER)}
    cols = torch.arange(weight.shape[1]) // g
    reference = (torch.from_numpy(q.astype(np.int64)) - torch.from_numpy(zeros.astype(np.int64))[:, cols]).float() \
        * scale.float()[:, cols]
    return tensors, reference


def test_gptq_act_order_checkpoint_reads_to_the_reference_weights(tiny_checkpoint, tmp_path):
    tiny = tiny_checkpoint("llama")
    originals = load_file(str(tiny.path / "model.safetensors"))
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
          "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    references = write_quantized(tiny.path, tmp_path / "gptq", qc,
                                 lambda p, w: gptq_pack(p, w, GROUP, seed=len(p)))
    quant, reader, _ = open_checkpoint(tmp_path / "gptq")
    assert (quant.scheme, quant.name) == ("int4", "gptq-int4-g32-act-asym")
    assert not quant.is_quantized(reader, "lm_head")
    for prefix, reference in references.items():
        weight = quant.read(reader, prefix)
        assert weight.perm is not None and torch.equal(unpermute(weight), reference), prefix
        assert_within_quantization_error(weight, originals[f"{prefix}.weight"][:, weight.perm].float(), prefix)


def test_awq_checkpoint_reads_like_compressed_tensors_autoawq_converter(tiny_checkpoint, tmp_path):
    """compressed-tensors' AutoAWQConverter is a second, independent reading of the AWQ GEMM layout."""
    tiny = tiny_checkpoint("qwen2")
    qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}
    references = write_quantized(tiny.path, tmp_path / "awq", qc, lambda p, w: awq_pack(p, w, GROUP))
    quant, reader, _ = open_checkpoint(tmp_path / "awq")
    converted = AutoAWQConverter(bits=4, group_size=GROUP).process(load_file(str(tmp_path / "awq/model.safetensors")))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=GROUP, symmetric=False))
    decompress = BaseCompressor.load_from_registry("pack-quantized").decompress
    for prefix, reference in references.items():
        weight = quant.read(reader, prefix)
        assert torch.equal(weight.dequantize(), reference), prefix
        state = {n.removeprefix(prefix + "."): t for n, t in converted.items() if n.rpartition(".")[0] == prefix}
        library = decompress(state, scheme)["weight"]                         # fp16
        assert torch.equal(weight.dequantize().half(), library), prefix
