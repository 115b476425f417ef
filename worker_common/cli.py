"""Command-line flags shared by `python -m prefill_worker` and `python -m decode_worker`."""
from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, Sequence

from engine.config import (KV_CACHE_DTYPES, MOE_OVERFLOW_POLICIES, QUANT_GROUP_SIZES, QUANTIZATION_SCHEMES,
                           SPECULATIVE_METHODS)
from kvstore.events.wire import WIRE_PRESETS
from strata import moe_options
from strata.paths import resolve_draft_model, resolve_model
from strata.speculative_options import check_num_tokens
from worker_common.config import TRANSFER_BACKENDS, WorkerConfig
from worker_common.fleet_tls import add_fleet_tls_flags
from worker_common.grpc_auth import SECRET_ENV, read_cluster_secret
from worker_common.store_setup import S3_URL_FORMS, s3_config


def s3_url(value: str) -> str:
    """argparse type of `--s3-url`: refused while parsing (exit 2, naming the option), not after the model loads."""
    if value:
        try:
            s3_config(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("--s3-url ")) from None
    return value


def num_speculative_tokens(value: str) -> int:
    """argparse type of `--num-speculative-tokens` (exit 2 naming the option, before the model loads)."""
    try:
        return check_num_tokens(int(value))
    except ValueError as exc:
        message = str(exc) if "must be" in str(exc) else f"must be an integer, got {value!r}"
        raise argparse.ArgumentTypeError(message) from None


def add_speculative_flags(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    p.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                   help="decode: speculative decoding with this drafter (default: off; prefill workers ignore it)")
    p.add_argument("--num-speculative-tokens", type=num_speculative_tokens, default=d.num_speculative_tokens,
                   help="decode: the most tokens drafted per request and step")
    p.add_argument("--speculative-model", default=None,
                   help="decode: the draft checkpoint (draft) or EAGLE head (eagle) folder (default: the bundled one)")
    p.add_argument("--no-speculative-adaptive", dest="speculative_adaptive", action="store_false",
                   help="decode: always draft --num-speculative-tokens (default: adapt the length to acceptance)")


def checked(convert: Callable[[str], Any], check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse type: `convert` the text, then `check` the value; either failure exits 2 naming the option."""
    kind = "an integer" if convert is int else "a number"

    def parse(value: str) -> Any:
        try:
            number = convert(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {value!r}") from None
        try:
            return check(number)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _non_negative(value: int) -> int:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def add_moe_flags(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    p.add_argument("--expert-parallel", type=checked(int, moe_options.check_expert_parallel),
                   default=d.expert_parallel, metavar="N",
                   help="run this worker as N ranks on this host, the MoE experts sharded over them; rank 0 serves "
                        "the group (default 1: a plain worker)")
    p.add_argument("--moe-capacity-factor", type=checked(float, moe_options.check_capacity_factor), default=None,
                   metavar="F", help="each expert takes at most F x its even share of a step's tokens "
                                     "(default: no limit)")
    p.add_argument("--moe-overflow", choices=MOE_OVERFLOW_POLICIES, default=d.moe_overflow,
                   help="tokens past an expert's capacity: drop (keep the residual) or next (next-best expert)")
    p.add_argument("--num-redundant-experts", type=checked(int, moe_options.check_num_redundant_experts),
                   default=d.num_redundant_experts, metavar="R", help="spare expert slots per rank for replicas of "
                                                                      "hot experts")
    p.add_argument("--eplb-interval", type=checked(int, moe_options.check_eplb_interval), default=d.eplb_interval,
                   metavar="STEPS", help="forwards between expert rebalances (default 0: never)")
    p.add_argument("--eplb-window", type=checked(int, moe_options.check_eplb_window), default=d.eplb_window,
                   metavar="STEPS", help="forwards of expert load the rebalancer looks at")
    # Set by rank 0 for the ranks it starts (worker_common.ep_ranks), not by users.
    p.add_argument("--ep-rank", type=int, default=d.ep_rank, help=argparse.SUPPRESS)
    p.add_argument("--ep-init", default=d.ep_init, help=argparse.SUPPRESS)


def check_speculative_model(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The drafter's folder must exist: refused while parsing (exit 2), not after the target model loads."""
    if args.speculative_model and args.speculative not in ("draft", "eagle"):
        p.error("argument --speculative-model: only used with --speculative draft or eagle")
    try:
        resolve_draft_model(args.speculative, args.speculative_model)
    except ValueError as exc:
        p.error(f"argument --speculative-model: {str(exc).removeprefix('speculative_model').lstrip(': ')}")


def parse_config(role: str, argv: Sequence[str] | None = None) -> WorkerConfig:
    d = WorkerConfig(role=role, model="-")
    p = argparse.ArgumentParser(prog=f"python -m {role}_worker",
                                description=f"Strata {role} worker (gRPC strata.v1.Worker).")
    p.add_argument("--model", default=None, help="checkpoint folder or bundled model name (default: bundled)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0 = a free port, printed on READY)")
    p.add_argument("--worker-id", default="")
    p.add_argument("--transfer", choices=TRANSFER_BACKENDS, default=d.transfer, help="KV transfer backend")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="requests this worker holds (running, queued, streaming) before it answers "
                        "RESOURCE_EXHAUSTED with a retry hint (the router tries another worker)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--enforce-eager", action="store_true",
                   help="do not compile the decode step (also: STRATA_ENFORCE_EAGER=1)")
    p.add_argument("--quantization", choices=QUANTIZATION_SCHEMES, default=None,
                   help="quantize the weights at load time (default: the checkpoint's own quantization, else none)")
    p.add_argument("--quant-group-size", type=int, choices=QUANT_GROUP_SIZES, default=d.quant_group_size,
                   help="int4 group size")
    p.add_argument("--quantize-vocab", action="store_true",
                   help="also quantize the LM head and token embedding with --quantization's scheme")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV cache storage: auto (the model dtype), fp8 or int8 (per-block, per-head scales)")
    add_speculative_flags(p, d)
    add_moe_flags(p, d)
    p.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s, help="prefill: KV lease without ReleaseKv")
    p.add_argument("--handoff-mib", type=int, default=d.handoff_bytes >> 20, help="prefill: hand-off region")
    p.add_argument("--host-tier-mib", type=int, default=d.host_tier_bytes >> 20)
    p.add_argument("--transfer-deadline-s", type=float, default=d.transfer_deadline_s,
                   help="decode: bound on one KV read before falling back to the store, then recompute")
    p.add_argument("--disk-path", default="", help="add a disk tier here (written through)")
    p.add_argument("--redis-url", default="", help="add a shared Redis tier (written through)")
    p.add_argument("--s3-url", type=s3_url, default="",
                   help=f"add a shared S3 tier (written through): {S3_URL_FORMS} (an S3-compatible server)")
    p.add_argument("--kv-encryption-key-file", default="", metavar="PATH",
                   help="encrypt the disk, Redis and S3 tiers at rest (AES-256-GCM) with this 32-byte key "
                        "(raw, or 64 hex characters)")
    p.add_argument("--tier-quota-bytes", type=checked(int, _non_negative), default=0, metavar="N",
                   help="bytes each namespace (tenant) may hold in each shared tier, Redis and S3 (0 = no quota)")
    p.add_argument("--kv-events-endpoint", default=d.kv_events_endpoint,
                   help="ZeroMQ PUB bind of the KV events ('' = no events; port * = free, printed on READY)")
    p.add_argument("--kv-replay-endpoint", default=d.kv_replay_endpoint,
                   help="ZeroMQ ROUTER bind that replays missed KV-event batches ('' = none)")
    p.add_argument("--kv-events-format", choices=sorted(WIRE_PRESETS), default=d.kv_events_format,
                   help="the KV events' shape: vllm = current vLLM's (keyed events, topic-framed replays); "
                        "vllm-0.25 / vllm-0.23 for consumers of those releases")
    p.add_argument("--router", default="", help="register with this router's Registry (host:port) and heartbeat")
    p.add_argument("--advertise-host", default="",
                   help="host the router reaches this worker at, when it binds 0.0.0.0 (default: the machine's name)")
    p.add_argument("--heartbeat-s", type=float, default=d.heartbeat_s,
                   help="seconds between heartbeats (the router's shorter interval wins)")
    p.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM: leave routing at once, then wait up to this long for requests in flight to "
                        "finish before stopping (default 30)")
    p.add_argument("--model-id", default="", help="model name to register under (default: the folder's name)")
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help=f"the fleet's shared secret (first line): shown to the router's Registry and to peers, and "
                        f"wanted on every Worker RPC but Health (default: ${SECRET_ENV}; none = no secret)")
    add_fleet_tls_flags(p, "this worker serves its gRPC port with it (mTLS: only CA-signed peers connect), dials the "
                           "router and its peers with it, and runs tcp transfers over TLS")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="Prometheus /metrics over HTTP (0 = a free port, printed on READY; -1 = none)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    check_speculative_model(p, args)
    name = f"{role}[rank {args.ep_rank}]" if args.ep_rank else role
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: "
                                                             "%(message)s")
    try:
        return _config_of(role, args)
    except ValueError as exc:  # a field no flag's type checks alone (a combination): exit 2 naming it, no traceback
        p.error(str(exc))


def _config_of(role: str, args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        role=role, model=resolve_model(args.model), host=args.host, port=args.port, worker_id=args.worker_id,
        transfer=args.transfer, dtype=args.dtype, block_size=args.block_size, num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_requests=args.max_requests,
        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
        quantization=args.quantization, quant_group_size=args.quant_group_size, quantize_vocab=args.quantize_vocab,
        kv_cache_dtype=args.kv_cache_dtype, speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model, speculative_adaptive=args.speculative_adaptive,
        lease_ttl_s=args.lease_ttl_s, handoff_bytes=args.handoff_mib << 20,
        host_tier_bytes=args.host_tier_mib << 20, transfer_deadline_s=args.transfer_deadline_s,
        disk_path=args.disk_path, redis_url=args.redis_url, s3_url=args.s3_url,
        kv_encryption_key_file=args.kv_encryption_key_file, tier_quota_bytes=args.tier_quota_bytes,
        kv_events_endpoint=args.kv_events_endpoint, kv_replay_endpoint=args.kv_replay_endpoint,
        kv_events_format=args.kv_events_format,
        router_address=args.router, advertise_host=args.advertise_host, heartbeat_s=args.heartbeat_s,
        drain_timeout_s=args.drain_timeout_s,
        model_id=args.model_id, metrics_port=args.metrics_port, expert_parallel=args.expert_parallel,
        ep_rank=args.ep_rank, ep_init=args.ep_init, moe_capacity_factor=args.moe_capacity_factor,
        moe_overflow=args.moe_overflow, num_redundant_experts=args.num_redundant_experts,
        eplb_interval=args.eplb_interval, eplb_window=args.eplb_window,
        cluster_secret=read_cluster_secret(args.cluster_secret_file),
        fleet_tls_cert_file=args.fleet_tls_cert_file, fleet_tls_key_file=args.fleet_tls_key_file,
        fleet_tls_ca_file=args.fleet_tls_ca_file)
