"""Inputs of `quant_bench.py`: random-weight checkpoints of memory-bound shapes, and the bundled model's held-out
windows, rebuilt exactly as its recipe builds them.

    write_random_checkpoint(folder, shape)   config.json + model.safetensors (bfloat16, seeded normal weights) +
                                             the bundled tokenizer; nothing is downloaded
    heldout_windows(seq_len, count)          `Heldout`: [windows, seq_len + 1] token ids of the held-out split
                                             (models/recipe: prepare_data.encode_files + train.eval_windows)
                                             and where its text came from
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "models" / "recipe"
BUNDLED = ROOT / "models" / "strata-moe-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
INIT_STD = 0.02


class Shape(NamedTuple):
    """A Qwen3 (dense) or Qwen3-MoE (`experts` > 0) decoder; attention is `heads` x `head_dim` with `kv_heads`."""

    name: str
    hidden: int
    layers: int
    intermediate: int        # dense MLP, or each expert's (moe_intermediate_size)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0


# ~0.5B dense (Qwen3-0.6B's attention and MLP, a 32k vocabulary) and ~1B-total MoE (32 experts, 4 active).
DENSE_06B = Shape("dense-0.6B", 1024, 28, 3072, 16, 8, 128, 32768)
MOE_1B = Shape("moe-1B", 1024, 16, 512, 16, 8, 128, 32768, experts=32, top_k=4)
# --quick: the same code paths at toy sizes.
DENSE_TOY = Shape("dense-toy", 256, 2, 512, 4, 2, 64, 4096)
MOE_TOY = Shape("moe-toy", 256, 2, 256, 4, 2, 64, 4096, experts=8, top_k=2)


def hf_config(shape: Shape) -> dict:
    """config.json of the shape (transformers' own defaults for every field not set here)."""
    import transformers

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0, dtype="bfloat16")
    if shape.experts:
        config = transformers.Qwen3MoeConfig(intermediate_size=shape.intermediate,
                                             moe_intermediate_size=shape.intermediate, num_experts=shape.experts,
                                             num_experts_per_tok=shape.top_k, norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[], **common)
    else:
        config = transformers.Qwen3Config(intermediate_size=shape.intermediate, **common)
    arch = "Qwen3MoeForCausalLM" if shape.experts else "Qwen3ForCausalLM"
    return {**config.to_dict(), "architectures": [arch]}


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint (per-expert names, as `save_pretrained` writes them)."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h), "model.norm.weight": (h,),
                                       "lm_head.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out.update({f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
                    f"{p}self_attn.q_proj.weight": (q, h), f"{p}self_attn.k_proj.weight": (kv, h),
                    f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, q),
                    f"{p}self_attn.q_norm.weight": (shape.head_dim,),
                    f"{p}self_attn.k_norm.weight": (shape.head_dim,)})
        mlps = [f"{p}mlp.experts.{e}." for e in range(shape.experts)] if shape.experts else [f"{p}mlp."]
        for m in mlps:
            out.update({f"{m}gate_proj.weight": (shape.intermediate, h), f"{m}up_proj.weight": (shape.intermediate, h),
                        f"{m}down_proj.weight": (h, shape.intermediate)})
        if shape.experts:
            out[f"{p}mlp.gate.weight"] = (shape.experts, h)
    return out


def random_tensor(name: str, dims: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(dims) == 1:                                   # norms: ones, as a fresh model has them
        return torch.ones(dims, dtype=torch.bfloat16)
    return (torch.randn(dims, generator=generator) * INIT_STD).to(torch.bfloat16)


def write_random_checkpoint(folder: Path, shape: Shape, seed: int = 0) -> Path:
    """A loadable random-weight checkpoint of `shape` in `folder`, with the bundled tokenizer (its 4,096 ids fit
    any vocabulary of at least that size). Returns the folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(name, dims, generator) for name, dims in tensor_shapes(shape).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    for name in TOKENIZER_FILES:
        shutil.copyfile(BUNDLED / name, folder / name)
    return folder


class Heldout(NamedTuple):
    windows: torch.Tensor    # [windows, seq_len + 1] int64
    source: str              # where the text came from, in words


def _recipe():
    """The recipe's own modules (models/recipe is not a package)."""
    sys.path.insert(0, str(RECIPE))
    try:
        import prepare_data
        import train
    finally:
        sys.path.remove(str(RECIPE))
    return prepare_data, train


def heldout_windows(seq_len: int = 512, count: int | None = 64) -> Heldout:
    """The bundled model's held-out split (models/recipe/heldout_files.txt, read from this interpreter's standard
    library, encoded with the bundled tokenizer, documents joined by <|endoftext|>), cut into non-overlapping
    windows, `count` evenly spaced ones (None: all), exactly as the recipe evaluates.

    When a listed file is missing (another Python version), the nearest faithful equivalent: the recipe's own
    split rule (`prepare_data.is_heldout`, a hash of the path) over the sources this interpreter does have."""
    from tokenizers import Tokenizer

    prepare_data, train = _recipe()
    root = prepare_data.stdlib_root()
    files = prepare_data.read_list(prepare_data.HELDOUT_LIST)
    missing = [rel for rel in files if not (root / rel).is_file()]
    source = f"the recipe's {len(files)} held-out files under {root}"
    if missing:
        files = [rel for rel in prepare_data.stdlib_sources(root) if prepare_data.is_heldout(rel)]
        source = (f"{len(missing)} of the recipe's held-out files are missing under {root} (e.g. {missing[0]}); "
                  f"used the recipe's split rule over this interpreter's sources instead: {len(files)} files")
    tokenizer = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    eot = tokenizer.token_to_id(prepare_data.EOT)
    ids: list[int] = []
    for enc in tokenizer.encode_batch([(root / rel).read_text(encoding="utf-8") for rel in files]):
        ids.extend(enc.ids + [eot])                  # as prepare_data.encode_files
    tokens = np.asarray(ids, dtype=np.uint16)
    return Heldout(train.eval_windows(tokens, seq_len, count), f"{source}, {tokens.size:,} tokens")
