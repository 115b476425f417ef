"""The EAGLE draft head of ``strata-eagle-tiny`` and the frozen target it borrows from (used by ``train_eagle.py``).

For head position i the head reads x_i = fc([embed(t_{i+1}), f_i]) (f_i: the target's last decoder layer output at
i, BEFORE the final norm), runs ONE ``Qwen3DecoderLayer`` (RoPE at position i, causal over the head's own earlier
positions) and returns g_i, its guess of f_{i+1}; the draft logits for t_{i+2} are the target's
lm_head(final_norm(g_i)). Drafting unrolls it on its own output: (d_{i+2}, g_i) -> g_{i+1} -> d_{i+3}, ...

Unrolled steps run in parallel over all start positions n as extra *blocks* of the sequence (as in HASS and
EAGLE-3's training-time test). Block 0 is the teacher-forced pass; row n of block b >= 1 is step b + 1 of the draft
started at n. ``block_mask`` says what each row sees; the same picture serves a causal LM verifying (or drafting)
a chain of tokens after t_0..t_{n+1} (``offset=1``):

    keys ->        block 0 (rows 0..R-1)      block 1 ... block b
    block 0  row n:  rows <= n                -
    block b  row n:  rows <= n + offset       row n of blocks 1..b (its own chain)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

HEAD_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "max_position_embeddings", "vocab_size", "attention_bias", "hidden_act")
FEATURE = "last decoder layer output, before the final norm"


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


class TargetOut(NamedTuple):
    feats: torch.Tensor  # [batch, seq, hidden] fp32, last layer output before the final norm
    logits: torch.Tensor  # [batch, seq, vocab] fp32


class Target:
    """The frozen target: features and logits of a pass, and the embedding / final norm / LM head the head borrows."""

    def __init__(self, path: Path):
        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.config = self.model.config
        self.embed, self.norm, self.lm_head = self.model.model.embed_tokens, self.model.model.norm, self.model.lm_head
        self._feats: list[torch.Tensor] = []
        # NOTE: HF's output_hidden_states[-1] is taken AFTER the final norm; the contract is the layer output before it.
        self.model.model.layers[-1].register_forward_hook(lambda mod, inp, out: self._feats.append(out))

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, mask: torch.Tensor | None = None,
            positions: torch.Tensor | None = None) -> TargetOut:
        self._feats.clear()
        with autocast():
            logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False).logits
        return TargetOut(self._feats.pop().float(), logits.float())

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(g)).float()  # [batch, seq, vocab]

    def weights_sha256(self) -> str:
        return hashlib.sha256((self.path / "model.safetensors").read_bytes()).hexdigest()


def head_config(target_config, intermediate: int) -> Qwen3Config:
    fields = {k: getattr(target_config, k) for k in HEAD_FIELDS}
    config = Qwen3Config(**fields, intermediate_size=intermediate, num_hidden_layers=1, rope_theta=10000.0,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"  # takes the boolean block masks; eager expects additive ones
    return config


class EagleHead(torch.nn.Module):
    """fc + one Qwen3 decoder layer; parameter names are exactly the checkpoint's tensor names."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.layers = torch.nn.ModuleList([Qwen3DecoderLayer(config, layer_idx=0)])
        self.rotary = Qwen3RotaryEmbedding(config)  # buffers only, not saved

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor, mask: torch.Tensor | None,
                positions: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, feats], dim=-1))  # [batch, seq, hidden]
        return self.layers[0](x, attention_mask=mask, position_ids=positions,
                              position_embeddings=self.rotary(x, positions))

    def init_from(self, target: Target, feat_rms: float) -> None:
        """Attention and norms from the target's last layer (same shapes); fc = [token part, identity on f]."""
        last = target.model.model.layers[-1]
        layer = self.layers[0]
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn"):
            getattr(layer, name).load_state_dict(getattr(last, name).state_dict())
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            torch.nn.init.normal_(proj.weight, std=0.02)
        h = self.config.hidden_size
        # NOTE: the embedding's rms (~0.06) is ~30x the feature's (~1.8) smaller; scale the token half so the token
        # adds about half the feature's magnitude at the start, else the layer barely sees which token came.
        embed_rms = target.embed.weight.pow(2).mean().sqrt().item()
        with torch.no_grad():
            self.fc.weight[:, :h].normal_(std=0.5 * feat_rms / (embed_rms * h**0.5))
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.bias.zero_()


def block_mask(rows: int, blocks: int, offset: int) -> torch.Tensor:
    """[1, 1, L, L] boolean (True = attend), L = rows * (blocks + 1); see the module docstring."""
    i = torch.arange(rows)
    causal = i[None, :] <= i[:, None]  # [rows, rows]
    ahead = i[None, :] <= i[:, None] + offset
    diag = torch.eye(rows, dtype=torch.bool)
    n = rows * (blocks + 1)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:rows, :rows] = causal
    for b in range(1, blocks + 1):
        r = slice(b * rows, (b + 1) * rows)
        mask[r, :rows] = ahead
        for b2 in range(1, b + 1):
            mask[r, b2 * rows : (b2 + 1) * rows] = diag
    return mask[None, None]


def block_positions(rows: int, blocks: int, offset: int) -> torch.Tensor:
    """[1, L] RoPE positions: row n of block 0 sits at n, of block b >= 1 at n + offset + b."""
    i = torch.arange(rows)
    return torch.cat([i] + [i + offset + b for b in range(1, blocks + 1)])[None]


def shift_left(x: torch.Tensor, by: int, fill: int = 0) -> torch.Tensor:
    """x[:, by:] padded at the end to x's length: row n gets the item of row n + by."""
    if by == 0:
        return x
    pad = torch.full((x.size(0), by), fill, dtype=x.dtype)
    return torch.cat([x[:, by:], pad], dim=1)


def unroll(head: EagleHead, target: Target, tokens: torch.Tensor, feats: torch.Tensor, steps: int,
           next_tokens=None) -> list[torch.Tensor]:
    """Outputs g of ``steps`` draft steps for every start row: a list of [batch, rows, hidden].

    ``tokens`` [batch, rows] are t_{n+1}, ``feats`` [batch, rows, hidden] are f_n. Step s >= 2 reads the previous
    step's g and ``next_tokens(s, g_prev)`` (default: the teacher's tokens shifted, as in training).
    """
    rows = tokens.size(1)
    embeds, inputs, outs, tok, feat = [], [], [], tokens, feats
    for s in range(steps):
        embeds.append(target.embed(tok))
        inputs.append(feat)
        mask = block_mask(rows, s, offset=0) if s else None  # None: plain causal (sdpa is_causal)
        g = head(torch.cat(embeds, 1), torch.cat(inputs, 1), mask, block_positions(rows, s, 0))  # [b, rows*(s+1), h]
        outs.append(g[:, -rows:])
        tok = next_tokens(s + 1, outs[-1]) if next_tokens else shift_left(tokens, s + 1)
        feat = outs[-1]
    return outs


def soft_ce(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """H(target, draft) per position, whose gradient is KL(target || draft)'s."""
    vocab = logits.size(-1)
    return F.cross_entropy(logits.reshape(-1, vocab), probs.reshape(-1, vocab))


def save_head(head: EagleHead, target: Target, out: Path, sha256: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in head.named_parameters()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = head.config
    config = {"architectures": ["StrataEagleHead"], "model_type": "strata_eagle",
              **{k: getattr(cfg, k) for k in HEAD_FIELDS}, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": 1, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
              "rope_theta": 10000.0, "dtype": "bfloat16",
              "eagle": {"target": target.path.name, "target_weights_sha256": sha256, "feature": FEATURE}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_head(path: Path, target: Target) -> EagleHead:
    """The saved (bfloat16) head in fp32, checked against the target it was trained for."""
    config = json.loads((path / "config.json").read_text())
    head = EagleHead(head_config(target.config, config["intermediate_size"]))
    # NOTE: strict: a missing or extra tensor name is an error naming it (the engine's loader expects exactly these)
    head.load_state_dict({k: v.float() for k, v in load_file(path / "model.safetensors").items()}, strict=True)
    return head.eval()
