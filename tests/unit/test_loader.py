"""The loader reads single and sharded checkpoints, fingerprints them, and rejects broken folders with typed
errors that name the file, tensor or field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader import (CheckpointError, ConfigFieldError, MissingFileError, MissingTensorError,
                           TensorShapeError, TokenizerMismatchError, UnsupportedArchitectureError,
                           load_checkpoint, load_model)
from engine.models.spec import parse_spec
from engine.tokenizer import Tokenizer
from engine.config import ModelConfig


def copy_checkpoint(tiny_checkpoint, name: str, dest: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(name).path, dest / name))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_sharded_checkpoint_loads_through_index(tiny_checkpoint):
    folder = tiny_checkpoint("llama_sharded").path
    ckpt = load_checkpoint(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(ckpt.files) > 1
    loaded = load_model(ModelConfig(str(folder)))
    assert loaded.model.lm_head is None      # tied embeddings
    assert loaded.spec.tie_word_embeddings


def test_fingerprint_names_arch_dtype_quant_and_differs_between_checkpoints(tiny_checkpoint):
    a = load_checkpoint(tiny_checkpoint("llama").path)
    b = load_checkpoint(tiny_checkpoint("llama_llama3").path)
    fp = a.fingerprint("float32")
    assert fp.startswith("LlamaForCausalLM/") and fp.endswith("/float32/none")
    assert fp == load_checkpoint(tiny_checkpoint("llama").path).fingerprint("float32")
    assert fp != b.fingerprint("float32")
    assert fp != a.fingerprint("bfloat16")


def test_moe_experts_are_stacked_at_load(tiny_checkpoint):
    loaded = load_model(ModelConfig(str(tiny_checkpoint("qwen3_moe").path)))
    experts = loaded.model.layers[0].mlp.experts
    assert tuple(experts.w13.shape) == (4, 64, 64) and tuple(experts.w2.shape) == (4, 64, 32)
    hf = tiny_checkpoint("qwen3_moe").hf_model.model.layers[0].mlp.experts
    assert torch.equal(experts.w13, hf.gate_up_proj) and torch.equal(experts.w2, hf.down_proj)
    assert loaded.spec.moe.sparse_layers == (0,)       # mlp_only_layers=[1]


def test_unknown_architecture_lists_supported(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, "llama", tmp_path)
    edit_config(folder, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM.*Qwen3MoeForCausalLM"):
        load_checkpoint(folder)


def test_missing_shard_names_the_shard(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, "llama_sharded", tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(MissingFileError, match=shard.name):
        load_checkpoint(folder)


def test_wrong_tensor_shape_names_tensor_and_shapes(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, "qwen2", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(folder, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(TensorShapeError, match=rf"{name}.*model.safetensors.*\[16, 64\].*expected \[32, 64\]"):
        load_model(ModelConfig(str(folder)))


def test_missing_tensor_names_it(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, "mixtral", tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    edit_weights(folder, lambda t: t.pop(name))
    with pytest.raises(MissingTensorError, match=rf"{name}"):
        load_model(ModelConfig(str(folder)))


def test_tokenizer_larger_than_vocab_is_rejected(tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, "llama", tmp_path)
    edit_config(folder, vocab_size=100)
    with pytest.raises(TokenizerMismatchError, match="203 ids.*vocab_size is 100"):
        load_model(ModelConfig(str(folder)))


def test_missing_config_and_weights_are_named(tmp_path):
    with pytest.raises(MissingFileError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                                       "hidden_size": 8, "intermediate_size": 8,
                                                       "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(MissingFileError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_bad_config_fields_are_named():
    base = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 2, "num_experts_per_tok": 3,
            "moe_intermediate_size": 4}
    with pytest.raises(ConfigFieldError, match="num_experts_per_tok=3 exceeds num_experts=2"):
        parse_spec(base)
    with pytest.raises(ConfigFieldError, match="'hidden_size'"):
        parse_spec({**base, "hidden_size": None})
    with pytest.raises(ConfigFieldError, match="rope type 'longrope'"):
        parse_spec({**base, "num_experts_per_tok": 1, "rope_scaling": {"type": "longrope", "factor": 2.0}})
    with pytest.raises(ConfigFieldError, match="'shared_expert_intermediate_size' is missing"):
        parse_spec({**base, "num_experts_per_tok": 1})
    with pytest.raises(ConfigFieldError, match="use_sliding_window"):
        parse_spec({**base, "num_experts_per_tok": 1, "use_sliding_window": True})
    assert issubclass(ConfigFieldError, CheckpointError) and issubclass(CheckpointError, ValueError)


def test_legacy_rope_fields_are_understood():
    spec = parse_spec({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                       "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert spec.rope.rope_type == "llama3" and spec.rope.theta == 500000.0 and spec.rope.get("factor") == 8.0


def test_tokenizer_reads_special_tokens_and_chat_template(tiny_checkpoint):
    tok = Tokenizer.from_dir(tiny_checkpoint("qwen3").path)
    assert tok.bos_token_id == 1 and tok.eos_token_ids[0] == 2
    ids = tok.encode("w0 w5 w199")
    assert ids == [1, 3, 8, 202]
    assert tok.decode(ids) == "w0 w5 w199"
    prompt = tok.apply_chat_template([{"role": "user", "content": "w1"}])
    assert prompt == "user: w1\nassistant:"
