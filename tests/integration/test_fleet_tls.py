"""Fleet TLS on real processes and sockets: a router + prefill + decode cluster (`strata serve`'s launcher, bundled
model, `transfer="tcp"`) started with a throwaway CA's certificates (made here, `strata.dev_certs`) and a fleet
secret, and tcp transfer agents with and without TLS.

- A request longer than the local-prefill bound is served end to end: Prefill, a tcp KV transfer (over TLS), Decode.
- Worker ports are mTLS: a plain-text call, a TLS call without a client certificate, one from another CA all fail.
- Workers without a certificate, or with another CA's, never register, and cannot be reached with the fleet's.
- A tcp read without TLS (or with another CA's certificate) from a TLS owner fails at once with a transfer error.
"""
from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.transfer import (AccessDenied, MemoryRegion, PeerUnavailable, TransferConfig, TransferError,
                              create_agent)
from strata.client import StrataClient
from strata.dev_certs import CertFiles, write_fleet_certs
from strata.launcher import REPO_ROOT, ServeConfig
from strata.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from worker_common.fleet_tls import FleetTls
from worker_common.launch import WorkerProcess

SECRET = "fleet-secret-for-the-tls-test"
BUNDLED = REPO_ROOT / "models" / "strata-moe-tiny"
# ~100 tokens: more than the launcher's local-prefill bound (64), so the router disaggregates it
PROMPT = "def encrypted_handoff(rows):\n" + "    total = sum(r.value for r in rows if r.ok)\n" * 8
WAIT_S = 120


def tls_of(files: CertFiles) -> FleetTls:
    return FleetTls(files.cert, files.key, files.ca)


def transfer_config(files: CertFiles | None, options: tuple[tuple[str, str], ...] = ()) -> TransferConfig:
    tls = {} if files is None else dict(tls_cert_file=files.cert, tls_key_file=files.key, tls_ca_file=files.ca)
    return TransferConfig(backend="tcp", secret=SECRET, options=options, **tls)


def make_owner(files: CertFiles | None, nbytes: int = 1 << 20, options: tuple[tuple[str, str], ...] = ()):
    """A tcp owner with one leased region of known bytes: (agent, descriptor of the whole region, the bytes)."""
    agent = create_agent(transfer_config(files, options))
    data = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
    handle = agent.register(MemoryRegion.from_buffer("kv", data))
    lease = agent.grant_lease("kv", [(0, nbytes)], ttl_s=60)
    return agent, handle.descriptor(0, nbytes, lease), data


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[CertFiles, CertFiles]:
    return write_fleet_certs(tmp_path_factory.mktemp("fleet-certs"))


# ------------------------------------------------------------------------------------------------ tcp transfer

def test_a_tcp_read_over_tls_returns_the_owners_bytes(certs):
    fleet, _ = certs
    owner, desc, data = make_owner(fleet, 4 << 20)
    reader = create_agent(transfer_config(fleet))
    try:
        dst = np.zeros(desc.length, np.uint8)
        for _ in range(2):  # the second read reuses the connection
            dst[:] = 0
            assert reader.read([desc], [dst], deadline_s=30.0).nbytes == desc.length
            assert np.array_equal(dst, data)
    finally:
        reader.close()
        owner.close()


@pytest.mark.parametrize("reader_files", ["plain", "foreign"])
def test_a_reader_without_the_fleets_tls_fails_cleanly_against_a_tls_owner(certs, reader_files):
    """No hang: the owner's handshake fails at once and it closes the connection (plain text), or the reader
    refuses the owner's certificate (another CA's trust)."""
    fleet, foreign = certs
    owner, desc, _ = make_owner(fleet)
    reader = create_agent(transfer_config(None if reader_files == "plain" else foreign))
    try:
        started = time.monotonic()
        with pytest.raises(TransferError) as info:
            reader.read([desc], [np.zeros(desc.length, np.uint8)], deadline_s=20.0)
        assert time.monotonic() - started < 10.0
        assert isinstance(info.value, PeerUnavailable if reader_files == "plain" else AccessDenied), info.value
    finally:
        reader.close()
        owner.close()


def test_a_reader_with_another_cas_certificate_is_refused_by_the_owner(certs, tmp_path):
    """It trusts the fleet CA (so it accepts the owner), but the owner does not trust its certificate. TLS 1.3 tells
    the reader after its own handshake: the owner's alert (AccessDenied), or, when the alert is lost to the closing
    connection, an EOF (PeerUnavailable). Either way a transfer error at once, never a byte."""
    fleet, foreign = certs
    owner, desc, _ = make_owner(fleet)
    reader = create_agent(TransferConfig(backend="tcp", secret=SECRET, tls_cert_file=foreign.cert,
                                         tls_key_file=foreign.key, tls_ca_file=fleet.ca))
    try:
        started = time.monotonic()
        with pytest.raises((AccessDenied, PeerUnavailable), match="TLS with the owner"):
            reader.read([desc], [np.zeros(desc.length, np.uint8)], deadline_s=20.0)
        assert time.monotonic() - started < 10.0
    finally:
        reader.close()
        owner.close()


def test_a_tls_connection_stalled_mid_message_is_closed_and_an_idle_pooled_reader_reconnects(certs):
    """The owner's stall bounds hold inside TLS: a request begun and left unfinished is closed after
    `recv_timeout_s`; a pooled reader whose idle connection the owner closed (`idle_timeout_s`) reads on."""
    fleet, _ = certs
    owner, desc, data = make_owner(fleet, options=(("recv_timeout_s", "0.3"), ("idle_timeout_s", "0.5")))
    reader = create_agent(transfer_config(fleet))
    context = ssl.create_default_context(cafile=fleet.ca)
    context.load_cert_chain(fleet.cert, fleet.key)
    host, port = desc.agent.removeprefix("tcp://").rsplit(":", 1)
    try:
        with context.wrap_socket(socket.create_connection((host, int(port)), timeout=5), server_hostname=host) as s:
            s.sendall(b"\x00\x00")  # half a length prefix, then nothing
            started = time.monotonic()
            assert s.recv(1) == b""
            assert time.monotonic() - started < 4.0
        dst = np.zeros(desc.length, np.uint8)
        for _ in range(2):
            reader.read([desc], [dst], deadline_s=30.0)
            time.sleep(1.0)  # past idle_timeout_s: the owner closes the pooled connection
        assert np.array_equal(dst, data)
    finally:
        reader.close()
        owner.close()


def test_a_tls_reader_fails_cleanly_against_a_plain_owner(certs):
    fleet, _ = certs
    owner, desc, _ = make_owner(None)
    reader = create_agent(transfer_config(fleet))
    try:
        with pytest.raises(PeerUnavailable):
            reader.read([desc], [np.zeros(desc.length, np.uint8)], deadline_s=20.0)
    finally:
        reader.close()
        owner.close()


# ------------------------------------------------------------------------------------------------ a real cluster

@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fleet-secret") / "secret"
    path.write_text(SECRET + "\n")
    return str(path)


@pytest.fixture(scope="module")
def cluster(certs, secret_file):
    fleet, _ = certs
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=-1, transfer="tcp", ready_timeout_s=240,
                         cluster_secret_file=secret_file, fleet_tls_cert_file=fleet.cert,
                         fleet_tls_key_file=fleet.key, fleet_tls_ca_file=fleet.ca, **SMALL_WORKERS)
    with own_cluster(config, "fleet-tls") as running:
        yield running


def worker_address(cluster, role: str) -> str:
    return next(p.address for p in cluster.info.processes if p.role == role)


def health(channel: grpc.Channel) -> worker_pb2.HealthResponse:
    try:
        return worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=15)
    finally:
        channel.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_disaggregated_request_is_served_over_fleet_tls(cluster, certs):
    fleet, _ = certs
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S,
                      credentials=tls_of(fleet).channel_credentials()) as client:
        out = client.generate(PROMPT, max_tokens=4, ignore_eos=True, include_metrics=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    m = out.metrics
    assert m.disaggregated and m.prefill_worker_id == "prefill-0" and m.decode_worker_id == "decode-0"
    assert m.blocks_transferred > 0 and m.blocks_recomputed == 0, m  # the KV crossed the tcp transfer, over TLS


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_routers_port_speaks_tls_to_clients_without_a_certificate(cluster, certs):
    """Public clients share the router's port: TLS verified with the fleet CA, no client certificate asked for."""
    fleet, _ = certs
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(fleet.ca).read_bytes())
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S, credentials=credentials) as client:
        assert {w.id for w in client.workers()} == {"prefill-0", "decode-0"}
    with StrataClient(cluster.grpc_address, timeout_s=15) as plain:
        with pytest.raises(grpc.RpcError) as info:
            plain.workers()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_worker_ports_answer_only_mtls_with_a_fleet_certificate(cluster, certs):
    fleet, foreign = certs
    address = worker_address(cluster, "prefill")
    assert health(tls_of(fleet).channel(address)).worker_id == "prefill-0"
    ca_only = grpc.ssl_channel_credentials(root_certificates=Path(fleet.ca).read_bytes())
    trusting_foreign = grpc.ssl_channel_credentials(Path(fleet.ca).read_bytes(), Path(foreign.key).read_bytes(),
                                                    Path(foreign.cert).read_bytes())
    for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, ca_only),
                    grpc.secure_channel(address, trusting_foreign), tls_of(foreign).channel(address)):
        with pytest.raises(grpc.RpcError) as info:
            health(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_workers_without_a_fleet_certificate_never_register_nor_can_be_reached(cluster, certs, secret_file):
    fleet, foreign = certs
    common = ["--model", str(BUNDLED), "--router", cluster.registry_address, "--heartbeat-s", "0.5",
              "--num-blocks", "64", "--host-tier-mib", "4", "--handoff-mib", "4",
              "--cluster-secret-file", secret_file]  # the right secret: TLS alone keeps them out
    foreign_flags = ["--fleet-tls-cert-file", foreign.cert, "--fleet-tls-key-file", foreign.key,
                     "--fleet-tls-ca-file", foreign.ca]
    intruders = [WorkerProcess("decode", common + ["--worker-id", "no-cert"], wait=False),
                 WorkerProcess("decode", common + ["--worker-id", "foreign-cert", *foreign_flags], wait=False)]
    try:
        for worker in intruders:
            worker.wait_ready()
        deadline = time.monotonic() + WAIT_S
        while not all(w.log_tail().count("retrying") >= 2 for w in intruders):  # two registrations refused each
            assert time.monotonic() < deadline, [w.log_tail() for w in intruders]
            time.sleep(0.5)
        with StrataClient(cluster.grpc_address, timeout_s=WAIT_S,
                          credentials=tls_of(fleet).channel_credentials()) as client:
            assert {w.id for w in client.workers(include_dead=True)} == {"prefill-0", "decode-0"}
        with pytest.raises(grpc.RpcError):  # the fleet does not trust the foreign worker's certificate either
            health(tls_of(fleet).channel(intruders[1].address))
    finally:
        for worker in intruders:
            worker.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_serve_registers_workers_through_a_registry_port_that_wants_a_fleet_certificate(cluster, certs):
    """`strata serve`'s launcher gives the router a registry port of its own and points the workers at it: there
    a TLS client without a certificate fails the handshake, while the public port still speaks TLS without one."""
    fleet, _ = certs
    assert cluster.registry_address != cluster.grpc_address
    ca_only = grpc.ssl_channel_credentials(root_certificates=Path(fleet.ca).read_bytes())
    with StrataClient(cluster.grpc_address, timeout_s=WAIT_S, credentials=ca_only,
                      registry_address=cluster.registry_address) as client:
        assert {w.id for w in client.workers()} == {"prefill-0", "decode-0"}
        with pytest.raises(grpc.RpcError) as info:
            client.drain("nobody")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
