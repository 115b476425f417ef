"""Snapshots on the replay socket: Strata's extension of vLLM's replay protocol (DESIGN §6).

vLLM's replay request is `[identity, b"", start_seq (8 bytes)]`. A snapshot request is the same three frames with a
third frame that is not 8 bytes long, so no publisher mistakes one for the other:

    ROUTER  <- [identity, b"", SNAPSHOT_REQUEST]
            -> [identity, b"", SNAPSHOT_REPLY, payload]       payload: msgpack [next_seq, [[medium, [hash, ...]], ...]]

`next_seq` is the first sequence number the snapshot does not include: it holds the effect of every batch before it,
so a subscriber replaces the publisher's state with it and applies live batches from `next_seq` on. A vLLM
publisher reads the request as a replay from a sequence number beyond 2**64 and answers only its end-of-replay
marker; an older Strata publisher ignores it (the request times out). Either way the subscriber falls back to
forgetting the publisher's state, as it did before snapshots.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

import msgpack

from kvstore.events.types import ExternalBlockHash
from kvstore.events.wire import SEQ_BYTES, HashEncoding, WireError, _wire_hash

SNAPSHOT_REQUEST = b"strata:snapshot:v1"
SNAPSHOT_REPLY = SNAPSHOT_REQUEST
MAX_SNAPSHOT_BYTES = 1 << 30  # 4 M blocks of 16-byte hashes take ~80 MB; past 1 GiB the reply is not ours
assert len(SNAPSHOT_REQUEST) != SEQ_BYTES  # NOTE: what keeps it apart from a replay request


class Snapshot(NamedTuple):
    """A publisher's holdings as of `next_seq`: (medium, hashes) per medium."""

    next_seq: int
    tiers: tuple[tuple[str | None, tuple[ExternalBlockHash, ...]], ...]

    def blocks(self) -> Iterator[tuple[ExternalBlockHash, str | None]]:
        """(hash, medium) pairs, the shape `PrefixIndex.load_snapshot` takes."""
        for medium, hashes in self.tiers:
            for h in hashes:
                yield h, medium

    def __len__(self) -> int:  # type: ignore[override]  # the number of (hash, medium) entries
        return sum(len(hashes) for _, hashes in self.tiers)


def encode_snapshot(next_seq: int, tiers: Sequence[tuple[str | None, Sequence[ExternalBlockHash]]],
                    hash_encoding: HashEncoding = "bytes") -> bytes:
    """The reply payload; hashes go out the way the publisher's batches send them (`hash_encoding`)."""
    body = [next_seq, [[medium, [_wire_hash(h, hash_encoding) for h in hashes]] for medium, hashes in tiers]]
    return msgpack.packb(body, use_bin_type=True)


def decode_snapshot(payload: bytes) -> Snapshot:
    """WireError for anything that is not a snapshot payload."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except ValueError as exc:  # every msgpack unpack error is a ValueError
        raise WireError(f"snapshot is not msgpack: {exc}") from exc
    if not (isinstance(body, list) and len(body) == 2 and _is_seq(body[0]) and isinstance(body[1], list)):
        raise WireError("a snapshot must be [next_seq, [[medium, [hash, ...]], ...]]")
    return Snapshot(body[0], tuple(_tier(t) for t in body[1]))


def _is_seq(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64


def _tier(raw: Any) -> tuple[str | None, tuple[ExternalBlockHash, ...]]:
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], (str, type(None)))
            and isinstance(raw[1], list)):
        raise WireError("a snapshot tier must be [medium (string or nil), [hash, ...]]")
    if not all(isinstance(h, (bytes, int)) and not isinstance(h, bool) for h in raw[1]):
        raise WireError("snapshot hashes must be binary or integers")
    return raw[0], tuple(raw[1])
