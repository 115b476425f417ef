"""The router's registry port (issue 15) on real processes: a router (`python -m router --registry-port 0`) whose
public gRPC port speaks public TLS (its own CA) and whose registry port speaks fleet mTLS, and one decode worker
(bundled model) registering through the registry port with the fleet's certificate and secret.

- Workers register through the registry port; ListWorkers on the public port lists them.
- The public port does not serve the Registry: its calls are UNIMPLEMENTED, with the fleet secret or without.
- The registry port wants a CA-signed client certificate: plain text, TLS without a client certificate, and another
  CA's certificate all fail the handshake; a fleet certificate gets through, and the fleet secret is still asked for.
- Public TLS and fleet TLS together serve a request end to end; `strata workers --ca-file` lists the worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from strata.client import StrataClient
from strata.dev_certs import CertFiles, write_fleet_certs
from strata.launcher import REPO_ROOT
from strata.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.router_process import RouterProcess
from worker_common.fleet_tls import FleetTls
from worker_common.grpc_auth import attach_secret
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

SECRET = "fleet-secret-for-the-registry-port-test"
BUNDLED = REPO_ROOT / "models" / "strata-moe-tiny"
WAIT_S = 120


def fleet_flags(files: CertFiles) -> list[str]:
    return ["--fleet-tls-cert-file", files.cert, "--fleet-tls-key-file", files.key, "--fleet-tls-ca-file", files.ca]


def trusting(ca: str, client: CertFiles | None = None) -> grpc.ChannelCredentials:
    """TLS credentials verifying the server against `ca`, showing `client`'s certificate (None: none)."""
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
    return grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(client.key).read_bytes(),
                                        Path(client.cert).read_bytes())


def heartbeat(channel: grpc.Channel, secret: str = SECRET) -> grpc.StatusCode:
    """The status a Heartbeat of an unknown worker gets (NOT_FOUND: the call reached the Registry)."""
    try:
        stub = router_pb2_grpc.RegistryStub(attach_secret(channel, secret))
        stub.Heartbeat(router_pb2.HeartbeatRequest(worker_id="nobody"), timeout=15)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[CertFiles, CertFiles]:
    """(the fleet's certificates, the public port's: another CA's, as a public certificate would be)."""
    return write_fleet_certs(tmp_path_factory.mktemp("registry-port-certs"))


@pytest.fixture(scope="module")
def fleet(certs, tmp_path_factory):
    """(router, decode worker), the worker READY in the router's ListWorkers."""
    fleet_certs, public = certs
    secret_file = tmp_path_factory.mktemp("registry-port-secret") / "secret"
    secret_file.write_text(SECRET + "\n")
    router = RouterProcess(["--grpc-port", "0", "--http-port", "-1", "--registry-port", "0",
                            "--cluster-secret-file", str(secret_file), *fleet_flags(fleet_certs),
                            "--tls-cert-file", public.cert, "--tls-key-file", public.key,
                            "--log-level", "WARNING"], WAIT_S)
    worker = None
    try:
        worker = WorkerProcess("decode", ["--model", str(BUNDLED), "--worker-id", "decode-0",
                                          "--router", router.registry_address, "--heartbeat-s", "0.5",
                                          "--num-blocks", "64", "--host-tier-mib", "4", "--handoff-mib", "4",
                                          "--cluster-secret-file", str(secret_file), *fleet_flags(fleet_certs)],
                               ready_timeout_s=240)
        wait_listed(router, public.ca, {"decode-0"})
        yield router, worker
    finally:
        if worker is not None:
            worker.stop()
        router.stop()


def wait_listed(router: RouterProcess, ca: str, ids: set[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    with StrataClient(router.grpc_address, timeout_s=15, ca_file=ca) as client:
        while {w.id for w in client.workers() if w.state == common_pb2.WORKER_STATE_READY} != ids:
            assert time.monotonic() < deadline, f"{sorted(ids)} not READY in {WAIT_S}s"
            time.sleep(0.5)


def test_workers_register_through_the_registry_port(fleet):
    router, worker = fleet
    assert router.registry_address != router.grpc_address
    assert worker.alive and "READY" in "".join(router.seen)


def test_registry_calls_on_the_public_port_are_unimplemented(fleet, certs):
    router, _ = fleet
    _, public = certs
    for secret in (SECRET, ""):
        assert heartbeat(grpc.secure_channel(router.grpc_address, trusting(public.ca)), secret) == \
            grpc.StatusCode.UNIMPLEMENTED


def test_the_registry_port_wants_a_fleet_client_certificate(fleet, certs):
    router, _ = fleet
    fleet_certs, foreign = certs
    address = router.registry_address
    for channel in (grpc.insecure_channel(address), grpc.secure_channel(address, trusting(fleet_certs.ca)),
                    grpc.secure_channel(address, trusting(fleet_certs.ca, foreign))):
        assert heartbeat(channel) == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call is made
    tls = FleetTls(*fleet_certs)
    assert heartbeat(tls.channel(address)) == grpc.StatusCode.NOT_FOUND          # through to the Registry
    assert heartbeat(tls.channel(address), secret="") == grpc.StatusCode.UNAUTHENTICATED  # and the secret still asked


def test_public_tls_and_fleet_tls_serve_a_request_and_the_cli_lists_workers(fleet, certs):
    router, _ = fleet
    _, public = certs
    with StrataClient(router.grpc_address, timeout_s=WAIT_S, ca_file=public.ca) as client:
        out = client.generate("def add(a, b):", max_tokens=3, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    run = [sys.executable, "-m", "strata.cli", "workers", "--json", "--router", router.grpc_address]
    env = {k: v for k, v in os.environ.items() if k not in ("STRATA_CA_FILE", "STRATA_API_KEY")}
    listed = subprocess.run(run + ["--ca-file", public.ca], capture_output=True, text=True, timeout=WAIT_S,
                            cwd=REPO_ROOT, env=env)
    assert listed.returncode == 0, listed.stderr
    assert [w["id"] for w in json.loads(listed.stdout)] == ["decode-0"]
    from_env = subprocess.run(run, capture_output=True, text=True, timeout=WAIT_S, cwd=REPO_ROOT,
                              env={**env, "STRATA_CA_FILE": public.ca})
    assert from_env.returncode == 0, from_env.stderr
    plain = subprocess.run(run, capture_output=True, text=True, timeout=WAIT_S, cwd=REPO_ROOT, env=env)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr and "--ca-file" in plain.stderr
