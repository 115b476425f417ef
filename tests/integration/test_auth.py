"""Access and tenants on real processes: a router + prefill + decode cluster (`strata serve`'s launcher, bundled
model) with client API keys of two tenants and a fleet secret, plus a lone router (no workers) serving a checkpoint
whose chat template tries to escape Jinja's sandbox, over TLS with a self-signed certificate made here.

- Public doors: gRPC `Strata` calls without a known key are UNAUTHENTICATED, HTTP routes answer 401 with OpenAI's
  error body; grpc health, /health and /metrics stay open; a known key is served.
- Tenants: a prompt tenant alice has cached is no cache hit for tenant bob, whatever salt bob sends.
- Fleet secret: workers without it (or with a wrong one) never get into the registry; Worker RPCs but Health and the
  router's Registry refuse calls without it.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strata.client import StrataClient
from strata.launcher import REPO_ROOT, ServeConfig
from strata.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from tests.integration.router_process import RouterProcess
from worker_common.grpc_auth import attach_secret
from worker_common.launch import WorkerProcess

pytestmark = pytest.mark.slow

ALICE, BOB = "sk-alice-0123", "sk-bob-4567"
SECRET = "fleet-secret-for-the-auth-test"
BUNDLED = REPO_ROOT / "models" / "strata-moe-tiny"
# ~100 tokens: several whole blocks, more than the launcher's local-prefill bound (a disaggregated first send)
PROMPT = "def tenant_isolation_check(rows):\n" + "    total = sum(r.value for r in rows if r.ok)\n" * 8
WAIT_S = 120


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    (folder / "keys").write_text(f"# two tenants\nalice:{ALICE}\n\nbob:{BOB}\n")
    (folder / "secret").write_text(SECRET + "\n")
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, ready_timeout_s=240,
                         api_keys_file=str(folder / "keys"), cluster_secret_file=str(folder / "secret"),
                         **SMALL_WORKERS)
    with own_cluster(config, "auth") as cluster:
        yield cluster


def worker_address(cluster, role: str) -> str:
    return next(p.address for p in cluster.info.processes if p.role == role)


def worker_stub(address: str, secret: str = "") -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(attach_secret(grpc.insecure_channel(address), secret))


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    return info.value


# ------------------------------------------------------------------------------------------------ public doors

def test_grpc_calls_without_a_known_key_are_unauthenticated(secured):
    with StrataClient(secured.grpc_address, timeout_s=WAIT_S, api_key="") as anonymous:
        error = refused(lambda: anonymous.generate("hello", max_tokens=2))
        assert "wants an API key" in error.details()
        refused(lambda: anonymous.workers())
        channel = grpc.insecure_channel(secured.grpc_address)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # grpc health stays open
        channel.close()
    with StrataClient(secured.grpc_address, timeout_s=WAIT_S, api_key="sk-alice-0124") as wrong:
        assert "not valid" in refused(lambda: wrong.generate("hello", max_tokens=2)).details()
    with StrataClient(secured.grpc_address, timeout_s=WAIT_S, api_key=ALICE) as alice:
        out = alice.generate("hello", max_tokens=2, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.token_ids) == 2


def test_http_routes_want_a_bearer_key_but_health_and_metrics_stay_open(secured):
    url = secured.http_url
    body = {"model": "strata-moe-tiny", "prompt": "hello", "max_tokens": 2}
    missing = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    error = missing.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert "wants an API key" in error["message"]
    wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=WAIT_S)
    assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
    assert "strata_router_requests" in httpx.get(f"{url}/metrics", timeout=WAIT_S).text
    assert httpx.get(f"{url}/v1/models", headers=bearer(BOB), timeout=WAIT_S).status_code == 200
    served = httpx.post(f"{url}/v1/completions", json=body, headers=bearer(BOB), timeout=WAIT_S)
    assert served.status_code == 200, served.text


def test_cli_admin_verbs_take_the_api_key(secured):
    run = [sys.executable, "-m", "strata.cli", "workers", "--json", "--router", secured.grpc_address]
    env = {k: v for k, v in os.environ.items() if k != "STRATA_API_KEY"}
    without = subprocess.run(run, capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert without.returncode == 1 and "UNAUTHENTICATED" in without.stderr and "--api-key" in without.stderr
    with_key = subprocess.run(run, capture_output=True, text=True, timeout=WAIT_S, env={**env, "STRATA_API_KEY": BOB})
    assert with_key.returncode == 0, with_key.stderr
    assert {w["id"] for w in json.loads(with_key.stdout)} == {"prefill-0", "decode-0"}


# ------------------------------------------------------------------------------------------------ tenants

def cached_tokens(url: str, key: str, **extra) -> int:
    body = {"model": "strata-moe-tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=bearer(key), timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] > 64
    return usage["prompt_tokens_details"]["cached_tokens"]


def hit_again(url: str, key: str, **extra) -> int:
    """The cached tokens of a send that repeats an earlier one (polled a while: routing to the cache follows the
    workers' KV events)."""
    deadline, hit = time.monotonic() + 60, 0
    while hit == 0 and time.monotonic() < deadline:
        hit = cached_tokens(url, key, **extra)
    return hit


def test_a_prompt_one_tenant_cached_is_no_cache_hit_for_another(secured):
    url = secured.http_url
    assert cached_tokens(url, ALICE) == 0
    assert hit_again(url, ALICE) > 0
    # each of these is a namespace of bob's own (no salt = bob's default one), none of them alice's
    for salt in ({}, {"cache_salt": "alice"}, {"cache_salt": "tenant:alice"}):
        assert cached_tokens(url, BOB, **salt) == 0, f"bob hit alice's prefix with {salt}"
    assert hit_again(url, BOB, cache_salt="") > 0  # bob's own default namespace: his first send is cached
    with StrataClient(secured.grpc_address, timeout_s=WAIT_S, api_key=BOB) as bob:  # the gRPC door alike
        out = bob.generate(PROMPT, max_tokens=2, cache_salt="another", include_metrics=True)
        assert out.usage.cached_tokens == 0


# ------------------------------------------------------------------------------------------------ fleet secret

def test_worker_rpcs_and_the_registry_want_the_fleet_secret_but_health_answers(secured):
    prefill = worker_address(secured, "prefill")
    for secret in ("", "not-the-secret"):
        stub = worker_stub(prefill, secret)
        assert stub.Health(worker_pb2.HealthRequest(), timeout=WAIT_S).worker_id == "prefill-0"
        error = refused(lambda: stub.FlushCache(common_pb2.FlushCacheRequest(tier="host"), timeout=WAIT_S))
        assert "fleet secret" in error.details()
        refused(lambda: stub.Prefill(worker_pb2.PrefillRequest(request_id="sneak", token_ids=[1, 2, 3]),
                                     timeout=WAIT_S))
    assert worker_stub(prefill, SECRET).Stats(worker_pb2.StatsRequest(), timeout=WAIT_S).worker_id == "prefill-0"
    registry = router_pb2_grpc.RegistryStub(grpc.insecure_channel(secured.registry_address))
    ghost = common_pb2.WorkerInfo(id="ghost", role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                                  model=common_pb2.ModelInfo(id="strata-moe-tiny"))
    refused(lambda: registry.RegisterWorker(router_pb2.RegisterWorkerRequest(worker=ghost), timeout=WAIT_S))
    refused(lambda: registry.Heartbeat(router_pb2.HeartbeatRequest(worker_id="decode-0"), timeout=WAIT_S))


def test_workers_without_the_fleet_secret_never_register(secured, tmp_path):
    (tmp_path / "wrong").write_text("not-the-secret\n")
    common = ["--model", str(BUNDLED), "--router", secured.registry_address, "--heartbeat-s", "0.5",
              "--num-blocks", "64", "--host-tier-mib", "4", "--handoff-mib", "4"]
    env = {k: v for k, v in os.environ.items() if k != "STRATA_CLUSTER_SECRET"}
    intruders = [WorkerProcess("decode", common + ["--worker-id", "no-secret"], env=env, wait=False),
                 WorkerProcess("decode", common + ["--worker-id", "wrong-secret", "--cluster-secret-file",
                                                   str(tmp_path / "wrong")], env=env, wait=False)]
    try:
        for worker in intruders:
            worker.wait_ready()
        deadline = time.monotonic() + WAIT_S
        while not all("UNAUTHENTICATED" in w.log_tail() for w in intruders):
            assert time.monotonic() < deadline, [w.log_tail() for w in intruders]
            time.sleep(0.2)
        with StrataClient(secured.grpc_address, timeout_s=WAIT_S, api_key=ALICE) as alice:
            for i in range(3):  # served by the registered workers only
                assert alice.generate(f"request {i}", max_tokens=2).finish_reason
            listed = {w.id for w in alice.workers(include_dead=True)}
        assert listed == {"prefill-0", "decode-0"}
        assert "fleet secret" in intruders[1].log_tail()
    finally:
        for worker in intruders:
            worker.stop()


# ------------------------------------------------------------------------------------------------ lone router

def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost and its key, PEM files in `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def escaping_checkpoint(folder: Path) -> Path:
    """The bundled model, its chat template replaced by one that reaches for Python's internals."""
    model = folder / "escaping-model"
    model.mkdir()
    for item in BUNDLED.iterdir():
        if item.name != "tokenizer_config.json":
            (model / item.name).symlink_to(item)
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def lone_router(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lone-router")
    cert, key = self_signed(folder)
    router = RouterProcess(["--model", str(escaping_checkpoint(folder)), "--grpc-port", "0", "--http-port", "0",
                            "--api-key", ALICE, "--tls-cert-file", str(cert), "--tls-key-file", str(key)], WAIT_S)
    router.cert = cert
    try:
        yield router
    finally:
        router.stop()


def test_chat_template_escaping_the_sandbox_is_a_400_not_a_crash(lone_router):
    body = {"model": "escaping-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(f"https://{lone_router.http_address}/v1/chat/completions", json=body, headers=bearer(ALICE),
                        verify=trusting(lone_router.cert), timeout=WAIT_S)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "sandbox" in error["message"] and "__class__" in error["message"]


def test_router_serves_grpc_and_http_over_tls(lone_router):
    models = httpx.get(f"https://{lone_router.http_address}/v1/models", headers=bearer(ALICE),
                       verify=trusting(lone_router.cert), timeout=WAIT_S)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "escaping-model"
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
        httpx.get(f"http://{lone_router.http_address}/health", timeout=20)
    credentials = grpc.ssl_channel_credentials(root_certificates=lone_router.cert.read_bytes())
    with grpc.secure_channel(lone_router.grpc_address, credentials) as channel:
        from strata.v1 import strata_pb2, strata_pb2_grpc
        stub = strata_pb2_grpc.StrataStub(channel)
        answer = stub.ListModels(strata_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {ALICE}")],
                                 timeout=WAIT_S)
        assert [m.id for m in answer.models] == ["escaping-model"]
    with grpc.insecure_channel(lone_router.grpc_address) as plain:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
