"""ZeroMQ KV-event subscriber: SUB for the live stream, DEALER for replays, gap detection in between.

The subscriber tracks the last sequence number it delivered. A live batch further ahead means batches were lost
(the subscriber joined late, or a ZeroMQ high-water mark dropped them): it asks the publisher's replay socket for
everything from the first missing number, delivers the replayed batches in order, then the live one. What the replay
cannot supply (the publisher's buffer already rolled over, no replay socket, replay timed out) is reported as
`lost_before` on the next delivered batch, so the caller (the router's index) can drop that worker's state and
rebuild it rather than trust a hole. With `snapshots=True` the subscriber first asks the replay socket for a snapshot
(`snapshot.py`, a Strata publisher's holdings as of a sequence number) and delivers it as one `ReceivedBatch` with
`snapshot` set: the caller replaces the publisher's state with it, and the batches after it apply on top.

    live seq 42 after 17:  replay(18..) ──covers 18..41──> deliver 18..41, then 42
                                        └─buffer starts at 30─> snapshot(next_seq=43) ──> deliver it; 42 is in it
                                                               └─refused / timed out──> 30..41 with lost_before=12

Not thread-safe: one thread owns a subscriber (ZeroMQ sockets belong to one thread).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterator, NamedTuple

import zmq

from kvstore.events.publisher import DEFAULT_TOPIC
from kvstore.events.snapshot import SNAPSHOT_REPLY, SNAPSHOT_REQUEST, Snapshot, decode_snapshot
from kvstore.events.types import KVEventBatch
from kvstore.events.replay import encode_seq, parse_reply
from kvstore.events.wire import DecodeStats, WireError, decode_batch, decode_seq

log = logging.getLogger(__name__)


class ReceivedBatch(NamedTuple):
    """One delivered batch. `lost_before` counts sequence numbers before `seq` that could not be recovered."""

    seq: int
    batch: KVEventBatch
    topic: str
    replayed: bool = False
    lost_before: int = 0
    publisher_restarted: bool = False  # the sequence went back: state learned from this publisher is stale
    snapshot: Snapshot | None = None  # set: replace the publisher's state with it (`batch` is empty; `seq` is the
    #                                   last number it covers)


class ZmqEventSubscriber:
    """Receives batches in sequence order, replaying gaps.

    `from_seq` is the first sequence number the caller wants: 0 asks for the whole history the publisher still
    buffers (a late joiner catches up through replay); None starts at whatever arrives first. `snapshots=True`
    loads a snapshot where the replay cannot cover a gap (only a caller that handles `ReceivedBatch.snapshot`).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = DEFAULT_TOPIC,
        from_seq: int | None = None,
        replay_timeout_s: float = 2.0,
        rcvhwm: int = 100_000,
        context: zmq.Context | None = None,
        snapshots: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.snapshots = snapshots
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.last_seq = -1 if from_seq is None else from_seq - 1
        self._started = from_seq is not None
        self._live_high = -1  # the highest number seen on the live stream
        self._undecodable = 0  # batches dropped as undecodable since the last delivery
        self._ctx = context or zmq.Context.instance()
        self._pending: deque[ReceivedBatch] = deque()
        self.gaps_detected = 0
        self.replays_requested = 0
        self.batches_lost = 0
        self.publisher_restarts = 0
        self._restart_unreported = False
        self.decode_errors = 0
        self.decode_stats = DecodeStats()  # events and fields of kinds we do not know, skipped (never an error)
        self.snapshots_loaded = 0
        self.snapshots_refused = 0  # refused, timed out or malformed: the gap was reported as lost instead
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        self._last_topic = topic

    # ------------------------------------------------------------------------------------------------ public API

    def recv(self, timeout_s: float | None = None) -> ReceivedBatch | None:
        """The next batch in sequence order, or None if none arrived within `timeout_s` (None waits forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sub.poll(None if left is None else int(left * 1000)):
                return None
            self._on_live(*self._sub.recv_multipart())
        return self._pending.popleft()

    def catch_up(self) -> int:
        """Ask the replay socket for anything published after the last delivered batch; how many were queued.

        A gap is only visible when a later batch arrives, so batches lost at the tail of a burst stay unseen
        while the publisher is quiet. A consumer that needs an up-to-date view calls this when idle.
        """
        if self.replay_endpoint is None or not self._started:
            return 0
        before = len(self._pending)
        self._recover(None, self._last_topic)
        return len(self._pending) - before

    def __iter__(self) -> Iterator[ReceivedBatch]:
        while True:
            item = self.recv()
            if item is not None:
                yield item

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> "ZmqEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------------- live stream

    def _on_live(self, *frames: bytes) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("ignoring a message that is not [topic, 8-byte seq, payload] (%d frames)", len(frames))
            return
        topic, seq = frames[0].decode(errors="replace"), decode_seq(frames[1])
        self._last_topic = topic
        if not self._started:
            self._started, self.last_seq = True, seq - 1
        if seq <= self._live_high:
            # NOTE: a publisher's live numbers only go up: going back means it restarted and counts from 0 again.
            self.publisher_restarts += 1
            self.last_seq = -1
            self._restart_unreported = True
        self._live_high = seq
        if seq <= self.last_seq:
            return  # delivered already by a replay (catch_up), or older than the `from_seq` asked for
        lost = 0
        if seq > self.last_seq + 1:
            self.gaps_detected += 1
            lost = self._replay_until(seq, topic)
            if seq <= self.last_seq:
                return  # a snapshot covers it
        self._deliver(seq, frames[2], topic, replayed=False, lost_before=lost)

    def _deliver(self, seq: int, payload: bytes, topic: str, *, replayed: bool, lost_before: int) -> None:
        try:
            batch = decode_batch(payload, self.decode_stats)
        except WireError:
            # NOTE: an undecodable batch is a lost batch: report it on the next one rather than stall the stream.
            self.decode_errors += 1
            self._undecodable += 1
            log.exception("undecodable KV-event batch seq=%d", seq)
            self.last_seq = seq
            return
        lost_before += self._undecodable
        self._pending.append(ReceivedBatch(seq, batch, topic, replayed, lost_before, self._restart_unreported))
        self._restart_unreported, self._undecodable = False, 0
        self.last_seq = seq

    # ------------------------------------------------------------------------------------------------- replays

    def _replay_until(self, live_seq: int, topic: str) -> int:
        """Replay (last_seq, live_seq) into the pending queue; how many of those numbers stay lost."""
        self._recover(live_seq, topic)
        lost = max(0, live_seq - (self.last_seq + 1))
        self.batches_lost += lost
        return lost

    def _recover(self, until: int | None, topic: str) -> None:
        """Deliver what the replay socket buffers after the last delivered batch (before `until`, when given),
        preceded by a snapshot when `snapshots` is on and the buffer no longer reaches back that far.

            last_seq  first                        until
               |  |<-- hole -->|<-- replayed -->|
        """
        if self.replay_endpoint is None:
            return
        first = self.last_seq + 1
        self.replays_requested += 1
        got, complete = self._request_replay(first)
        got = [(seq, p) for seq, p in got if seq >= first and (until is None or seq < until)]
        hole_end = got[0][0] if got else (first if until is None else until)
        if hole_end > first and complete and self.snapshots:
            self._load_snapshot(topic)
        for seq, payload in got:
            if seq > self.last_seq:
                lost = seq - (self.last_seq + 1)
                self.batches_lost += lost
                self._deliver(seq, payload, topic, replayed=True, lost_before=lost)

    def _load_snapshot(self, topic: str) -> None:
        snapshot = self._request_snapshot()
        if snapshot is None or snapshot.next_seq <= self.last_seq + 1:
            self.snapshots_refused += 1  # (a snapshot no newer than what was delivered is no use either)
            return
        self.snapshots_loaded += 1
        self.last_seq = snapshot.next_seq - 1
        self._pending.append(ReceivedBatch(self.last_seq, KVEventBatch(time.time(), []), topic, True, 0,
                                           self._restart_unreported, snapshot))
        self._restart_unreported, self._undecodable = False, 0

    def _request_replay(self, start_seq: int) -> tuple[list[tuple[int, bytes]], bool]:
        """Every (seq, payload) the publisher buffers from `start_seq`, and whether the end marker came (False: what
        came before a timeout). Replies in either of vLLM's framings (`replay.py`) are read."""
        sock = self._replay_socket()
        sock.send_multipart((b"", encode_seq(start_seq)))  # the empty delimiter makes it look like a REQ
        got: list[tuple[int, bytes]] = []
        for frames in self._replies(f"replay from seq {start_seq}"):
            reply = parse_reply(frames)
            if reply.kind == "end":
                return got, True
            if reply.kind == "batch":
                got.append((reply.seq, reply.payload))
        return got, False

    def _request_snapshot(self) -> Snapshot | None:
        """The publisher's snapshot; None when it refuses (a vLLM publisher answers only an end-of-replay marker),
        does not answer in time (an older Strata publisher ignores the request) or sends a malformed one."""
        self._replay_socket().send_multipart((b"", SNAPSHOT_REQUEST))
        for frames in self._replies("snapshot request"):
            if parse_reply(frames).kind == "end":
                log.info("%s does not serve snapshots: the gap is reported as lost", self.replay_endpoint)
                return None
            if len(frames) == 3 and frames[1] == SNAPSHOT_REPLY:
                try:
                    return decode_snapshot(frames[2])
                except WireError:
                    log.exception("malformed snapshot from %s", self.replay_endpoint)
                    return None
        return None

    def _replies(self, what: str) -> Iterator[list[bytes]]:
        """Messages on the replay socket until the caller stops or `replay_timeout_s` passes since the request."""
        sock = self._replay_socket()
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                log.warning("%s to %s timed out", what, self.replay_endpoint)
                self._drop_replay_socket()  # late replies must not leak into the next request
                return
            yield sock.recv_multipart()

    def _replay_socket(self) -> zmq.Socket:
        if self._replay is None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.RCVHWM, 0)  # a replay can be a whole buffer; never drop part of it
            self._replay.connect(self.replay_endpoint)
        return self._replay

    def _drop_replay_socket(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
