"""`WorkerProbe`: the router's heartbeat for workers named by address (`--worker host:port`) that do not register
themselves."""
from __future__ import annotations

import logging
import threading
from typing import Sequence

import grpc

from router.dispatch import Dispatcher
from router.registry import ModelFacts, UnknownWorker, WorkerRecord, WorkerRegistry
from router.served_model import ServedModel
from router.service import ROLE_NAME, load_from_proto, spec_from_proto
from strata.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


class WorkerProbe:
    """Workers named by address (`--worker host:port`) that do not register themselves: `Health` tells their id
    and role, `Stats` their load; each successful poll is their heartbeat, a failed one is silence."""

    def __init__(self, addresses: Sequence[str], registry: WorkerRegistry, dispatcher: Dispatcher,
                 default_model: ServedModel) -> None:
        self.addresses, self.registry, self.dispatcher = list(addresses), registry, dispatcher
        self.model = default_model
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-probe", daemon=True)

    def start(self) -> None:
        self.poll_once()
        self._thread.start()

    def poll_once(self) -> None:
        for address in self.addresses:
            self._poll(address)
        self.registry.sweep()

    def _run(self) -> None:
        interval = self.registry.config.heartbeat_interval_ms / 1000.0
        while not self._stop.wait(interval):
            try:
                self.poll_once()
            except Exception:  # the probe must outlive any one bad answer
                log.exception("worker probe failed")

    def _poll(self, address: str) -> None:
        stub = self.dispatcher.channels.stub(address)
        try:
            health_answer = stub.Health(worker_pb2.HealthRequest(), timeout=2.0)
            stats = stub.Stats(worker_pb2.StatsRequest(), timeout=2.0)
        except grpc.RpcError:
            return  # silence: the sweep declares it dead after the heartbeat timeout
        wid = health_answer.worker_id
        load = load_from_proto(stats.load)
        spec = spec_from_proto(stats.speculative, stats.HasField("speculative"))
        try:
            state = self.registry.heartbeat(wid, load, speculative=spec)
            if state == "ready" and health_answer.state == common_pb2.WORKER_STATE_DRAINING:
                self.registry.drain(wid)
        except UnknownWorker:
            record = self._record(wid, address, health_answer, stats)
            self.registry.register(record)
            self.registry.heartbeat(wid, load, speculative=spec)
            log.info("worker %s found at %s (%s)", wid, address, record.role)

    def _record(self, wid: str, address: str, health_answer, stats) -> WorkerRecord:
        """A worker the registry declared dead keeps what it told at registration (its KV-event endpoints);
        a new one is described from its Health and Stats."""
        try:
            known = self.registry.get(wid).record
            if known.address == address:
                return known
        except UnknownWorker:
            pass
        tiers = tuple(t.tier for t in stats.cache.tiers)
        return WorkerRecord(wid, ROLE_NAME.get(health_answer.role, "both"), address,
                            ModelFacts(self.model.id, self.model.max_model_len), tiers=tiers, probed=True,
                            speculative_methods=tuple(stats.speculative.methods))

    def stop(self) -> None:
        self._stop.set()
