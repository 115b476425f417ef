"""`strata serve --ray` on a real local Ray cluster (issue 16): the router and both pools run as Ray actors, serve gRPC
and OpenAI requests token for token as the local launcher's cluster does, come back when Ray restarts a killed decode
actor, and `strata scale decode 2` then `1` under a stream of requests fails none of them."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from strata.launcher import LocalLauncher, ServeConfig
from strata.v1 import common_pb2
from tests.e2e.conftest import SMALL_WORKERS
from tests.e2e.own_cluster import own_cluster
from tests.e2e.test_serve_cli import CONFIG as SERVE_CONFIG
from tests.e2e.test_serve_cli import Serve, run_cli

pytestmark = pytest.mark.slow

NAMESPACE = "strata-ray-test"
CONFIG = SERVE_CONFIG + "  enforce-eager: true\n  local-prefill-max-tokens: 8\n"   # the CLI test's, eager
PROMPTS = ["def fibonacci(n):", "The three laws of thermodynamics are", "import numpy as np\n\ndef softmax(x):"]
SAMPLINGS = [dict(max_tokens=12, temperature=0.0), dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)]


def outputs(grpc_address: str, http_url: str) -> list:
    """Each prompt under each sampling, over gRPC and over the OpenAI API: token ids and text."""
    from strata.client import StrataClient

    got = []
    with StrataClient(grpc_address, timeout_s=120) as client:
        for prompt in PROMPTS:
            for params in SAMPLINGS:
                out = client.generate(prompt, **params)
                got.append(("grpc", prompt, tuple(out.token_ids), out.text))
    for prompt in PROMPTS:
        for params in SAMPLINGS:
            reply = httpx.post(f"{http_url}/v1/completions", timeout=120,
                               json={"model": "strata-moe-tiny", "prompt": prompt, **params})
            assert reply.status_code == 200, reply.text
            got.append(("http", prompt, reply.json()["choices"][0]["text"]))
    return got


@pytest.fixture(scope="module")
def reference():
    """The same requests on the local launcher's cluster (what `strata serve` starts without --ray)."""
    config = ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0, enforce_eager=True,
                         local_prefill_max_tokens=8, **SMALL_WORKERS)
    with own_cluster(config, "ray-reference", LocalLauncher) as cluster:
        return outputs(cluster.grpc_address, cluster.http_url)


@pytest.fixture(scope="module")
def ray_address():
    """A real local Ray cluster, this test process its first driver; `strata serve --ray` joins it."""
    ray.init(num_cpus=8, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def listed(grpc_address: str) -> dict[str, str]:
    """READY workers the router lists: id -> address."""
    from strata.client import StrataClient

    with StrataClient(grpc_address, timeout_s=10) as client:
        return {w.id: w.address for w in client.workers() if w.state == common_pb2.WORKER_STATE_READY}


def wait_until(what: str, done, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = done()
        except Exception:  # noqa: BLE001 - the router may be between answers; the deadline bounds this
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


class Load:
    """A stream of gRPC requests from two client threads until stopped; every outcome kept."""

    def __init__(self, grpc_address: str) -> None:
        self.address, self.stop = grpc_address, threading.Event()
        self.done: list[str] = []          # the decode worker of each finished request
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        from strata.client import StrataClient

        with StrataClient(self.address, timeout_s=120) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    out = client.generate(f"{PROMPTS[n % 3]} # request {i}-{n}", max_tokens=24, temperature=0.0,
                                          include_metrics=True)
                    assert out.finish_reason in ("length", "stop"), out.finish_reason
                    self.done.append(out.metrics.decode_worker_id)
                except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                    self.failed.append(f"{type(exc).__name__}: {exc}")

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def test_serve_on_ray_restarts_and_scales(tmp_path, reference, ray_address):
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    serve = Serve(["--ray", "--address", ray_address, "--ray-namespace", NAMESPACE, "--config", str(config)])
    try:
        m = serve.wait_for(r"^SERVING grpc=(\S+) http=(\S+)", timeout_s=300)
        grpc_address, http_url = m.group(1), m.group(2)
        assert sorted(listed(grpc_address)) == ["decode-0", "prefill-0"]
        assert outputs(grpc_address, http_url) == reference

        # The parts are Ray actors, named in the namespace: kill the decode one; Ray restarts it, it registers again.
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
        assert {"controller", "router", "prefill-0", "decode-0"} <= names
        before = listed(grpc_address)["decode-0"]
        ray.kill(ray.get_actor("decode-0", namespace=NAMESPACE), no_restart=False)
        wait_until("decode-0 back at a new address",
                   lambda: listed(grpc_address).get("decode-0") not in (None, before))
        assert outputs(grpc_address, http_url) == reference

        # Scale the decode pool 1 -> 2 -> 1 under a stream of requests: none fails, the new worker serves some.
        load = Load(grpc_address)
        try:
            wait_until("requests under way", lambda: len(load.done) >= 2)
            grown = run_cli("scale", "decode", "2", "--address", ray_address, "--ray-namespace", NAMESPACE,
                            timeout_s=300)
            assert grown.returncode == 0, grown.stderr
            assert "decode-0, decode-1" in grown.stdout
            assert sorted(listed(grpc_address)) == ["decode-0", "decode-1", "prefill-0"]
            wait_until("decode-1 serving", lambda: load.done.count("decode-1") >= 2)
            shrunk = run_cli("scale", "decode", "1", "--address", ray_address, "--ray-namespace", NAMESPACE,
                             timeout_s=300)
            assert shrunk.returncode == 0, shrunk.stderr
            assert sorted(listed(grpc_address)) == ["decode-0", "prefill-0"]
            served = len(load.done)
            wait_until("requests after the scale-down", lambda: len(load.done) >= served + 2)
        finally:
            load.finish()
        assert load.failed == [], load.failed[:5]
        assert load.done.count("decode-1") >= 2 and load.done.count("decode-0") >= 2

        bad = run_cli("scale", "decode", "0", "--address", ray_address, "--ray-namespace", NAMESPACE)
        assert bad.returncode == 2 and "at least 1" in bad.stderr, bad.stderr
    except BaseException:
        print("strata serve --ray's output:\n" + "\n".join(serve.stderr_lines[-120:]))
        raise
    finally:
        serve.proc.terminate()
        try:
            serve.proc.wait(120)
        except Exception:  # noqa: BLE001
            serve.proc.kill()
    assert serve.proc.returncode == 0, "\n".join(serve.stderr_lines[-30:])
    # Every part stopped with the driver: no named actor of the cluster is left.
    wait_until("the cluster's actors gone", lambda: not [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE], 60)
