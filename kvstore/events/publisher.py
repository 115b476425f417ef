"""ZeroMQ KV-event publisher: PUB for the live stream, ROUTER for replays, one background thread owning both.

Protocol (vLLM's `ZmqEventPublisher`, so vLLM's own subscriber and the routers that read vLLM work unchanged):

    PUB     -> [topic, seq (8 B big-endian), payload]            one message per batch, seq = 0, 1, 2, ...
    ROUTER  <- [identity, b"", start_seq (8 B big-endian)]        from a REQ socket (or a DEALER sending b"" first)
            -> [identity, b"", seq, payload] for every buffered seq >= start_seq, then
               [identity, b"", END_OF_REPLAY, b""]

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

from kvstore.events.types import KVEvent, KVEventBatch
from kvstore.events.wire import END_OF_REPLAY, WireOptions, encode_batch, encode_seq

log = logging.getLogger(__name__)

DEFAULT_TOPIC = "kv-events"
_POLL_S = 0.005  # how long the thread waits for a batch before it looks at the replay socket again


def worker_topic(worker_id: str, base: str = DEFAULT_TOPIC) -> str:
    """The topic a worker publishes on: a SUB subscribed to `base` receives it (ZeroMQ matches topic prefixes)."""
    return f"{base}/{worker_id}" if worker_id else base


class ZmqEventPublisher:
    """Publishes KV-event batches; `publish` is thread-safe and never touches a socket itself.

    `endpoint` and `replay_endpoint` are bound (`tcp://127.0.0.1:*` picks a free port; read the real address from
    `.endpoint` / `.replay_endpoint`). The replay buffer keeps the last `buffer_steps` payloads. `publish` blocks
    only when `max_queue_size` batches are waiting for the thread, which a healthy publisher never reaches.
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
            # A ROUTER drops what exceeds a peer's HWM: leave room for a whole buffer's replay and its end marker.
            replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)
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
        self._pub.send_multipart((self._topic_bytes, encode_seq(seq), payload), copy=False)

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((identity, b"", encode_seq(seq), payload), copy=False)
            self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


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
