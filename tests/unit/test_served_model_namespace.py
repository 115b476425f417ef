"""The router hashes prompts in exactly the namespace its workers store blocks in, whatever the quantization flags:
`ServedModel.load` (torch-free) against the namespace a worker's engine builds (`worker_common.engine_setup`)."""
from __future__ import annotations

import json
import shutil

import pytest

from router.served_model import QuantChoice, ServedModel
from worker_common.engine_setup import build_engine_from


@pytest.mark.parametrize("quant", [QuantChoice(), QuantChoice("int4", 32, "fp8"), QuantChoice("int8", 128, "int8"),
                                   QuantChoice(None, 128, "fp8")], ids=["auto", "int4-fp8kv", "int8-int8kv", "fp8kv"])
def test_router_namespace_equals_the_workers(tiny_checkpoint, quant):
    path = str(tiny_checkpoint("qwen3_moe").path)
    bundle = build_engine_from(path, num_blocks=8, quantization=quant.quantization,
                               quant_group_size=quant.group_size, kv_cache_dtype=quant.kv_cache_dtype)
    served = ServedModel.load(path, "float32", 16, 256, quant=quant)
    assert served.namespace == bundle.namespace


def test_every_quantization_choice_is_a_namespace_of_its_own(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3_moe").path)
    choices = [QuantChoice(), QuantChoice("int8"), QuantChoice("int4", 32), QuantChoice("int4", 64),
               QuantChoice(kv_cache_dtype="fp8"), QuantChoice(kv_cache_dtype="int8"), QuantChoice("fp8", 128, "fp8")]
    roots = {ServedModel.load(path, quant=q).namespace.fingerprint() for q in choices}
    assert len(roots) == len(choices)


def test_a_prequantized_checkpoint_is_named_by_its_quantization_config(tiny_checkpoint, tmp_path):
    """Two checkpoints with the same tensors but different declared quantization never share a namespace."""
    src = tiny_checkpoint("qwen3_moe").path
    names = []
    for bits in (4, 8):
        dest = tmp_path / f"q{bits}"
        shutil.copytree(src, dest)
        config = json.loads((dest / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": 32}
        (dest / "config.json").write_text(json.dumps(config))
        names.append(ServedModel.load(str(dest)).namespace.model_fingerprint)
    assert names[0] != names[1] and all("/ckpt-gptq-" in n for n in names)
