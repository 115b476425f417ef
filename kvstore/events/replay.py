"""The replay socket's framing: what a publisher's ROUTER answers a replay request with, in both of vLLM's shapes.

A replay request is `[b"", start_seq (8 bytes, big-endian)]` from a DEALER (a REQ socket adds the empty frame
itself); the ROUTER answers every buffered batch from `start_seq` on, then an end marker. vLLM has framed the
answers two ways, and a subscriber reads both (the frames as a DEALER receives them, empty delimiter first):

    "topic" (vLLM >= 0.26, the default):  [b"", topic, seq, payload] ... [b"", b"", END_OF_REPLAY, b""]
    "bare"  (vLLM <= 0.25):               [b"", seq, payload]        ... [b"", END_OF_REPLAY, b""]

Strata's snapshot reply (`snapshot.py`) is `[b"", SNAPSHOT_REPLY, payload]` under either framing: three frames whose
middle one is not 8 bytes long, so no reader mistakes it for a batch.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

ReplayFraming = Literal["topic", "bare"]
REPLAY_FRAMINGS: tuple[str, ...] = ("topic", "bare")

SEQ_BYTES = 8
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def batch_frames(framing: ReplayFraming, topic: bytes, seq: int, payload: bytes) -> tuple[bytes, ...]:
    """One replayed batch, after the ROUTER's [identity, b""]."""
    if framing == "topic":
        return topic, encode_seq(seq), payload
    return encode_seq(seq), payload


def end_frames(framing: ReplayFraming) -> tuple[bytes, ...]:
    """The end-of-replay marker, after the ROUTER's [identity, b""]."""
    return (b"", END_OF_REPLAY, b"") if framing == "topic" else (END_OF_REPLAY, b"")


ReplyKind = Literal["batch", "end", "other"]


class ReplayReply(NamedTuple):
    """One message read on the replay socket. `other`: not a batch or an end marker in either framing (a snapshot
    reply, or garbage); `topic` is None under the bare framing."""

    kind: ReplyKind
    seq: int = -1
    payload: bytes = b""
    topic: bytes | None = None


def parse_reply(frames: Sequence[bytes]) -> ReplayReply:
    """A DEALER's view of one reply (`frames[0]` is the empty delimiter), in either framing."""
    if len(frames) == 3 and len(frames[1]) == SEQ_BYTES:                       # bare
        if frames[1] == END_OF_REPLAY:
            return ReplayReply("end")
        return ReplayReply("batch", int.from_bytes(frames[1], "big"), frames[2])
    if len(frames) == 4 and len(frames[2]) == SEQ_BYTES:                       # topic
        if frames[2] == END_OF_REPLAY:
            return ReplayReply("end")
        return ReplayReply("batch", int.from_bytes(frames[2], "big"), frames[3], frames[1])
    return ReplayReply("other")
