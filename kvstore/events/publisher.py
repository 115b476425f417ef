"""ZeroMQ KV-event publisher: PUB for the live stream, ROUTER for replays, one background thread owning both.

Protocol (vLLM's `ZmqEventPublisher`, so vLLM's own subscriber and the routers that read vLLM work unchanged):

    PUB     -> [topic, seq (8 B big-endian), payload]            one message per batch, seq = 0, 1, 2, ...
    ROUTER  <- [identity, b"", start_seq (8 B big-endian)]        from a REQ socket (or a DEALER sending b"" first)
            -> [identity, b"", topic, seq, payload] for every buffered seq >= start_seq, then
               [identity, b"", b"", END_OF_REPLAY, b""]           (vLLM >= 0.26; `WireOptions.replay="bare"`
                                                                   drops the topic frames, as vLLM <= 0.25 did)
    ROUTER  <- [identity, b"", SNAPSHOT_REQUEST]                  Strata's extension (`snapshot.py`)
            -> [identity, b"", SNAPSHOT_REPLY, snapshot]          the holdings as of the next seq to publish

Strata's own identity goes where that format leaves room: the worker id in the topic (`kv-events/<worker>`, which a
subscriber to the `kv-events` prefix still receives), the tier in each event's `medium`, the data-parallel rank in
the batch.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Sequence

import zmq

from kvstore.events.holdings import DEFAULT_MAX_BLOCKS, Holdings
from kvstore.events.snapshot import SNAPSHOT_REPLY, SNAPSHOT_REQUEST, encode_snapshot
from kvstore.events.types import KVEvent, KVEventBatch
from kvstore.events.replay import SEQ_BYTES, batch_frames, end_frames, encode_seq
from kvstore.events.wire import WireOptions, encode_batch

log = logging.getLogger(__name__)

DEFAULT_TOPIC = "kv-events"
_POLL_S = 0.005  # how long the thread waits for a batch before it looks at the replay socket again
_MAX_REQUEST_BYTES = 64 << 10  # replay and snapshot requests are a few bytes: refuse bigger before allocating


def worker_topic(worker_id: str, base: str = DEFAULT_TOPIC) -> str:
    """The topic a worker publishes on: a SUB subscribed to `base` receives it (ZeroMQ matches topic prefixes)."""
    return f"{base}/{worker_id}" if worker_id else base


class ZmqEventPublisher:
    """Publishes KV-event batches; `publish` is thread-safe and never touches a socket itself.

    `endpoint` and `replay_endpoint` are bound (`tcp://127.0.0.1:*` picks a free port; read the real address from
    `.endpoint` / `.replay_endpoint`). The replay buffer keeps the last `buffer_steps` payloads. `publish` blocks
    only when `max_queue_size` batches are waiting for the thread, which a healthy publisher never reaches.
    With a replay socket the publisher also keeps what it holds per medium (`Holdings`, at most
    `max_snapshot_blocks` entries) and answers snapshot requests from it; `snapshots=False` turns that off.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = DEFAULT_TOPIC,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        wire: WireOptions = WireOptions(),
        context: zmq.Context | None = None,
        snapshots: bool = True,
        max_snapshot_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._wire = wire
        self._topic_bytes = topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._published = threading.Condition()
        self._closed = False
        self._ctx = context or zmq.Context.instance()
        self._pub, self._replay = self._bind(endpoint, replay_endpoint, hwm, buffer_steps)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        # NOTE: owned by the publisher thread, like the sockets: a snapshot it answers matches the seqs it sent
        self._holdings = Holdings(max_snapshot_blocks) if snapshots and self._replay is not None else None
        self.malformed_requests = 0  # replay-socket messages that were neither a replay nor a snapshot request
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _bind(self, endpoint: str, replay_endpoint: str | None, hwm: int,
              buffer_steps: int) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, hwm)
        pub.setsockopt(zmq.LINGER, 0)
        _bind_retrying(pub, endpoint)
        replay = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)  # a peer sending more is disconnected
            # A ROUTER drops what exceeds a peer's HWM: leave room for a whole buffer's replay and its end marker,
            # twice over: the I/O thread reports what it has sent only every HWM/2 messages, so the messages of an
            # earlier reply can still count against the next one (with buffer_steps=4, a replay lost its end marker).
            replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 2))
            _bind_retrying(replay, replay_endpoint)
        return pub, replay

    # ------------------------------------------------------------------------------------------------ public API

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Publish `events` as one batch stamped now (an empty list publishes nothing)."""
        if events:
            self.publish_batch(KVEventBatch(ts=time.time(), events=list(events)))

    def publish_batch(self, batch: KVEventBatch) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        self._queue.put(batch)

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch will carry."""
        with self._published:
            return self._next_seq

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch handed to `publish` has been sent; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._published:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._published.wait(left)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("kv-event publisher thread did not stop within %.1fs", timeout_s)
            return  # the daemon thread still owns the sockets; closing them here would race it

        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        while True:
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                if batch is None:
                    return
                self._send(batch)
            except zmq.ZMQError:
                log.exception("kv-event publish failed; the batch is lost and subscribers will see a gap")
            finally:
                with self._published:
                    self._queue.task_done()
                    self._published.notify_all()

    def _send(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch = KVEventBatch(batch.ts, batch.events, self.data_parallel_rank)
        payload = encode_batch(batch, self._wire)
        with self._published:
            seq = self._next_seq
            self._next_seq = seq + 1
        # NOTE: buffer before sending: a batch whose send fails is still replayable, so the gap is recoverable.
        self._buffer.append((seq, payload))
        if self._holdings is not None:
            self._holdings.apply(batch.events)
        self._pub.send_multipart((self._topic_bytes, encode_seq(seq), payload), copy=False)

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) == 3 and frames[2] == SNAPSHOT_REQUEST and self._holdings is not None:
                self._send_snapshot(frames[0])
            elif len(frames) == 3 and len(frames[2]) == SEQ_BYTES:
                self._send_replay(frames[0], int.from_bytes(frames[2], "big"))
            else:  # NOTE: debug, not warning: a peer sending garbage must not flood the worker's log
                self.malformed_requests += 1
                log.debug("ignoring malformed replay request with %d frames", len(frames))

    def _send_replay(self, identity: bytes, start_seq: int) -> None:
        framing = self._wire.replay
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                frames = batch_frames(framing, self._topic_bytes, seq, payload)
                self._replay.send_multipart((identity, b"", *frames), copy=False)
        self._replay.send_multipart((identity, b"", *end_frames(framing)))

    def _send_snapshot(self, identity: bytes) -> None:
        # NOTE: this thread also sends the batches, so no batch is half applied: the snapshot is exact at next_seq
        payload = encode_snapshot(self._next_seq, self._holdings.items(), self._wire.hash_encoding)
        self._replay.send_multipart((identity, b"", SNAPSHOT_REPLY, payload), copy=False)


def _bind_retrying(sock: zmq.Socket, endpoint: str, timeout_s: float = 2.0) -> None:
    """Bind, retrying a port still held by a socket closed a moment ago (ZeroMQ closes listeners asynchronously),
    which is what a publisher restarted on its old address meets."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                sock.close(linger=0)
                raise
            time.sleep(0.05)
