"""`strata serve`: a whole disaggregated cluster on this machine, in one command (DESIGN §9, embedded default).

    strata serve                                  # router + 1 prefill + 1 decode, bundled model, host + disk tiers
    strata serve --prefill 2 --decode 2 --redis-url redis://127.0.0.1:6379/0
    strata serve --config serve.yaml              # the same keys as the options (dashes or underscores)
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import typer

def banner(info, config, ray_namespace: str | None = None) -> str:
    http = info.http_url
    keys = config.client_keys().enabled
    bearer = " -H \"Authorization: Bearer $STRATA_API_KEY\"" if keys else ""
    ranks = f", each {config.expert_parallel} expert-parallel ranks" if config.expert_parallel > 1 else ""
    lines = [f"Strata is serving {info.model} with {config.prefill} prefill + {config.decode} decode workers{ranks}",
             f"  gRPC     {info.grpc_address}      (python: strata.client.StrataClient({info.grpc_address!r}))"]
    if http:
        lines += [f"  OpenAI   {http}/v1",
                  f"  metrics  {http}/metrics",
                  f"  try:     curl {http}/v1/completions{bearer} -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{info.model}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32}}'"]
    if info.registry_address and info.registry_address != info.grpc_address:
        lines += [f"  workers  {info.registry_address}      (the router's registry port: other workers join with "
                  f"--router {info.registry_address})"]
    if config.fleet_tls_ca_file:
        lines += [f"  TLS:     fleet TLS on every internal link; gRPC clients verify the router with "
                  f"{config.fleet_tls_ca_file}"]
    if ray_namespace is not None:
        space = "" if ray_namespace == "strata" else f" --ray-namespace {ray_namespace}"
        lines += [f"  Ray:     actors router, prefill-N, decode-N in namespace {ray_namespace!r}; "
                  f"scale with: strata scale decode 2{space}"]
    lines += [f"  cache:   strata cache stats --router {info.grpc_address}"
              + (" --api-key $STRATA_API_KEY" if keys else "")
              + (f" --ca-file {config.fleet_tls_ca_file}" if config.fleet_tls_ca_file else ""),
              f"SERVING grpc={info.grpc_address} http={http} registry={info.registry_address or info.grpc_address}",
              "Press Ctrl-C to stop."]
    return "\n".join(lines)


def _check_s3_url(value: Optional[str]) -> Optional[str]:
    """`--s3-url` is checked while the arguments are parsed, before anything starts."""
    from worker_common.store_setup import s3_config

    if value:
        try:
            s3_config(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc).removeprefix("--s3-url ")) from None
    return value


def check_speculative(value: Optional[str]) -> Optional[str]:
    """`--speculative` (and `strata generate`'s): refused while the arguments are parsed, naming the option."""
    from strata.speculative_options import check_method

    try:
        return check_method(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def check_num_speculative_tokens(value: Optional[int]) -> Optional[int]:
    from strata.speculative_options import check_num_tokens

    try:
        return value if value is None else check_num_tokens(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


SPECULATIVE_HELP = "speculative decoding: ngram, draft or eagle (default: off)"
QUANTIZE_VOCAB_HELP = "also quantize the LM head and token embedding with --quantization's scheme"
NUM_SPECULATIVE_HELP = "the most tokens drafted per request and step (1-16, default 4)"
SPECULATIVE_MODEL_HELP = "the draft checkpoint (draft) or EAGLE head (eagle) (default: the bundled one)"
ADAPTIVE_HELP = "always draft --num-speculative-tokens (default: adapt the length to acceptance)"


def checked(check):
    """A typer callback running one of `strata.moe_options`' checks on a given value (None: left to the config)."""
    def callback(value):
        try:
            return value if value is None else check(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return callback


def _moe_check(name: str):
    from strata import moe_options
    return checked(getattr(moe_options, name))


def serve(
    prefill: Optional[int] = typer.Option(None, "--prefill", help="prefill workers (default 1; 0 = decode only)"),
    decode: Optional[int] = typer.Option(None, "--decode", help="decode workers (default 1)"),
    model: Optional[str] = typer.Option(None, help="checkpoint folder or bundled model name (default: bundled)"),
    host: Optional[str] = typer.Option(None, help="interface to listen on (default 127.0.0.1)"),
    grpc_port: Optional[int] = typer.Option(None, "--grpc-port", help="router gRPC port (default 50051; 0 = free)"),
    http_port: Optional[int] = typer.Option(None, "--http-port",
                                            help="OpenAI HTTP port (default 8000; 0 = free; -1 = off)"),
    registry_port: Optional[int] = typer.Option(None, "--registry-port",
                                                help="the router's port for workers to register at (default 0 = "
                                                     "free; -1 = the gRPC port, shared with clients)"),
    redis_url: Optional[str] = typer.Option(None, "--redis-url", help="add a shared Redis tier"),
    kv_encryption_key_file: Optional[str] = typer.Option(
        None, "--kv-encryption-key-file", help="encrypt the workers' disk, Redis and S3 tiers at rest (AES-256-GCM) "
                                               "with this 32-byte key (raw, or 64 hex characters)"),
    tier_quota_bytes: Optional[int] = typer.Option(
        None, "--tier-quota-bytes", help="bytes each namespace (tenant) may hold in each shared tier (0 = none)"),
    s3_url: Optional[str] = typer.Option(None, "--s3-url", callback=_check_s3_url,
                                         help="add a shared S3 tier: s3://BUCKET\\[/PREFIX] or "   # \\[: rich markup escape
                                              "http(s)://HOST:PORT/BUCKET\\[/PREFIX] (S3-compatible server)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="where disk tiers live (default: a temp dir)"),
    no_disk: bool = typer.Option(False, "--no-disk", help="host tier only"),
    transfer: Optional[str] = typer.Option(None, help="KV transfer backend: shm, tcp or nixl (default shm)"),
    policy: Optional[str] = typer.Option(None, help="routing policy: kv_aware, round_robin, least_loaded"),
    local_prefill_min_backlog_s: Optional[float] = typer.Option(
        None, "--local-prefill-min-backlog-s", help="while the prefill worker is at least this many seconds behind, "
        "long prompts may prefill on their decode worker (default: never)"),
    config: Optional[str] = typer.Option(None, "--config", help="YAML file with these options as keys"),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="workers' log level (default WARNING)"),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="workers do not compile the decode step"),
    quantization: Optional[str] = typer.Option(None, "--quantization",
                                               help="weights: int8, int4, fp8 or mxfp4 (default: the checkpoint's)"),
    quant_group_size: Optional[int] = typer.Option(None, "--quant-group-size", help="int4 group size: 32, 64, 128"),
    quantize_vocab: bool = typer.Option(False, "--quantize-vocab", help=QUANTIZE_VOCAB_HELP),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype", help="KV cache: auto, fp8 or int8"),
    speculative: Optional[str] = typer.Option(None, "--speculative", callback=check_speculative,
                                              help=f"decode workers' {SPECULATIVE_HELP}"),
    num_speculative_tokens: Optional[int] = typer.Option(None, "--num-speculative-tokens",
                                                         callback=check_num_speculative_tokens,
                                                         help=NUM_SPECULATIVE_HELP),
    speculative_model: Optional[str] = typer.Option(None, "--speculative-model", help=SPECULATIVE_MODEL_HELP),
    no_speculative_adaptive: bool = typer.Option(False, "--no-speculative-adaptive", help=ADAPTIVE_HELP),
    expert_parallel: Optional[int] = typer.Option(
        None, "--expert-parallel", callback=_moe_check("check_expert_parallel"),
        help="each prefill and decode worker runs as N ranks on this host, MoE experts sharded (default 1)"),
    moe_capacity_factor: Optional[float] = typer.Option(
        None, "--moe-capacity-factor", callback=_moe_check("check_capacity_factor"),
        help="each expert takes at most F x its even share of a step's tokens (default: no limit)"),
    moe_overflow: Optional[str] = typer.Option(None, "--moe-overflow", callback=_moe_check("check_overflow"),
                                               help="tokens past an expert's capacity: drop or next (default drop)"),
    num_redundant_experts: Optional[int] = typer.Option(
        None, "--num-redundant-experts", callback=_moe_check("check_num_redundant_experts"),
        help="spare expert slots per rank for replicas of hot experts (default 0)"),
    eplb_interval: Optional[int] = typer.Option(None, "--eplb-interval", callback=_moe_check("check_eplb_interval"),
                                                help="forwards between expert rebalances (default 0: never)"),
    eplb_window: Optional[int] = typer.Option(None, "--eplb-window", callback=_moe_check("check_eplb_window"),
                                              help="forwards of expert load the rebalancer looks at (default 200)"),
    api_key: list[str] = typer.Option([], "--api-key", help="a client API key (repeatable; tenant 'default'): "
                                                            "every gRPC call and /v1 route then needs it"),
    api_keys_file: Optional[str] = typer.Option(None, "--api-keys-file",
                                                help="client API keys, one `tenant:key` a line (`#` comments); each "
                                                     "tenant's prefix cache is its own"),
    cluster_secret_file: Optional[str] = typer.Option(None, "--cluster-secret-file",
                                                      help="the fleet secret router and workers share (default: "
                                                           "$STRATA_CLUSTER_SECRET, else a random one per launch)"),
    fleet_tls_cert_file: Optional[str] = typer.Option(
        None, "--fleet-tls-cert-file", help="fleet TLS on every internal link (mTLS to workers, TLS to the router, "
                                            "tcp transfers over TLS): every part's certificate, signed by the fleet CA "
                                            "and naming --host"),
    fleet_tls_key_file: Optional[str] = typer.Option(None, "--fleet-tls-key-file", help="fleet TLS: its private key"),
    fleet_tls_ca_file: Optional[str] = typer.Option(None, "--fleet-tls-ca-file",
                                                    help="fleet TLS: the fleet CA; clients of the router's gRPC port "
                                                         "verify it with this CA too"),
    ray: bool = typer.Option(False, "--ray", help="run the router and the pools as Ray actors (on the cluster at "
                                                  "--address, else a new local one)"),
    address: Optional[str] = typer.Option(None, "--address", help="with --ray: the Ray cluster (auto, "
                                                                  "ray://HOST:PORT or HOST:PORT; default "
                                                                  "$RAY_ADDRESS, else a new local cluster)"),
    ray_namespace: str = typer.Option("strata", "--ray-namespace", help="with --ray: the namespace its actors are "
                                                                        "named in (one Strata cluster each)"),
    ray_cpus_per_worker: float = typer.Option(1.0, "--ray-cpus-per-worker", help="with --ray: CPUs each worker's "
                                                                                 "rank reserves"),
    ray_gpus_per_worker: Optional[float] = typer.Option(None, "--ray-gpus-per-worker",
                                                        help="with --ray: GPUs each worker's rank reserves "
                                                             "(default: 1 where the cluster has GPUs, else 0)"),
) -> None:
    """Start a router and its prefill/decode workers; stop them all on Ctrl-C or SIGTERM."""
    from strata.launcher import LaunchError, LocalLauncher, ServeConfig

    overrides = dict(prefill=prefill, decode=decode, model=model, host=host, grpc_port=grpc_port, http_port=http_port,
                     registry_port=registry_port, redis_url=redis_url, s3_url=s3_url, data_dir=data_dir,
                     transfer=transfer, policy=policy, local_prefill_min_backlog_s=local_prefill_min_backlog_s,
                     log_level=log_level, disk_tier=False if no_disk else None,
                     enforce_eager=True if enforce_eager else None, quantization=quantization,
                     quant_group_size=quant_group_size, quantize_vocab=True if quantize_vocab else None,
                     kv_cache_dtype=kv_cache_dtype, speculative=speculative,
                     num_speculative_tokens=num_speculative_tokens, speculative_model=speculative_model,
                     speculative_adaptive=False if no_speculative_adaptive else None,
                     expert_parallel=expert_parallel, moe_capacity_factor=moe_capacity_factor,
                     moe_overflow=moe_overflow, num_redundant_experts=num_redundant_experts,
                     eplb_interval=eplb_interval, eplb_window=eplb_window,
                     kv_encryption_key_file=kv_encryption_key_file, tier_quota_bytes=tier_quota_bytes,
                     api_keys=tuple(api_key) or None, api_keys_file=api_keys_file,
                     cluster_secret_file=cluster_secret_file, fleet_tls_cert_file=fleet_tls_cert_file,
                     fleet_tls_key_file=fleet_tls_key_file, fleet_tls_ca_file=fleet_tls_ca_file)
    try:
        cfg = ServeConfig.from_file(config, **overrides) if config else ServeConfig.from_mapping({}, **overrides)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if address and not ray:
        typer.echo("error: --address needs --ray (it names the Ray cluster)", err=True)
        raise typer.Exit(2)
    stop = threading.Event()
    if ray:
        from strata.ray_launcher import RayLauncher, RayOptions

        try:
            options = RayOptions(address=address or "", namespace=ray_namespace,
                                 cpus_per_worker=ray_cpus_per_worker, gpus_per_worker=ray_gpus_per_worker)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
        launcher = RayLauncher(cfg, log=sys.stderr, env=fleet_secret_env(cfg), options=options)
    else:
        launcher = LocalLauncher(cfg, log=sys.stderr, env=fleet_secret_env(cfg))

    def on_signal(*_) -> None:
        stop.set()
        if hasattr(launcher, "interrupt"):
            launcher.interrupt()  # Ctrl-C while starting: stop now, not once every part is up

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install()
    code = 0
    try:
        info = launcher.start()
        install()  # NOTE: again: ray.init() installs handlers of its own that end the driver without a drain
        print(banner(info, cfg, ray_namespace if ray else None), flush=True)
        exited = launcher.wait(stop)
        if exited is not None:
            typer.echo(f"error: {exited[0]} exited with code {exited[1]}; stopping the cluster", err=True)
            code = exit_code_of(exited[1])
    except LaunchError as exc:
        typer.echo(f"error: {exc}", err=True)
        code = exit_code_of(exc.exit_code)
    finally:
        launcher.stop()
    raise typer.Exit(code)


def fleet_secret_env(cfg) -> dict[str, str]:
    """A fresh random fleet secret for this launch's parts (in their environment, never on a command line), unless
    one is given (`--cluster-secret-file`, or $STRATA_CLUSTER_SECRET to let workers started elsewhere join)."""
    import os
    import secrets

    from worker_common.grpc_auth import SECRET_ENV

    if cfg.cluster_secret_file or os.environ.get(SECRET_ENV):
        return {}
    return {SECRET_ENV: secrets.token_hex(32)}


def exit_code_of(part_code: int | None) -> int:
    """`strata serve` exits with the failed part's own status (1 when it has none: killed by a signal, exited 0, or
    still running without a READY line), so a script sees a usage error (2) as one."""
    return part_code if part_code is not None and 0 < part_code < 256 else 1



def scale(
    role: str = typer.Argument(..., help="prefill or decode"),
    n: int = typer.Argument(..., help="the pool's new number of workers"),
    address: Optional[str] = typer.Option(None, "--address", help="the Ray cluster (default $RAY_ADDRESS, else "
                                                                  "auto: the one running on this machine)"),
    ray_namespace: str = typer.Option("strata", "--ray-namespace", help="the namespace `strata serve --ray` used"),
) -> None:
    """Grow or shrink a pool of a cluster started with `strata serve --ray`, while it serves. Removed workers are
    drained first: they leave routing, finish what is in flight, deregister, and only then stop."""
    import os

    from strata.ray_launcher import RayOptions, scale as scale_pool

    if role not in ("prefill", "decode"):
        raise typer.BadParameter(f"must be prefill or decode, got {role!r}", param_hint="ROLE")
    try:
        options = RayOptions(address=address or os.environ.get("RAY_ADDRESS", "auto"), namespace=ray_namespace)
        names = scale_pool(role, n, options)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{role} pool: {len(names)} workers ({', '.join(names) or 'none'})")
