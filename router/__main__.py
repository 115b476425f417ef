"""`python -m router --grpc-port 50051 --http-port 8000 --worker HOST:PORT ...`: serve until SIGTERM/SIGINT.

Prints one line launchers and tests wait for, once both ports accept connections:

    READY grpc=127.0.0.1:50051 http=127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from router.cost_model import CostModelConfig
from router.dispatch import DispatchConfig, Dispatcher
from engine.config import KV_CACHE_DTYPES, QUANT_GROUP_SIZES, QUANTIZATION_SCHEMES
from router.served_model import QuantChoice, ServedModel, cost_config_for
from router.events_feed import EventsFeed, SharedIndex
from router.openai_api import RouterMetrics, create_app
from router.policy import POLICIES, get_policy
from router.registry import RegistryConfig, WorkerRegistry
from router.service import RegistryService, StrataService, add_services, make_grpc_server, mark_serving
from router.worker_probe import WorkerProbe
from strata.cache_metrics import ask_workers
from strata.paths import resolve_model

log = logging.getLogger("router")
_SCRAPE_TIMEOUT_S = 1.0  # a worker slower than this is left out of one /metrics scrape


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m router", description="Strata router: gRPC strata.v1.Strata + "
                                "Registry, OpenAI-compatible HTTP, prefix-aware routing.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051, help="0 = a free port (printed on READY)")
    p.add_argument("--http-port", type=int, default=8000, help="0 = a free port; -1 = no HTTP API")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                   help="a worker to probe (repeatable); workers may also register themselves")
    p.add_argument("--model", default=None, help="checkpoint folder or bundled model name (default: bundled)")
    p.add_argument("--model-id", default=None, help="the name clients send (default: the folder name)")
    p.add_argument("--dtype", default="float32", help="the workers' model dtype (part of the block namespace)")
    p.add_argument("--quantization", choices=QUANTIZATION_SCHEMES, default=None,
                   help="the workers' --quantization (part of the block namespace)")
    p.add_argument("--quant-group-size", type=int, choices=QUANT_GROUP_SIZES, default=128)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the workers' KV cache dtype (part of the block namespace)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--policy", default="kv_aware", choices=sorted(POLICIES))
    p.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help="conditional disaggregation: prompts with at most this many uncached tokens prefill on "
                        "their decode worker (default: the cost model's)")
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
    p.add_argument("--no-admin", action="store_true", help="refuse EvictCache / FlushCache (PERMISSION_DENIED)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


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

    def close(self) -> None:
        self.probe.stop()
        self.dispatcher.close()
        self.feed.close()


def build_router(args: argparse.Namespace) -> Router:
    model = ServedModel.load(resolve_model(args.model), args.dtype, args.block_size, args.max_model_len,
                             args.model_id, QuantChoice(args.quantization, args.quant_group_size, args.kv_cache_dtype))
    base = CostModelConfig()
    changes = {}
    if args.local_prefill_max_tokens is not None:
        changes["local_prefill_max_uncached_tokens"] = args.local_prefill_max_tokens
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
                                           decode_s_per_token=args.decode_s_per_token), metrics, args.max_inflight)
    scrape_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="metrics-scrape")
    metrics.enable_cache_metrics(lambda: ask_workers(((v.record.id, v.record.address) for v in registry.workers()),
                                                     dispatcher.channels.stub, scrape_pool, _SCRAPE_TIMEOUT_S))
    probe = WorkerProbe(args.worker, registry, dispatcher, model)
    return Router(registry, index, feed, dispatcher, metrics, probe,
                  StrataService(dispatcher, registry, allow_admin=not args.no_admin), RegistryService(registry, feed))


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
    server = make_grpc_server()
    health = add_services(server, router.strata, router.registry_service)
    grpc_port = server.add_insecure_port(f"{args.host}:{args.grpc_port}")
    if grpc_port == 0:
        raise SystemExit(f"router: cannot bind gRPC port {args.host}:{args.grpc_port}")
    server.start()
    router.probe.start()
    stop = threading.Event()
    threading.Thread(target=_sweeper, args=(router, stop), name="registry-sweep", daemon=True).start()
    mark_serving(health)
    try:
        if args.http_port < 0:
            print(f"READY grpc={args.host}:{grpc_port} http=", flush=True)
            _wait_for_signal()
        else:
            _serve_http(args, router, grpc_port)
    finally:
        health.enter_graceful_shutdown()
        stop.set()
        router.close()
        server.stop(grace=3).wait(4)


def _serve_http(args: argparse.Namespace, router: Router, grpc_port: int) -> None:
    import uvicorn

    sock = _listening_socket(args.host, args.http_port)
    http_port = sock.getsockname()[1]
    app = create_app(router.dispatcher, router.registry, router.metrics, router.feed)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3)
    print(f"READY grpc={args.host}:{grpc_port} http={args.host}:{http_port}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])  # handles SIGINT/SIGTERM itself


def _wait_for_signal() -> None:
    import signal

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
