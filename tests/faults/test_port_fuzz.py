"""Fuzz a real worker's ports (issue 15 item 6): its KV-event replay socket (ZeroMQ ROUTER), its tcp transfer server
and its gRPC port get seeded random bytes and random frames, a few thousand in all; afterwards each still serves a
correct request (a replay and a snapshot, a leased read of a Prefill's KV handle, Health and a Prefill) and the
worker process is alive with no traceback in its log.

One prefill worker (`--transfer tcp`, the bundled model, small pools) serves the whole module; Hypothesis generates
the structured frames (derandomized: the same examples every run), `random.Random(SEED)` the raw bytes.
"""
from __future__ import annotations

import random
import socket
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import codec
from kvstore.events.snapshot import SNAPSHOT_REPLY, SNAPSHOT_REQUEST, decode_snapshot
from kvstore.events.replay import parse_reply
from kvstore.events.wire import END_OF_REPLAY, decode_batch, encode_seq
from kvstore.transfer import Descriptor, TransferConfig, create_agent
from kvstore.transfer.tcp_server import ERRORS, LENGTH, recv_header
from strata.v1 import common_pb2, worker_pb2
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

SEED = 20240615
RAW_CONNECTIONS = 300          # raw-garbage connections per port
FRAME_EXAMPLES = 1000          # Hypothesis examples per structured fuzz
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FUZZ = settings(max_examples=FRAME_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
ARGS = ["--transfer", "tcp", "--worker-id", "fuzz-0", "--num-blocks", "64", "--max-num-batched-tokens", "128",
        "--handoff-mib", "4", "--host-tier-mib", "4"]


def make_prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition("//")[2].rpartition(":")
    return host, int(port)


def send_raw(address: tuple[str, int], data: bytes, read_reply: bool = True) -> None:
    """One connection: send `data`, half-close, read whatever comes back until the peer closes (or 2 s)."""
    with socket.create_connection(address, timeout=2.0) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while read_reply and sock.recv(65536):
                pass
        except OSError:
            pass  # reset or timed out: the server refused us, which is allowed


@pytest.fixture(scope="module")
def worker():
    proc = WorkerProcess("prefill", ARGS, ready_timeout_s=240.0)
    try:
        yield proc
    finally:
        proc.stop()


def prefill(worker: WorkerProcess, seed: int) -> worker_pb2.PrefillResponse:
    return worker.stub().Prefill(worker_pb2.PrefillRequest(
        request_id=f"fuzz-{seed}", token_ids=make_prompt(seed),
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=60)


def assert_leased_read_serves(worker: WorkerProcess, seed: int) -> None:
    """A Prefill's KV handle, read over tcp under its lease: every block decodes to the hash the handle names."""
    kv = prefill(worker, seed).kv
    assert kv.blocks and all(loc.HasField("transfer_lease_id") for loc in kv.blocks)
    descs = [Descriptor(loc.agent_address, loc.region_id, loc.offset, loc.length, loc.transfer_lease_id)
             for loc in kv.blocks]
    dsts = [bytearray(d.length) for d in descs]
    with create_agent(TransferConfig(backend="tcp")) as reader:
        reader.read(descs, dsts, deadline_s=10.0)
    assert [codec.peek_header(d).block_hash for d in dsts] == list(kv.block_hashes)


def assert_alive_and_clean(worker: WorkerProcess) -> None:
    assert worker.alive
    health = worker.stub().Health(worker_pb2.HealthRequest(), timeout=10)
    assert health.state == common_pb2.WORKER_STATE_READY
    assert "Traceback" not in worker.log_path.read_text()


# -------------------------------------------------------------------------------------- KV-event replay socket

@st.composite
def replay_frames(draw) -> list[bytes]:
    """What a DEALER may send: random frames, and near-misses of a replay / snapshot request."""
    frame = st.one_of(st.binary(max_size=40), st.just(b""), st.just(SNAPSHOT_REQUEST),
                      st.binary(min_size=8, max_size=8), st.just(END_OF_REPLAY))
    return draw(st.lists(frame, min_size=0, max_size=5))


def request_replay(sock: zmq.Socket, start: int) -> list[int]:
    sock.send_multipart([b"", encode_seq(start)])
    seqs = []
    while True:
        assert sock.poll(10_000), "no replay from the worker"
        reply = parse_reply(sock.recv_multipart())   # either framing (the worker's default carries the topic)
        assert reply.kind != "other", reply
        if reply.kind == "end":
            return seqs
        decode_batch(reply.payload)
        seqs.append(reply.seq)


def test_replay_socket_survives_garbage_and_still_replays(worker):
    prefill(worker, 1)  # something to replay
    address = host_port(worker.replay_endpoint)
    rng = random.Random(SEED)
    for _ in range(RAW_CONNECTIONS):  # raw bytes: ZeroMQ's handshake refuses them
        send_raw(address, rng.randbytes(rng.randrange(0, 300)), read_reply=False)
    send_raw(address, b"\xff" + b"\x00" * 8 + b"\x7f" + rng.randbytes(64), read_reply=False)  # a ZMTP greeting

    ctx = zmq.Context.instance()
    fuzzer = ctx.socket(zmq.DEALER)
    fuzzer.setsockopt(zmq.LINGER, 0)
    fuzzer.connect(worker.replay_endpoint)

    sent = []

    @FUZZ
    @given(frames=replay_frames())
    def send(frames: list[bytes]) -> None:
        sent.append(frames)
        if frames:
            fuzzer.send_multipart(frames)
        while fuzzer.poll(0):
            fuzzer.recv_multipart()  # replies to whatever happened to be a valid request

    try:
        send()
        assert len(sent) >= FRAME_EXAMPLES // 2  # Hypothesis ran the examples (not stopped early)
        fuzzer.send_multipart([b"", b"x" * (1 << 17)])  # past the replay socket's message limit: disconnected
    finally:
        fuzzer.close(linger=0)

    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(worker.replay_endpoint)
    try:
        seqs = request_replay(client, 0)
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        client.send_multipart([b"", SNAPSHOT_REQUEST])
        assert client.poll(10_000)
        frames = client.recv_multipart()
        assert frames[1] == SNAPSHOT_REPLY
        snapshot = decode_snapshot(frames[2])
        assert snapshot.next_seq == seqs[-1] + 1 and len(snapshot) > 0
    finally:
        client.close(linger=0)
    assert_alive_and_clean(worker)


# ----------------------------------------------------------------------------------------- tcp transfer server

_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1),
                     st.floats(), st.text(max_size=80), st.binary(max_size=80))
_ANY = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=20)
_INT = st.one_of(st.integers(min_value=-5, max_value=1 << 22), st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1))
_READ = st.lists(st.one_of(st.sampled_from(["kv-handoff", "nope", "", "x" * 65]), _INT, st.none(), _ANY),
                 min_size=0, max_size=6)
_REQUEST = st.one_of(st.tuples(_INT, st.lists(_READ, max_size=4)).map(list), _ANY)


def test_tcp_transfer_server_survives_garbage_and_still_serves_leased_reads(worker):
    address = host_port(worker.agent_address)
    rng = random.Random(SEED + 1)
    for _ in range(RAW_CONNECTIONS):
        size = rng.randrange(0, 200)
        prefix = LENGTH.pack(rng.choice([0, size, rng.randrange(0, 1 << 32)]))
        send_raw(address, rng.choice([b"", prefix]) + rng.randbytes(size))

    sent = []
    with socket.create_connection(address, timeout=10.0) as sock:
        @FUZZ
        @given(request=_REQUEST)
        def send(request) -> None:
            sent.append(request)
            body = msgpack.packb(request)
            sock.sendall(LENGTH.pack(len(body)) + body)
            reply_id, error = msgpack.unpackb(recv_header(sock))
            if error is None:  # only an empty batch can pass: every read needs a lease the fuzz cannot guess
                assert request[1] == [], f"a fuzzed request was served: {request!r}"
                return
            name, message, index = error
            assert name in ERRORS and isinstance(message, str) and (index is None or isinstance(index, int))

        send()  # one connection for all of them: every refusal leaves it usable
    assert len(sent) >= FRAME_EXAMPLES // 2

    assert_leased_read_serves(worker, 2)
    assert_alive_and_clean(worker)


# ------------------------------------------------------------------------------------------------------ gRPC port

@st.composite
def http2_frames(draw) -> bytes:
    """Frame headers with random length / type / flags / stream, and payloads that may or may not match them."""
    out = b""
    for _ in range(draw(st.integers(0, 4))):
        payload = draw(st.binary(max_size=64))
        length = draw(st.one_of(st.just(len(payload)), st.integers(0, (1 << 24) - 1)))
        kind, flags = draw(st.integers(0, 12)), draw(st.integers(0, 255))
        stream = draw(st.integers(0, (1 << 31) - 1))
        out += length.to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    return out


def test_grpc_port_survives_garbage_and_still_serves_health_and_prefill(worker):
    address = host_port(worker.address)
    rng = random.Random(SEED + 2)
    for _ in range(RAW_CONNECTIONS):
        send_raw(address, rng.randbytes(rng.randrange(0, 300)), read_reply=False)

    sent = []

    @FUZZ
    @given(frames=http2_frames())
    def send(frames: bytes) -> None:
        sent.append(frames)
        send_raw(address, HTTP2_PREFACE + frames, read_reply=False)

    started = time.monotonic()
    send()
    assert time.monotonic() - started < 60.0 and len(sent) >= FRAME_EXAMPLES // 2

    assert_alive_and_clean(worker)
    response = prefill(worker, 3)
    assert response.worker_id == "fuzz-0" and response.kv.blocks
    assert_leased_read_serves(worker, 4)
