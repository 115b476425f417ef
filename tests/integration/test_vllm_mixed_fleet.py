"""A mixed fleet (issue 18 item 3): vLLM workers registered with `strata worker add --kind vllm` beside Strata's own
disaggregated prefill and decode workers, behind one real router process.

vLLM itself does not run on these machines (it needs its GPU build). So each "vLLM worker" here is vLLM's own
`ZmqEventPublisher` and hashing code, from vLLM's published wheel (`tests/vllm_wheel.py`), beside a minimal
OpenAI endpoint written in this test (`/health`, `/metrics` with vLLM's request gauges, `/v1/completions` whole or
streamed) that records what it is sent. Strata's workers are real processes.

    worker A: block size 16, sha256_cbor, holds prefix P      worker B: block size 32, sha256, holds prefix Q
    P + tail ─> A (proxied, its answer returned)    Q + tail, streamed ─> B    fresh prompt ─> Strata's workers
    A reports 50 waiting requests: P + tail ─> Strata's workers (A's queue costs more than recomputing P)
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("msgspec", reason="msgspec is a test dependency: pip install -e .[test]")
zmq = pytest.importorskip("zmq")

from tests.integration.router_process import RouterProcess  # noqa: E402
from tests.vllm_wheel import vllm  # noqa: E402,F401  (the session fixture)

pytestmark = pytest.mark.slow
STRATA_BLOCK = 16


class FakeOpenAI:
    """The OpenAI side of a vLLM worker: records every request body; `waiting` is what its /metrics reports."""

    def __init__(self, name: str) -> None:
        self.name, self.waiting, self.requests = name, 0, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, b"", "text/plain")
                elif self.path == "/metrics":
                    text = (f'vllm:num_requests_running{{model_name="m"}} 1.0\n'
                            f'vllm:num_requests_waiting{{model_name="m"}} {float(fake.waiting)}\n')
                    self._send(200, text.encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.requests.append((self.path, body))
                if body.get("stream"):
                    chunks = [{"id": "c", "object": "text_completion", "model": body["model"],
                               "choices": [{"index": 0, "text": t, "finish_reason": f}]}
                              for t, f in ((fake.name, None), ("!", "length"))]
                    sse = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
                    self._send(200, sse, "text/event-stream")
                else:
                    answer = {"id": "c", "object": "text_completion", "model": body["model"],
                              "choices": [{"index": 0, "text": fake.name, "finish_reason": "length"}]}
                    self._send(200, json.dumps(answer).encode(), "application/json")

            def _send(self, status: int, payload: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class VllmEvents:
    """vLLM's own publisher and block hashing, set up as a vLLM engine with these settings sets them."""

    def __init__(self, vllm, block_size: int, algo: str) -> None:
        self.kv, self.utils, self.block_size = vllm.kv_events, vllm.kv_cache_utils, block_size
        self.hash_fn = vllm.hashing.get_hash_fn_by_name(algo)
        self.pub = self.kv.ZmqEventPublisher(0, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.endpoint = self.pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def store(self, tokens: list[int]) -> None:
        """BlockStored for every full block of `tokens`, on the GPU, hashed by vLLM's own code."""
        self.utils.init_none_hash(self.hash_fn)  # NOTE: a process-wide global in vLLM: set it for this worker's algo
        hashes, parent = [], None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = self.utils.hash_block_tokens(self.hash_fn, parent, tokens[start:start + self.block_size])
            hashes.append(self.utils.maybe_convert_block_hash(parent))
        self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=[self.kv.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:len(hashes) * self.block_size],
            block_size=self.block_size, lora_id=None, medium="GPU", lora_name=None, group_idx=0)]))


def tokens(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % 200 for i in range(n)]  # inside the tiny model's vocabulary


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, vllm):
    from worker_common.launch import WorkerProcess

    model = str(tiny_checkpoint("llama").path)
    router = RouterProcess(["--model", model, "--grpc-port", "0", "--http-port", "0", "--block-size",
                            str(STRATA_BLOCK), "--heartbeat-interval-ms", "300", "--min-measured-samples", "1000000"])
    base = ["--model", model, "--transfer", "shm", "--num-blocks", "128", "--max-num-batched-tokens", "256",
            "--handoff-mib", "8", "--host-tier-mib", "8", "--block-size", str(STRATA_BLOCK),
            "--router", router.registry_address, "--heartbeat-s", "0.3"]
    strata = [WorkerProcess(role, [*base, "--worker-id", f"strata-{role}"], wait=False)
              for role in ("prefill", "decode")]
    fakes = {"A": FakeOpenAI("A"), "B": FakeOpenAI("B")}
    events = {"A": VllmEvents(vllm, 16, "sha256_cbor"), "B": VllmEvents(vllm, 32, "sha256")}
    try:
        for w in strata:
            w.wait_ready()
        yield router, fakes, events
    finally:
        for w in strata:
            w.stop()
        router.stop()
        for f in fakes.values():
            f.close()
        for e in events.values():
            e.pub.shutdown()


def add_with_the_cli(router: RouterProcess, fake: FakeOpenAI, events: VllmEvents, algo: str, name: str) -> None:
    from typer.testing import CliRunner

    from strata.cli import app

    result = CliRunner().invoke(app, [
        "worker", "add", "--kind", "vllm", fake.url, "--events", events.endpoint, "--replay", events.replay_endpoint,
        "--block-size", str(events.block_size), "--hash-algo", algo, "--id", name, "--served-model-name", "m-vllm",
        "--router-http", router.http_address])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"added {name} ")


def model_id(router: RouterProcess) -> str:
    return httpx.get(f"http://{router.http_address}/v1/models", trust_env=False).json()["data"][0]["id"]


def complete(router: RouterProcess, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": model_id(router), "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": stream}
    return httpx.post(f"http://{router.http_address}/v1/completions", json=body, timeout=60.0, trust_env=False)


@pytest.mark.timeout(300)
def test_requests_go_to_the_worker_holding_their_prefix_and_by_load(fleet):
    router, fakes, events = fleet
    wait_for(lambda: httpx.get(f"http://{router.http_address}/health", trust_env=False).json()["workers"] == 2,
             "Strata's workers to register")
    add_with_the_cli(router, fakes["A"], events["A"], "sha256_cbor", "vllm-a")
    add_with_the_cli(router, fakes["B"], events["B"], "sha256", "vllm-b")
    prefix_p, prefix_q = tokens(1, 96), tokens(2, 128)
    events["A"].store(prefix_p)  # published before the router's feed connects: it arrives by replay
    events["B"].store(prefix_q)

    def batches() -> dict[str, int]:
        listed = httpx.get(f"http://{router.http_address}/admin/workers", trust_env=False).json()["workers"]
        return {w["id"]: (w.get("events") or {}).get("batches", 0) for w in listed if w["state"] == "ready"}
    wait_for(lambda: batches() == {"vllm-a": 1, "vllm-b": 1}, "the vLLM workers' events to be indexed")

    answer = complete(router, prefix_p + tokens(3, 7))  # P + tail: A holds all 6 blocks of P
    assert answer.status_code == 200 and answer.headers["x-strata-worker"] == "vllm-a"
    assert answer.json()["choices"][0]["text"] == "A"
    path, sent = fakes["A"].requests[-1]
    assert path == "/v1/completions" and sent["model"] == "m-vllm" and sent["prompt"] == prefix_p + tokens(3, 7)

    with httpx.stream("POST", f"http://{router.http_address}/v1/completions", trust_env=False, timeout=60.0,
                      json={"model": model_id(router), "prompt": prefix_q + tokens(4, 9), "max_tokens": 2,
                            "stream": True}) as streamed:
        assert streamed.headers["x-strata-worker"] == "vllm-b"
        text = streamed.read().decode()
    assert text.endswith("data: [DONE]\n\n") and '"text": "B"' in text
    assert len(fakes["B"].requests) == 1 and len(fakes["A"].requests) == 1

    fresh = complete(router, tokens(5, 40))  # cached nowhere: a tie goes to Strata's own workers
    assert fresh.status_code == 200 and "x-strata-worker" not in fresh.headers
    assert fresh.json()["choices"][0]["finish_reason"] == "length"
    assert (len(fakes["A"].requests), len(fakes["B"].requests)) == (1, 1)

    fakes["A"].waiting = 50  # A's queue now costs more than recomputing P on an idle Strata worker
    wait_for(lambda: _waiting(router, "vllm-a") == 50, "the router to poll A's /metrics")
    loaded = complete(router, prefix_p + tokens(6, 7))
    assert loaded.status_code == 200 and "x-strata-worker" not in loaded.headers
    assert len(fakes["A"].requests) == 1

    metrics = httpx.get(f"http://{router.http_address}/metrics", trust_env=False).text
    assert 'strata_router_routes_total{route="vllm"} 2.0' in metrics


def _waiting(router: RouterProcess, worker_id: str) -> int:
    listed = httpx.get(f"http://{router.http_address}/admin/workers", trust_env=False).json()["workers"]
    return next(w.get("load", {}).get("waiting", -1) for w in listed if w["id"] == worker_id)


@pytest.mark.timeout(120)
def test_admin_api_refuses_bad_registrations_by_name(fleet):
    router, fakes, events = fleet
    url = f"http://{router.http_address}/admin/workers"
    bad = httpx.post(url, json={"kind": "vllm", "url": fakes["A"].url, "events": "tcp://127.0.0.1:1",
                                "hash_algo": "xxhash"}, trust_env=False)
    assert bad.status_code == 400 and "needs hash_seed" in bad.json()["error"]["message"]
    assert httpx.delete(url + "/no-such-worker", trust_env=False).status_code == 404
