"""`eagle`: a draft head that reads the target's features (EAGLE, Li et al. 2024). For position i it takes the
target's last hidden state f_i (before the final norm) and the next token's embedding (the target's own), and one
decoder layer predicts the next feature; the target's final norm and LM head turn a feature into draft logits:

    g_i = layer(fc([embed(t_{i+1}), f_i]))      (causal attention over the head's own positions 0..i)
    draft logits for t_{i+2} = lm_head(norm(g_i))

Drafting after the target verified up to position n (t_{n+1} sampled): g_n from (t_{n+1}, f_n) gives d_1; then
(d_1, g_n) gives g_{n+1} and d_2, and so on: the head's own features stand in for the target's. The head's KV lives
in its own one-layer paged cache (draft_kv.ShadowSequences; the shadow's token at position i is t_{i+1}). Features
arrive after every target step for the verified positions (`observe`); positions the target did not compute here
(a prefix-cache hit, or a prompt prefilled on another worker) have no feature and enter the head as zeros: the
drafts are worse there, never wrong (verification decides).

The checkpoint (models/strata-eagle-tiny): config.json with `architectures: ["StrataEagleHead"]` and Qwen3 layer
fields; tensors `fc.weight [H, 2H]`, `fc.bias [H]` and one Qwen3 decoder layer under `layers.0.` (HF names).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from engine.attention.backend import get_attention_backend
from engine.batch import StepBatch
from engine.kv_cache import KVCache
from engine.loader import SafetensorsReader, torch_dtype
from engine.checkpoint import weight_files
from engine.models.decoder import CausalLM, DecoderLayer
from engine.models.errors import ConfigFieldError
from engine.models.rope import RotaryTable
from engine.models.spec import ModelSpec, parse_spec
from engine.models.weights import load_weights
from engine.spec.draft_kv import DraftDraw, DraftRun, ShadowSequences
from engine.spec.drafter import DraftInput, Drafter, Proposal, StepFeatures

ARCHITECTURE = "StrataEagleHead"


class _Layers(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(spec, 0, dtype, device, "local")])


class _HFNames:
    """The head's tensors under the names `load_weights` asks for (`model.layers.0.*` -> `layers.0.*`)."""

    def __init__(self, reader: SafetensorsReader) -> None:
        self.reader = reader

    def shape(self, name: str):
        return self.reader.shape(name.removeprefix("model."))

    def get(self, name: str) -> torch.Tensor:
        return self.reader.get(name.removeprefix("model."))

    def file_of(self, name: str) -> str:
        return self.reader.file_of(name.removeprefix("model."))


class EagleHead(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=True, dtype=dtype, device=device)
        self.body = _Layers(spec, dtype, device)
        self.rotary = RotaryTable(spec.rope, spec.head_dim, spec.max_position_embeddings, device, dtype)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend, cache, meta) -> torch.Tensor:
        """Predicted next features `[T, H]` from token embeddings and features `[T, H]` each."""
        x = self.fc(torch.cat([embeds, features], dim=-1))                             # [T, H]
        return self.body.layers[0](x, cos, sin, backend, cache, meta)                  # [T, H]


def _check_target(config: dict, config_path: Path, target_folder: str | Path | None) -> None:
    """A head trained for one target's features is noise on another's: refuse when the head names the target's
    weights (`eagle.target_weights_sha256`, sha256 of its safetensors bytes in file order) and they differ."""
    expected = (config.get("eagle") or {}).get("target_weights_sha256")
    if not expected or target_folder is None:
        return
    digest = hashlib.sha256()
    for path in weight_files(Path(target_folder)):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ConfigFieldError(f"{config_path}: eagle.target_weights_sha256 names other target weights than "
                               f"{target_folder}: this head was trained for {config['eagle'].get('target')!r}; "
                               f"pass an EAGLE head trained for this model (--speculative-model) or use another "
                               f"drafter")


def load_eagle_head(folder: str | Path, target: CausalLM, dtype: str, device: str,
                    target_folder: str | Path | None = None) -> EagleHead:
    """Read a head checkpoint and check it fits `target` (hidden size, vocabulary, and the very weights it was
    trained on when the head names them)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigFieldError(f"{config_path}: missing; an eagle head folder needs config.json and model.safetensors")
    config = json.loads(config_path.read_text())
    if config.get("architectures") != [ARCHITECTURE]:
        raise ConfigFieldError(f"{config_path}: architectures must be [{ARCHITECTURE!r}] for an eagle head, got "
                               f"{config.get('architectures')!r}")
    _check_target(config, config_path, target_folder)
    layer_config = {**config, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1}
    spec = parse_spec(layer_config, str(config_path))
    if spec.hidden_size != target.spec.hidden_size or spec.vocab_size != target.spec.vocab_size:
        raise ConfigFieldError(f"{config_path}: hidden_size={spec.hidden_size}, vocab_size={spec.vocab_size} must "
                               f"equal the target's ({target.spec.hidden_size}, {target.spec.vocab_size})")
    head = EagleHead(spec, torch_dtype(dtype), torch.device(device))
    reader = SafetensorsReader(weight_files(folder))
    try:
        load_weights(head.body, spec, _HFNames(reader), only_layers=True)
        with torch.no_grad():
            head.fc.weight.copy_(reader.get("fc.weight"))
            head.fc.bias.copy_(reader.get("fc.bias"))
    finally:
        reader.close()
    for layer in head.body.layers:
        layer.attn.post_load()
    return head.eval()


class EagleDrafter(Drafter):
    name = "eagle"
    needs_features = True

    def __init__(self, folder: str | Path, target: CausalLM, dtype: str, device: str, num_blocks: int,
                 block_size: int, seed: int = 0, target_folder: str | Path | None = None) -> None:
        self.target = target
        self.head = load_eagle_head(folder, target, dtype, device, target_folder)
        spec = self.head.spec
        self.device, self.dtype, self.block_size = torch.device(device), torch_dtype(dtype), block_size
        self.cache = KVCache(num_blocks, 1, block_size, spec.num_kv_heads, spec.head_dim, self.dtype, self.device)
        self.attention = get_attention_backend("torch")
        self.shadows = ShadowSequences(num_blocks, block_size)
        self.draw = DraftDraw(seed)
        self._features: dict[str, list[tuple[int, torch.Tensor]]] = {}   # request -> (first position, [n, H])
        self._true: dict[str, int] = {}     # request -> leading head positions computed from the target's features

    def observe(self, features: StepFeatures) -> None:
        for rid, start, row, count in zip(features.request_ids, features.starts, features.rows, features.counts):
            if count:
                self._features.setdefault(rid, []).append((start, features.hidden[row:row + count]))

    def release(self, request_id: str) -> None:
        self.shadows.release(request_id)
        self._features.pop(request_id, None)
        self._true.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, inputs: Sequence[DraftInput], seeds: Sequence[int | None]) -> list[Proposal]:
        run = DraftRun(inputs, self.draw)
        active, feats = [], []
        for i, item in enumerate(inputs):
            request = item.request
            rid = request.request_id
            verified = request.num_tokens - 1            # positions 0..n, n = num_tokens - 2, have true features
            # NOTE: positions drafted last time match in tokens but were computed from the head's own features
            shadow = self.shadows.sync(rid, request.token_ids[1:], valid=self._true.get(rid, 0))
            if self.shadows.reserve(shadow, verified + item.num_tokens - 1):
                active.append((i, shadow))
                feats.append(self._take(rid, shadow.num_computed_tokens, verified))
                self._true[rid] = verified
        while active:
            batch = StepBatch([self.shadows.scheduled(shadow) for _, shadow in active])
            predicted = self._forward(batch, torch.cat(feats))                           # [T, H]
            last = torch.tensor([len(s.token_ids) for s in batch.seqs], device=self.device).cumsum(0) - 1
            g = predicted.index_select(0, last)                                          # [B, H]
            keep = run.step(self.target.logits(g), active)                               # logits [B, V]
            # the head's own feature stands in for the target's at the next position
            active, feats = [active[b] for b in keep], [g[b:b + 1] for b in keep]
        return run.proposals()

    def _forward(self, batch: StepBatch, features: torch.Tensor) -> torch.Tensor:
        ids, positions = [], []
        for seq in batch.seqs:
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)             # [T]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)             # [T]
        self.head.rotary.ensure(max(positions) + 1)
        cos, sin = self.head.rotary.lookup_signed(pos)                                   # [T, 1, D]
        meta = self.attention.build_metadata(batch, self.block_size, self.device, self.dtype)
        embeds = self.target.embed(input_ids)                                            # [T, H]
        return self.head(embeds, features.to(embeds.dtype), cos, sin, self.attention, self.cache.layers[0], meta)

    def _take(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Features `[end - start, H]` of positions start..end-1 (zeros where the target computed none), and drop
        the stored ones before `end`."""
        out = torch.zeros(end - start, self.head.spec.hidden_size, dtype=self.dtype, device=self.device)
        kept = []
        for first, rows in self._features.get(request_id, ()):
            lo, hi = max(first, start), min(first + len(rows), end)
            if lo < hi:
                out[lo - start:hi - start] = rows[lo - first:hi - first]
            if first + len(rows) > end:
                kept.append((first, rows))
        self._features[request_id] = kept
        return out
