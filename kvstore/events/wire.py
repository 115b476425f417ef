"""The KV-event wire format: vLLM's ZeroMQ KV-event stream, byte for byte where msgspec fixes the bytes.

One published message is three ZeroMQ frames:

    [topic (utf-8), sequence number (8 bytes, big-endian, unsigned), payload (msgpack KVEventBatch)]

The payload is what msgspec writes for vLLM's `KVEventBatch`: an array `[ts, events, data_parallel_rank]` whose
events are tagged structs (tag = class name). vLLM has shipped two shapes of the inner events:

- "map" (vLLM >= 0.24, the default): `{"type": "BlockStored", "block_hashes": ..., ...}`, the fields in vLLM's
  declaration order, those without a default always written, the defaulted ones (extra_keys, group_idx, ...) only
  when set (msgspec's omit_defaults). Byte-identical to msgspec's encoding of vLLM's own structs
  (tests/integration/test_events_vllm_compat.py checks it against the module from vLLM's wheel).
- "array" (vLLM <= 0.23, `array_like=True`): `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, ...]`, defaulted trailing fields left out, for consumers of those
  releases (`WireOptions.preset("vllm-0.23")`).

`AllBlocksCleared(medium=...)`, Strata's one-tier clear, adds one key (or trailing element) that msgspec decoders
ignore. Block hashes are msgpack `bin` (Strata's 16-byte hashes; vLLM's `ExternalBlockHash` is `bytes | int`) or,
with `hash_encoding="int"`, the low 64 bits as an unsigned int (vLLM's default form,
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) for consumers that only accept ints. The replay socket's framing is
`replay.py`'s.

Decoding takes every shape vLLM has published, and tolerates what it does not know: an event of an unknown type is
skipped and a field it does not know is ignored, both counted in a `DecodeStats`, never an error (vLLM adds fields
and event types between releases; a router must not stop following a worker for that).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from kvstore.events.replay import END_OF_REPLAY, REPLAY_FRAMINGS, SEQ_BYTES, ReplayFraming, encode_seq
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

TAG_FIELD = "type"  # msgspec's default tag field for map-encoded tagged structs
__all__ = ["END_OF_REPLAY", "SEQ_BYTES", "encode_seq", "decode_seq", "WireOptions", "WIRE_PRESETS", "WireError",
           "DecodeStats", "encode_batch", "decode_batch", "decode_event"]


class WireError(ValueError):
    """A payload is not a KV-event batch in either of vLLM's shapes."""


@dataclass(frozen=True)
class WireOptions:
    """How a publisher encodes batches and frames replays (decoding accepts every shape and both framings).

    The default is current vLLM's (>= 0.26): map events, replies `[topic, seq, payload]`. `preset(name)` gives the
    shapes of older releases for consumers that still run them.
    """

    format: WireFormat = "map"
    hash_encoding: HashEncoding = "bytes"
    replay: ReplayFraming = "topic"

    def __post_init__(self) -> None:
        if self.format not in ("array", "map"):
            raise ValueError(f"wire format must be 'array' or 'map', got {self.format!r}")
        if self.hash_encoding not in ("bytes", "int"):
            raise ValueError(f"hash_encoding must be 'bytes' or 'int', got {self.hash_encoding!r}")
        if self.replay not in REPLAY_FRAMINGS:
            raise ValueError(f"replay framing must be one of {REPLAY_FRAMINGS}, got {self.replay!r}")

    @classmethod
    def preset(cls, name: str) -> "WireOptions":
        """The options a consumer of that vLLM release reads (`--kv-events-format`)."""
        try:
            return WIRE_PRESETS[name]
        except KeyError:
            raise ValueError(f"KV-event format must be one of {sorted(WIRE_PRESETS)}, got {name!r}") from None


WIRE_PRESETS: dict[str, WireOptions] = {
    "vllm": WireOptions(),                                        # vLLM >= 0.26
    "vllm-0.25": WireOptions("map", replay="bare"),               # vLLM 0.24 - 0.25
    "vllm-0.23": WireOptions("array", replay="bare"),             # vLLM <= 0.23
}


@dataclass
class DecodeStats:
    """What decoding skipped: events of a type it does not know, fields it does not know (by name; "#i" for an
    array event's i-th unknown trailing element)."""

    unknown_events: Counter = field(default_factory=Counter)
    unknown_fields: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.unknown_events.values()) + sum(self.unknown_fields.values())


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


# vLLM's fields in declaration order (vllm/distributed/kv_events.py, 0.34): (name, has a default in vLLM's struct).
# A field without a default is always written (nil included); a defaulted one only when set (omit_defaults).
# `AllBlocksCleared.medium` is Strata's: vLLM's struct has no field, its decoders ignore the key.
_SCHEMA: dict[str, tuple[tuple[str, bool], ...]] = {
    "BlockStored": (("block_hashes", False), ("parent_block_hash", False), ("token_ids", False),
                    ("block_size", False), ("lora_id", False), ("medium", False), ("lora_name", False),
                    ("extra_keys", True), ("group_idx", True), ("kv_cache_spec_kind", True),
                    ("kv_cache_spec_sliding_window", True), ("locality", True), ("ownership", True),
                    ("session_id", True), ("lookahead_token_ids", True)),
    "BlockRemoved": (("block_hashes", False), ("medium", False), ("group_idx", True), ("locality", True),
                     ("ownership", True)),
    "AllBlocksCleared": (("medium", True),),
}
_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}
# What Strata keeps of each event (the dataclass fields); vLLM's other fields are decoded and dropped.
_KEPT = {tag: frozenset(f for f in cls.__dataclass_fields__) for tag, cls in _TYPES.items()}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}  # what decoding insists on (leniently)


def _event_fields(event: KVEvent, enc: HashEncoding) -> tuple[str, list[tuple[str, Any, bool]]]:
    """(tag, [(name, value, has_default)]) in vLLM's declaration order, for every field Strata's type carries."""
    tag = type(event).__name__
    if tag not in _TYPES or not isinstance(event, _TYPES[tag]):
        raise TypeError(f"not a KV event: {tag}")
    values = {name: getattr(event, name) for name in _KEPT[tag]}
    if "block_hashes" in values:
        values["block_hashes"] = [_wire_hash(h, enc) for h in values["block_hashes"]]
    if values.get("parent_block_hash") is not None:
        values["parent_block_hash"] = _wire_hash(values["parent_block_hash"], enc)
    if "token_ids" in values:
        values["token_ids"] = list(values["token_ids"])
    return tag, [(name, values.get(name), default) for name, default in _SCHEMA[tag]]


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def _map_header(n: int, declared: int) -> bytes:
    """msgspec sizes a struct's map header by the fields it declares (tag included), not by those it writes: a
    struct of more than 15 (vLLM's BlockStored: 15 fields + the tag) always gets a map16 header."""
    return bytes([0x80 | n]) if declared < 16 else b"\xde" + n.to_bytes(2, "big")


def _encode_event(event: KVEvent, opts: WireOptions) -> bytes:
    """msgspec's encoding of the event: a map of the set fields, or (array_like) an array cut after the last
    field that is required or set."""
    tag, fields = _event_fields(event, opts.hash_encoding)
    if opts.format == "map":
        written = [(name, v) for name, v, default in fields if not default or v is not None]
        header = _map_header(len(written) + 1, len(_SCHEMA[tag]) + 1)
        return header + b"".join(_pack(k) + _pack(v) for k, v in [(TAG_FIELD, tag), *written])
    last = max((i for i, (_, v, default) in enumerate(fields) if not default or v is not None), default=-1)
    return _pack([tag, *(v for _, v, _ in fields[:last + 1])])


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def encode_batch(batch: KVEventBatch, opts: WireOptions = WireOptions()) -> bytes:
    """The msgpack payload of one batch: `[ts, [event, ...], data_parallel_rank]` (array-like in both formats, as
    in vLLM), byte for byte what msgspec writes for vLLM's structs."""
    events = [_encode_event(e, opts) for e in batch.events]
    return b"".join([_array_header(3), _pack(float(batch.ts)), _array_header(len(events)), *events,
                     _pack(batch.data_parallel_rank)])


# ---------------------------------------------------------------------------------------------------------- decode

def _event_values(raw: Any, stats: DecodeStats) -> tuple[str, dict[str, Any]] | None:
    """(tag, {field: value}) of a tagged array or map; None for an event type we do not know (counted)."""
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag, values = raw[0], list(raw[1:])
        if tag not in _SCHEMA:
            stats.unknown_events[tag] += 1
            return None
        names = [name for name, _ in _SCHEMA[tag]]
        for i in range(len(names), len(values)):  # trailing elements a later release added
            stats.unknown_fields[f"{tag}#{i}"] += 1
        return tag, dict(zip(names, values))
    if isinstance(raw, dict) and isinstance(raw.get(TAG_FIELD), str):
        tag = raw[TAG_FIELD]
        if tag not in _SCHEMA:
            stats.unknown_events[tag] += 1
            return None
        known = {name for name, _ in _SCHEMA[tag]}
        for name in raw:
            if name != TAG_FIELD and name not in known:
                stats.unknown_fields[f"{tag}.{name}"] += 1
        return tag, {n: v for n, v in raw.items() if n in known}
    raise WireError(f"an event must be a tagged array or a tagged map, got {type(raw).__name__}")


def _check(tag: str, values: dict[str, Any]) -> None:
    required = [name for name, _ in _SCHEMA[tag]][:_REQUIRED[tag]]
    missing = [n for n in required if n not in values]
    if missing:
        raise WireError(f"{tag} lacks {missing}")
    for name in ("block_hashes", "token_ids"):
        if name in values and not isinstance(values[name], list):
            raise WireError(f"{tag}: {name} must be an array, got {type(values[name]).__name__}")
    for name, kinds in (("medium", str), ("lora_name", str), ("extra_keys", list)):
        if not isinstance(values.get(name), (kinds, type(None))):
            raise WireError(f"{tag}: {name} must be a {kinds.__name__} or nil, got {values[name]!r}")
    for name in ("block_size", "group_idx", "lora_id"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise WireError(f"{tag}: {name} must be an integer, got {value!r}")
    if tag == "BlockStored" and values["block_size"] is None:
        raise WireError("BlockStored: block_size must be an integer, got None")


def decode_event(raw: Any, stats: DecodeStats | None = None) -> KVEvent | None:
    """One event; None for an event type we do not know (counted in `stats`)."""
    got = _event_values(raw, stats if stats is not None else DecodeStats())
    if got is None:
        return None
    tag, values = got
    _check(tag, values)
    return _TYPES[tag](**{n: v for n, v in values.items() if n in _KEPT[tag]})


def decode_batch(payload: bytes, stats: DecodeStats | None = None) -> KVEventBatch:
    """Decode one payload in any shape vLLM has published (array or map events; array or map batch). Events and
    fields we do not know are skipped and counted in `stats`; a payload that is not a batch is a WireError."""
    stats = stats if stats is not None else DecodeStats()
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
        events = [e for e in (decode_event(raw, stats) for raw in body[1]) if e is not None]
    except TypeError as exc:  # a field of the wrong kind
        raise WireError(f"malformed event: {exc}") from exc
    return KVEventBatch(ts=float(body[0]), events=events, data_parallel_rank=rank)
