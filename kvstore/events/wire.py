"""The KV-event wire format: vLLM's ZeroMQ KV-event stream, byte for byte where msgspec fixes the bytes.

One published message is three ZeroMQ frames:

    [topic (utf-8), sequence number (8 bytes, big-endian, unsigned), payload (msgpack KVEventBatch)]

The payload is what msgspec writes for vLLM's `KVEventBatch`: an array `[ts, events, data_parallel_rank]` whose
events are tagged structs (tag = class name). vLLM has shipped two shapes of the inner events, and both are
decoded by the routers that consume vLLM (Dynamo, llm-d, SGLang's router):

- "array" (vLLM through 0.23, `array_like=True`): `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`
  (`["AllBlocksCleared", medium]` for Strata's one-tier clear: a trailing element msgspec decoders ignore).
  msgspec decoders ignore trailing elements they do not know, and every later vLLM field after `lora_name` has a
  default, so this one shape decodes under every array-era schema (we send `lora_name` as nil for that reason).
- "map" (vLLM after PR #42892, `array_like` dropped from the events): `{"type": "BlockStored", "block_hashes": ...}`.

Block hashes are msgpack `bin` (Strata's 16-byte hashes; vLLM's `ExternalBlockHash` is `bytes | int`) or, with
`hash_encoding="int"`, the low 64 bits as an unsigned int (vLLM's default form,
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) for consumers that only accept ints. Replies on the replay socket are `[seq (8 bytes), payload]`; the end
of a replay is `[-1 as 8 signed big-endian bytes, b""]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from kvstore.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)

WireFormat = Literal["array", "map"]
HashEncoding = Literal["bytes", "int"]

SEQ_BYTES = 8
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
TAG_FIELD = "type"  # msgspec's default tag field for map-encoded tagged structs


class WireError(ValueError):
    """A payload is not a KV-event batch in either of vLLM's shapes."""


@dataclass(frozen=True)
class WireOptions:
    """How a publisher encodes batches (decoding accepts every shape)."""

    format: WireFormat = "array"
    hash_encoding: HashEncoding = "bytes"

    def __post_init__(self) -> None:
        if self.format not in ("array", "map"):
            raise ValueError(f"wire format must be 'array' or 'map', got {self.format!r}")
        if self.hash_encoding not in ("bytes", "int"):
            raise ValueError(f"hash_encoding must be 'bytes' or 'int', got {self.hash_encoding!r}")


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    """Sequence number of a frame; -1 for the end-of-replay marker."""
    if len(frame) != SEQ_BYTES:
        raise WireError(f"sequence frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return -1 if frame == END_OF_REPLAY else int.from_bytes(frame, "big")


# ---------------------------------------------------------------------------------------------------------- encode

def _wire_hash(h: ExternalBlockHash, encoding: HashEncoding) -> ExternalBlockHash:
    if encoding == "int" and isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h[-8:], "big")  # the low 64 bits, as vLLM folds its digests
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h


def _event_fields(event: KVEvent, enc: HashEncoding) -> tuple[str, list[tuple[str, Any]]]:
    """(tag, fields) in vLLM's declaration order. All are fields without a default in vLLM's schema, so msgspec
    writes them even when nil; vLLM's later, defaulted fields (extra_keys, group_idx, ...) are left out, which is
    what its omit_defaults does with their default values."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else _wire_hash(event.parent_block_hash, enc)
        required = [("block_hashes", [_wire_hash(h, enc) for h in event.block_hashes]),
                    ("parent_block_hash", parent), ("token_ids", list(event.token_ids)),
                    ("block_size", event.block_size), ("lora_id", event.lora_id), ("medium", event.medium),
                    ("lora_name", None)]
        return "BlockStored", required
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [("block_hashes", [_wire_hash(h, enc) for h in event.block_hashes]),
                                ("medium", event.medium)]
    if isinstance(event, AllBlocksCleared):
        # NOTE: vLLM's AllBlocksCleared has no field: `medium` is written only when set (see types.py)
        return "AllBlocksCleared", [] if event.medium is None else [("medium", event.medium)]
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _encode_event(event: KVEvent, opts: WireOptions) -> list | dict:
    tag, fields = _event_fields(event, opts.hash_encoding)
    if opts.format == "array":
        return [tag, *(value for _, value in fields)]
    return {TAG_FIELD: tag, **dict(fields)}


def encode_batch(batch: KVEventBatch, opts: WireOptions = WireOptions()) -> bytes:
    """The msgpack payload of one batch (the outer batch is array-like in both formats, as in vLLM)."""
    body = [float(batch.ts), [_encode_event(e, opts) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


# ---------------------------------------------------------------------------------------------------------- decode

_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": ("medium",),
}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _event_values(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        names = _FIELDS.get(tag)
        if names is None:
            raise WireError(f"unknown event tag {tag!r}")
        if len(values) < _REQUIRED[tag]:
            raise WireError(f"{tag} needs at least {_REQUIRED[tag]} fields, got {len(values)}")
        return tag, dict(zip(names, values))  # trailing fields we do not know are ignored, like msgspec
    if isinstance(raw, dict) and isinstance(raw.get(TAG_FIELD), str):
        tag = raw[TAG_FIELD]
        if tag not in _FIELDS:
            raise WireError(f"unknown event tag {tag!r}")
        missing = [n for n in _FIELDS[tag][:_REQUIRED[tag]] if n not in raw]
        if missing:
            raise WireError(f"{tag} lacks {missing}")
        return tag, {n: raw[n] for n in _FIELDS[tag] if n in raw}
    raise WireError(f"an event must be a tagged array or a tagged map, got {type(raw).__name__}")


def decode_event(raw: Any) -> KVEvent:
    tag, values = _event_values(raw)
    lists = {"BlockStored": ("block_hashes", "token_ids"), "BlockRemoved": ("block_hashes",)}.get(tag, ())
    if any(not isinstance(values[name], list) for name in lists):
        raise WireError(f"{tag}: {', '.join(lists)} must be arrays")
    if tag == "BlockStored" and not isinstance(values["block_size"], int):
        raise WireError(f"BlockStored: block_size must be an integer, got {values['block_size']!r}")
    if not isinstance(values.get("medium"), (str, type(None))):
        raise WireError(f"{tag}: medium must be a string or nil, got {values['medium']!r}")
    return _TYPES[tag](**values)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload in any shape vLLM has published (array or map events; array or map batch)."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except ValueError as exc:  # every msgpack unpack error is a ValueError
        raise WireError(f"payload is not msgpack: {exc}") from exc
    if isinstance(body, dict):  # a map-encoded batch: no vLLM release sends one, but it costs nothing to accept
        body = [body.get("ts"), body.get("events"), body.get("data_parallel_rank")]
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[0], (int, float)) \
            or not isinstance(body[1], list):
        raise WireError("a batch must be [ts, events, data_parallel_rank?]")
    rank = body[2] if len(body) > 2 else None
    try:
        events = [decode_event(e) for e in body[1]]
    except TypeError as exc:  # a field of the wrong kind
        raise WireError(f"malformed event: {exc}") from exc
    return KVEventBatch(ts=float(body[0]), events=events, data_parallel_rank=rank)
