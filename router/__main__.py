"""`python -m router --grpc-port 50051 --http-port 8000 --worker HOST:PORT ...`: serve until SIGTERM/SIGINT.

Prints one line launchers and tests wait for, once every port accepts connections (`registry=`: where workers
register, the gRPC address itself without --registry-port; a field appended last, so older readers still match):

    READY grpc=127.0.0.1:50051 http=127.0.0.1:8000 registry=127.0.0.1:50052
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from router.admission import AdmissionConfig
from router.auth import ApiKeys
from router.cost_model import CostModelConfig
from router.dispatch import DispatchConfig, Dispatcher
from engine.config import KV_CACHE_DTYPES, QUANT_GROUP_SIZES, QUANTIZATION_SCHEMES
from router.served_model import QuantChoice, ServedModel, cost_config_for
from router.events_feed import EventsFeed, SharedIndex
from router.grpc_ports import SHARED, GrpcPorts, open_grpc_ports
from router.openai_api import RouterMetrics, create_app
from router.policy import POLICIES, get_policy
from router.registry import RegistryConfig, WorkerRegistry
from router.validation import MAX_REQUEST_BYTES
from router.service import RegistryService, StrataService
from router.vllm_workers import VllmFleet
from router.worker_probe import WorkerProbe
from strata.cache_metrics import ask_workers
from strata.paths import resolve_model
from worker_common.fleet_tls import FleetTls, add_fleet_tls_flags
from worker_common.grpc_auth import SECRET_ENV, read_cluster_secret

log = logging.getLogger("router")
_SCRAPE_TIMEOUT_S = 1.0  # a worker slower than this is left out of one /metrics scrape


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router", description="Strata router: gRPC strata.v1.Strata + "
                                "Registry, OpenAI-compatible HTTP, prefix-aware routing.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051, help="0 = a free port (printed on READY)")
    p.add_argument("--registry-port", type=int, default=SHARED,
                   help="serve the workers' Registry on a port of its own (0 = a free port, printed on READY as "
                        "registry=), with fleet mTLS when --fleet-tls-* is given; default -1: on the gRPC port")
    p.add_argument("--registry-host", default=None, help="the registry port's interface (default: --host)")
    p.add_argument("--http-port", type=int, default=8000, help="0 = a free port; -1 = no HTTP API")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker to probe (repeatable); workers may also register themselves")
    p.add_argument("--model", default=None, help="checkpoint folder or bundled model name (default: bundled)")
    p.add_argument("--model-id", default=None, help="the name clients send (default: the folder name)")
    p.add_argument("--dtype", default="float32", help="the workers' model dtype (part of the block namespace)")
    p.add_argument("--quantization", choices=QUANTIZATION_SCHEMES, default=None,
                   help="the workers' --quantization (part of the block namespace)")
    p.add_argument("--quant-group-size", type=int, choices=QUANT_GROUP_SIZES, default=128)
    p.add_argument("--quantize-vocab", action="store_true",
                   help="the workers' --quantize-vocab (part of the block namespace)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the workers' KV cache dtype (part of the block namespace)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--policy", default="kv_aware", choices=sorted(POLICIES))
    p.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help="conditional disaggregation: prompts with at most this many uncached tokens prefill on "
                        "their decode worker (default: the cost model's)")
    p.add_argument("--local-prefill-min-backlog-s", type=float, default=None,
                   help="conditional disaggregation under load: while the prefill worker is at least this many "
                        "seconds behind, longer prompts may prefill on their decode worker (default: never)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, help="cost model: prefill speed")
    p.add_argument("--min-measured-samples", type=int, default=None,
                   help="cost model: samples a worker's measured prefill rate or tier read cost needs before it "
                        "replaces the default (default: the cost model's)")
    p.add_argument("--decode-s-per-token", type=float, default=0.02,
                   help="decode work charged per requested token (the load guard's recent-work estimate)")
    p.add_argument("--heartbeat-interval-ms", type=int, default=1000)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    p.add_argument("--max-attempts", type=int, default=3, help="tries of a failed step on different workers")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--max-inflight", type=int, default=1024)
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request a client may send: an HTTP body over it is answered 413, a gRPC message "
                        "RESOURCE_EXHAUSTED (0 = no limit)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: refuse new requests and wait this long for those in flight before cancelling")
    p.add_argument("--max-streams-per-client", type=int, default=0,
                   help="requests one client (API-key tenant, bearer token, else address) may have in flight; "
                        "past it RESOURCE_EXHAUSTED / HTTP 429 (0 = no limit)")
    p.add_argument("--max-queue-per-worker", type=int, default=256,
                   help="requests a decode worker may hold before new ones get RESOURCE_EXHAUSTED / HTTP 429 with a "
                        "retry hint (0 = no bound)")
    p.add_argument("--no-admin", action="store_true", help="refuse EvictCache / FlushCache (PERMISSION_DENIED)")
    add_access_flags(p)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    try:
        args.keys = ApiKeys.load(args.api_key, args.api_keys_file)
        args.cluster_secret = read_cluster_secret(args.cluster_secret_file)
        args.fleet_tls = FleetTls(args.fleet_tls_cert_file, args.fleet_tls_key_file, args.fleet_tls_ca_file,
                                  prefix="--fleet-tls-")
    except ValueError as exc:
        p.error(str(exc))
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        p.error("--tls-cert-file and --tls-key-file go together: give both or neither")
    if not SHARED <= args.registry_port <= 65535:
        p.error(f"--registry-port must be in [-1, 65535] (0 = a free port, -1 = on the gRPC port), "
                f"got {args.registry_port}")
    if args.registry_port > 0 and args.registry_port == args.grpc_port:
        p.error(f"--registry-port must differ from --grpc-port ({args.grpc_port}), or be -1 to share it")
    if args.tls_cert_file and args.fleet_tls.enabled and args.registry_port == SHARED:
        p.error("--tls-cert-file and --fleet-tls-* cannot both serve the router's one gRPC port (public clients and "
                "registering workers share it): give --registry-port (the workers' port then speaks fleet mTLS, the "
                "public one --tls-*), or --fleet-tls-* alone (public clients then verify the router with the fleet "
                "CA), or --tls-* alone")
    return args


def add_access_flags(p: argparse.ArgumentParser) -> None:
    """Who may call the router: client API keys (tenants), the fleet secret, TLS on the public doors."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a client API key of the tenant 'default' (repeatable): every strata.v1.Strata RPC and every "
                        "HTTP route but /health and /metrics then wants `authorization: Bearer KEY`")
    p.add_argument("--api-keys-file", action="append", default=[], metavar="PATH",
                   help="client API keys, one `tenant:key` a line (`#` comments; repeatable); each tenant's prefix "
                        "cache is its own")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help=f"the fleet's shared secret (first line): workers must show it to register, the router shows "
                        f"it on every worker call (default: ${SECRET_ENV}; none = no secret)")
    p.add_argument("--tls-cert-file", default=None, metavar="PEM", help="serve gRPC and HTTP over TLS with this "
                                                                        "certificate (chain) ...")
    p.add_argument("--tls-key-file", default=None, metavar="PEM", help="... and this private key")
    add_fleet_tls_flags(p, "the router dials every worker with it (mTLS); the --registry-port speaks it with "
                           "client certificates required (mTLS); the gRPC port speaks it (no client certificate "
                           "asked for: public clients share it) unless --tls-* is given")


@dataclass
class Router:
    """Every part of a running router, wired together."""

    registry: WorkerRegistry
    index: SharedIndex
    feed: EventsFeed
    dispatcher: Dispatcher
    metrics: RouterMetrics
    probe: WorkerProbe
    strata: StrataService
    registry_service: RegistryService
    fleet: VllmFleet | None = None   # vLLM workers beside Strata's (`strata worker add --kind vllm`)

    def close(self) -> None:
        self.probe.stop()
        if self.fleet is not None:
            self.fleet.close()
        self.dispatcher.close()
        self.feed.close()


def build_router(args: argparse.Namespace) -> Router:
    model = ServedModel.load(resolve_model(args.model), args.dtype, args.block_size, args.max_model_len,
                             args.model_id, QuantChoice(args.quantization, args.quant_group_size, args.kv_cache_dtype,
                                                        args.quantize_vocab))
    base = CostModelConfig()
    changes = {}
    if args.local_prefill_max_tokens is not None:
        changes["local_prefill_max_uncached_tokens"] = args.local_prefill_max_tokens
    if args.local_prefill_min_backlog_s is not None:
        changes["local_prefill_min_backlog_s"] = args.local_prefill_min_backlog_s
    if args.prefill_tokens_per_s is not None:
        changes["prefill_tokens_per_s"] = args.prefill_tokens_per_s
    if args.min_measured_samples is not None:
        changes["min_measured_samples"] = args.min_measured_samples
    cost = cost_config_for(model, base.replace(**changes))
    registry = WorkerRegistry(RegistryConfig(args.heartbeat_interval_ms, args.heartbeat_timeout_ms))
    index = SharedIndex()
    feed = EventsFeed(index)
    registry.add_listener(on_up=feed.subscribe, on_down=feed.unsubscribe)
    registry.add_listener(on_down=lambda wid: log.warning("worker %s is out of routing (dead, gone or restarted)", wid))
    metrics = RouterMetrics()
    dispatcher = Dispatcher({model.id: model}, registry, index, get_policy(args.policy), {model.id: cost},
                            DispatchConfig(args.max_attempts, args.request_timeout_s,
                                           decode_s_per_token=args.decode_s_per_token,
                                           isolate_tenants=args.keys.enabled, cluster_secret=args.cluster_secret,
                                           fleet_tls=args.fleet_tls,
                                           admission=AdmissionConfig(args.max_queue_per_worker),
                                           max_streams_per_client=args.max_streams_per_client),
                            metrics, args.max_inflight)
    scrape_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="metrics-scrape")
    metrics.enable_cache_metrics(lambda: ask_workers(((v.record.id, v.record.address) for v in registry.workers()),
                                                     dispatcher.channels.stub, scrape_pool, _SCRAPE_TIMEOUT_S))
    probe = WorkerProbe(args.worker, registry, dispatcher, model)
    fleet = VllmFleet({model.id: model}, feed, registry.config, taken=lambda wid: _registered(registry, wid))
    return Router(registry, index, feed, dispatcher, metrics, probe,
                  StrataService(dispatcher, registry, allow_admin=not args.no_admin, keys=args.keys),
                  RegistryService(registry, feed), fleet)


def _registered(registry: WorkerRegistry, worker_id: str) -> bool:
    try:
        registry.get(worker_id)
        return True
    except KeyError:
        return False


def _listening_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _sweeper(router: Router, stop: threading.Event) -> None:
    interval = router.registry.config.heartbeat_interval_ms / 1000.0
    while not stop.wait(interval):
        router.registry.sweep()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    router = build_router(args)
    ports = open_grpc_ports(args, router.strata, router.registry_service)
    router.probe.start()
    if router.fleet is not None:
        router.fleet.start()
    stop = threading.Event()
    threading.Thread(target=_sweeper, args=(router, stop), name="registry-sweep", daemon=True).start()
    ports.mark_serving()
    try:
        if args.http_port < 0:
            print(_ready_line(ports, ""), flush=True)
            _wait_for_signal()
        else:
            _serve_http(args, router, ports)
    finally:
        ports.enter_graceful_shutdown()
        left = router.dispatcher.drain(args.drain_timeout_s)  # NOTE: gRPC streams in flight finish first
        if left:
            log.warning("%d requests still in flight after %.0f s of draining: cancelled", left,
                        args.drain_timeout_s)
        stop.set()
        router.close()
        ports.stop(grace_s=3)


def _ready_line(ports: GrpcPorts, http_address: str) -> str:
    return f"READY grpc={ports.public_address} http={http_address} registry={ports.registry_address}"


def _serve_http(args: argparse.Namespace, router: Router, ports: GrpcPorts) -> None:
    import uvicorn

    sock = _listening_socket(args.host, args.http_port)
    http_port = sock.getsockname()[1]
    app = create_app(router.dispatcher, router.registry, router.metrics, router.feed, keys=args.keys,
                     max_request_bytes=args.max_request_bytes, fleet=router.fleet, allow_admin=not args.no_admin)
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=max(1, int(args.drain_timeout_s)),
                            ssl_certfile=args.tls_cert_file, ssl_keyfile=args.tls_key_file)
    print(_ready_line(ports, f"{args.host}:{http_port}"), flush=True)
    # NOTE: uvicorn handles SIGINT/SIGTERM itself (its HTTP streams drain), then raises the signal again under the
    # handlers it found: harmless ones, so the gRPC side drains too (`main`'s finally) instead of dying at once
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(config)
    on_signal = server.handle_exit

    def handle_exit(sig, frame) -> None:  # the gRPC door stops taking new requests the moment a signal arrives
        router.dispatcher.begin_drain()
        on_signal(sig, frame)
    server.handle_exit = handle_exit
    server.run(sockets=[sock])


def _wait_for_signal() -> None:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
