"""vLLM OpenAI servers as workers of a mixed fleet (issue 18 item 3): registration, liveness, their KV events.

    strata worker add --kind vllm URL --events tcp://H:P ──POST /admin/workers──> VllmFleet.add(spec)
        │                                                                            │
        │   its own WorkerRegistry (never in the Strata workers' load view)  <───────┤ register
        │   EventsFeed.subscribe(record, key=event_key)  ── its blocks, keyed ──> the shared prefix index
        └── the poller: GET URL/health (heartbeat or failure), GET URL/metrics (running / waiting requests)

A vLLM worker runs prefill and decode itself (role "both"); the router proxies a request's OpenAI body to it
(`router.vllm_http`) when `router.mixed_routing` finds it the better place. Registrations live in the router's
memory: a restarted router needs them again.
"""
from __future__ import annotations

import itertools
import logging
import re
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

from router.events_feed import EventsFeed, FeedStats
from router.index import WorkerId
from router.registry import (LoadFigures, ModelFacts, RegistryConfig, UnknownWorker, WorkerRecord, WorkerRegistry,
                             WorkerView)
from router.vllm_hashing import VllmHashConfig, event_key

log = logging.getLogger(__name__)

WORKER_KINDS: tuple[str, ...] = ("vllm",)
_URL = re.compile(r"^https?://[^/\s]+(/[^\s]*)?$")
_ZMQ = re.compile(r"^(tcp|ipc)://\S+$")
_PROBE_TIMEOUT_S = 1.0
# NOTE: no proxy from the environment: the workers are the fleet's own addresses
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_METRICS = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


@dataclass(frozen=True)
class VllmWorkerSpec:
    """A vLLM OpenAI server as the router knows it.

    url: its OpenAI API (`http://HOST:PORT`). events_endpoint / replay_endpoint: its `--kv-events-config`
    `endpoint` and `replay_endpoint` as the router reaches them (`tcp://HOST:PORT`; replay "" = none).
    model: the router's model id it serves ("" = the router's only model); served_model_name: the name the vLLM
    server knows it by (its `--served-model-name`; "" = `model`). hashing: its block size, hash algorithm and
    seed. loras: (name, path) of each LoRA adapter it serves, as given to its `--lora-modules`: a request naming one
    is hashed with it and goes to a worker serving it.
    """

    url: str
    events_endpoint: str
    replay_endpoint: str = ""
    id: str = ""
    model: str = ""
    served_model_name: str = ""
    hashing: VllmHashConfig = field(default_factory=VllmHashConfig)
    loras: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not _URL.match(self.url):
            raise ValueError(f"url must be http(s)://HOST:PORT (the vLLM server's OpenAI API), got {self.url!r}")
        if not _ZMQ.match(self.events_endpoint):
            raise ValueError(f"events must be the worker's KV-event PUB endpoint, tcp://HOST:PORT, "
                             f"got {self.events_endpoint!r}")
        if self.replay_endpoint and not _ZMQ.match(self.replay_endpoint):
            raise ValueError(f"replay must be empty or tcp://HOST:PORT, got {self.replay_endpoint!r}")
        if not self.id:
            object.__setattr__(self, "id", "vllm-" + self.url.split("://", 1)[1].split("/", 1)[0])
        names = [name for name, _ in self.loras]
        if len(set(names)) != len(names) or not all(name and path for name, path in self.loras):
            raise ValueError(f"loras must be distinct NAME=PATH pairs, got {self.loras!r}")

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "VllmWorkerSpec":
        """The admin API's body (`to_json`'s shape); ValueError naming the field for anything else."""
        known = {"kind", "url", "events", "replay", "id", "model", "served_model_name", "block_size", "hash_algo",
                 "hash_seed", "loras"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
        if body.get("kind", "vllm") not in WORKER_KINDS:
            raise ValueError(f"kind must be one of {WORKER_KINDS} (Strata workers register themselves with "
                             f"--router), got {body.get('kind')!r}")
        for name in ("url", "events"):
            if not isinstance(body.get(name), str):
                raise ValueError(f"{name} is required (a string)")
        loras = body.get("loras") or {}
        if not isinstance(loras, dict):
            raise ValueError("loras must be an object {name: path}")
        seed = body.get("hash_seed")
        hashing = VllmHashConfig(int(body.get("block_size", 16)), str(body.get("hash_algo", "sha256")),
                                 None if seed is None else str(seed))
        return cls(body["url"], body["events"], str(body.get("replay") or ""), str(body.get("id") or ""),
                   str(body.get("model") or ""), str(body.get("served_model_name") or ""), hashing,
                   tuple((str(k), str(v)) for k, v in loras.items()))

    def to_json(self) -> dict[str, Any]:
        h = self.hashing
        return {"kind": "vllm", "id": self.id, "url": self.url, "events": self.events_endpoint,
                "replay": self.replay_endpoint, "model": self.model, "served_model_name": self.served_model_name,
                "block_size": h.block_size, "hash_algo": h.hash_algo, "hash_seed": h.hash_seed,
                "loras": dict(self.loras)}

    def lora_path(self, name: str) -> str | None:
        return dict(self.loras).get(name)


class FleetEntry(NamedTuple):
    """One registered vLLM worker: what it was registered with, its registry view (None: not up), its feed."""

    spec: VllmWorkerSpec
    view: WorkerView | None
    feed: FeedStats | None


class VllmFleet:
    """The router's vLLM workers. `models`: the router's model ids (a worker must serve one); `taken(id)`: whether
    a Strata worker already has that id (ids share the index and the feed)."""

    def __init__(self, models: Mapping[str, Any], feed: EventsFeed, config: RegistryConfig = RegistryConfig(),
                 taken: Callable[[str], bool] = lambda _: False) -> None:
        self.models, self.feed, self.taken = dict(models), feed, taken
        self.registry = WorkerRegistry(config)
        self.registry.add_listener(on_up=self._follow, on_down=feed.unsubscribe)
        self._specs: dict[WorkerId, VllmWorkerSpec] = {}
        self._lock = threading.Lock()
        self._seq = itertools.count(1)  # numbers the requests routed among them (round_robin, random)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-worker-probe", daemon=True)

    # ---- membership -----------------------------------------------------------------------------------------

    def add(self, spec: VllmWorkerSpec) -> VllmWorkerSpec:
        """Register (ValueError naming what is wrong: an unknown model, an id in use); it is routable at once and
        leaves routing when its /health stops answering."""
        model = spec.model or (next(iter(self.models)) if len(self.models) == 1 else "")
        if model not in self.models:
            raise ValueError(f"model must be one of the router's models {sorted(self.models)}, got {spec.model!r}")
        spec = VllmWorkerSpec(spec.url, spec.events_endpoint, spec.replay_endpoint, spec.id, model,
                              spec.served_model_name or model, spec.hashing, spec.loras)
        with self._lock:
            if spec.id in self._specs or self.taken(spec.id):
                raise ValueError(f"worker id {spec.id!r} is in use; give another with --id")
            self._specs[spec.id] = spec
        self._register(spec)
        log.info("vLLM worker %s added (%s, events %s)", spec.id, spec.url, spec.events_endpoint)
        return spec

    def remove(self, worker_id: str) -> bool:
        with self._lock:
            spec = self._specs.pop(WorkerId(worker_id), None)
        if spec is not None:
            self.registry.deregister(spec.id)
        return spec is not None

    def spec(self, worker_id: str) -> VllmWorkerSpec | None:
        with self._lock:
            return self._specs.get(WorkerId(worker_id))

    def entries(self) -> list[FleetEntry]:
        with self._lock:
            specs = sorted(self._specs.values(), key=lambda s: s.id)
        views = {v.record.id: v for v in self.registry.workers(include_dead=True)}
        stats = self.feed.stats()
        return [FleetEntry(s, views.get(s.id), stats.get(s.id)) for s in specs]

    def serving(self, model_id: str, lora: str | None = None) -> list[VllmWorkerSpec]:
        """The READY workers of a model (and of that LoRA adapter, when given)."""
        ready = {v.record.id for v in self.registry.workers() if v.state == "ready"}
        with self._lock:
            return [s for s in self._specs.values() if s.id in ready and s.model == model_id
                    and (lora is None or s.lora_path(lora) is not None)]

    def resolve(self, name: str) -> tuple[str, str | None] | None:
        """A request's `model`: (the router's model id, the LoRA adapter it names or None); None when no vLLM worker
        serves that name."""
        with self._lock:
            specs = list(self._specs.values())
        if any(s.model == name for s in specs):
            return name, None
        for s in specs:
            if s.lora_path(name) is not None:
                return s.model, name
        return None

    def next_seq(self) -> int:
        with self._lock:
            return next(self._seq)

    def report_failure(self, worker_id: str, reason: str) -> None:
        self.registry.report_failure(WorkerId(worker_id), reason)

    # ---- liveness -------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ids = list(self._specs)
        for wid in ids:
            self.feed.unsubscribe(wid)

    def poll_once(self) -> None:
        with self._lock:
            specs = list(self._specs.values())
        for spec in specs:
            self._poll(spec)

    def _run(self) -> None:
        interval = self.registry.config.heartbeat_interval_ms / 1000.0
        while not self._stop.wait(interval):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad answer
                log.exception("vLLM worker poll failed")

    def _poll(self, spec: VllmWorkerSpec) -> None:
        try:
            with _OPENER.open(spec.url.rstrip("/") + "/health", timeout=_PROBE_TIMEOUT_S) as answer:
                healthy = answer.status == 200
        except OSError:
            healthy = False
        if not healthy:
            self.report_failure(spec.id, "its /health did not answer 200")
            return
        load = _load_of(spec.url)
        try:
            self.registry.heartbeat(spec.id, load)
        except UnknownWorker:  # declared dead, and back: register again (the feed follows it again)
            if self.spec(spec.id) is spec:
                self._register(spec)
                self.registry.heartbeat(spec.id, load)

    def _register(self, spec: VllmWorkerSpec) -> None:
        facts = ModelFacts(spec.model, block_size=spec.hashing.block_size)
        self.registry.register(WorkerRecord(spec.id, "both", spec.url, facts, spec.events_endpoint,
                                            spec.replay_endpoint, probed=True))

    def _follow(self, record: WorkerRecord) -> None:
        self.feed.subscribe(record, key=event_key)


def _load_of(url: str) -> LoadFigures | None:
    """Running and waiting requests from vLLM's Prometheus /metrics; None when it serves none."""
    try:
        with _OPENER.open(url.rstrip("/") + "/metrics", timeout=_PROBE_TIMEOUT_S) as answer:
            text = answer.read(4 << 20).decode(errors="replace")
    except OSError:
        return None
    counts = {"running": 0.0, "waiting": 0.0}
    for kind, value in _METRICS.findall(text):
        counts[kind] += float(value)
    return LoadFigures(running=int(counts["running"]), waiting=int(counts["waiting"]))
