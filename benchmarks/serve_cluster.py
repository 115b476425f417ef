"""The clusters `serve_bench.py` drives: a `strata serve` started here (`LocalLauncher`), or one already running.

`Cluster` holds what a run needs: the door requests go through (gRPC or HTTP), a gRPC client for the operator calls
(cache stats), the served model's block size and the router's HTTP address (its `/metrics`). `measure` runs one
workload against one cluster.
"""
from __future__ import annotations

import argparse
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from strata.client import StrataClient
from strata.launcher import LocalLauncher, ServeConfig
from serve_client import Door, GrpcDoor, HttpDoor, RunResult, run_load  # beside this script
from serve_metrics import Slo, summarize
from serve_workload import WorkloadSpec, build

TARGETS = ("grpc", "http")
RETRIES = "strata_router_step_retries_total"


@dataclass(frozen=True)
class Cluster:
    name: str
    door: Door
    client: StrataClient
    block_size: int
    http_url: str = ""

    def router_counter(self, name: str) -> float | None:
        """One counter of the router's Prometheus `/metrics`; None without the HTTP API or when it is missing."""
        if not self.http_url:
            return None
        text = httpx.get(f"{self.http_url}/metrics", timeout=30.0).text
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} ")]
        return values[0] if values else None


@contextmanager
def started(name: str, config: ServeConfig, target: str, log_dir: Path,
            env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """Start `config` (its output to `log_dir/NAME.log`), yield it, stop every process it started."""
    with ExitStack() as stack:
        log = stack.enter_context((log_dir / f"{name}.log").open("w"))
        launcher = stack.enter_context(LocalLauncher(config, log=log, env={**os.environ, **(env or {})}))
        info = launcher.info
        yield stack.enter_context(attached(name, info.grpc_address, info.http_url, target))


@contextmanager
def attached(name: str, grpc_address: str, http_url: str, target: str) -> Iterator[Cluster]:
    """A cluster someone else started: its router's gRPC address (always: cache stats) and HTTP URL (--target
    http)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if target == "http" and not http_url:
        raise ValueError("--target http needs the router's HTTP API (an http_url / --http-url)")
    with StrataClient(grpc_address, timeout_s=120.0) as client, ExitStack() as stack:
        model = client.models()[0]
        door: Door = GrpcDoor(client)
        if target == "http":
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
            http = stack.enter_context(httpx.Client(base_url=http_url, limits=limits))
            door = HttpDoor(http, model.id)
        yield Cluster(name, door, client, model.kv.block_size or 16, http_url)


def serve_config(args: argparse.Namespace, **changes: object) -> ServeConfig:
    """The benchmark's cluster: free ports, `--model`, `--chunk-tokens`, eager workers unless `--compiled`;
    `changes` on top."""
    base: dict[str, object] = dict(model=args.model, grpc_port=0, http_port=0, enforce_eager=not args.compiled)
    if args.chunk_tokens:
        base["worker_args"] = ("--max-num-batched-tokens", str(args.chunk_tokens))
    return ServeConfig(**{**base, **changes})


def measure(cluster: Cluster, spec: WorkloadSpec, slo: Slo, label: str) -> tuple[dict, RunResult]:
    """Run `spec` against `cluster`: its summary (`serve_metrics.summarize`) and the raw run."""
    workload = build(spec)
    retries = cluster.router_counter(RETRIES)
    result = run_load(workload, cluster.door, label=f"{label}: {workload.description}")
    summary = summarize(result, slo, cluster.block_size)
    after = cluster.router_counter(RETRIES)
    # a step that failed on one worker and was retried on another: invisible in the latencies, so counted here
    summary["step_retries"] = None if retries is None or after is None else int(after - retries)
    summary["workload"] = workload.description
    return summary, result
