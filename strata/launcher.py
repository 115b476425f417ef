"""Launchers: start a router and its prefill/decode workers, wait until they serve, stop them all (DESIGN §9).

`LocalLauncher` runs every part as a local process (what `strata serve` does): the router first, then the workers
in parallel, each with host + disk tiers (and Redis / S3 when given), registering with the router (`--router`: its
registry port, `ServeConfig.registry_port`) and publishing their KV events to it. Every child's output is printed
with its name in front; the launcher waits for each READY line, then until the router lists every worker READY. A
part that exits during start-up ends the start at once (`LaunchError` with its name, exit code and last lines of
output), whichever part the launcher was waiting for.
`stop()` (Ctrl-C, SIGTERM) ends every child and whatever it started (each child leads its own process group):
SIGTERM, a grace period, then SIGKILL; children also die with the launcher (Linux PDEATHSIG).

A Ray launcher will implement the same small `Launcher` interface (actors instead of processes).

    with LocalLauncher(ServeConfig(prefill=1, decode=1, grpc_port=0, http_port=0)) as cluster:
        print(cluster.info.grpc_address, cluster.info.http_url)
"""
from __future__ import annotations

import abc
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from engine.config import CacheConfig, ModelConfig
from strata import moe_options
from strata.speculative_options import DEFAULT_NUM_SPECULATIVE_TOKENS, speculative_config, worker_args
from worker_common.config import TRANSFER_BACKENDS
from worker_common.fleet_tls import FleetTls
from worker_common.grpc_auth import SECRET_ENV, read_cluster_secret
from worker_common.store_setup import s3_config

REPO_ROOT = Path(__file__).resolve().parent.parent
# NOTE: children are started with fork(); gRPC's fork support is turned off in `strata/__init__.py` (why: there).

WORKER_READY = re.compile(r"^READY (\S+) role=(\w+) worker_id=(\S+)")
ROUTER_READY = re.compile(r"^READY grpc=(\S+) http=(\S*)(?: registry=(\S+))?")
_STOP_GRACE_S = 10.0
_ROUTER_DRAIN_GRACE_S = 40.0   # the router's default --drain-timeout-s (30 s), and its own exit


def registry_of(router_ready: re.Match) -> str:
    """Where workers register, from the router's READY line: its `registry=` field, else (a router that prints
    none) its gRPC address."""
    return router_ready.group(3) or router_ready.group(1)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ServeConfig:
    """What `strata serve` starts. `data_dir` empty = a temporary folder (disk tiers), removed on stop.
    `local_prefill_max_tokens`: prompts with at most this many uncached tokens prefill on their decode worker.
    `local_prefill_min_backlog_s`: and longer prompts too, where that scores better, while the prefill worker is at
    least this many seconds behind (None: never; conditional disaggregation under load, `router.policy`).
    `register_workers`: workers register with the router and publish KV events to it (`--router`); False = the
    router probes their addresses instead (`--worker`; no KV events, so no prefix-aware routing).
    `speculative` (ngram, draft, eagle; None = off), `num_speculative_tokens`, `speculative_model`,
    `speculative_adaptive`: the decode workers' speculative decoding (prefill workers never speculate).
    `expert_parallel` (each prefill and decode worker runs as that many ranks; rank 0 registers and serves the
    group), `moe_capacity_factor`, `moe_overflow`, `num_redundant_experts`, `eplb_interval`, `eplb_window`: both
    roles' sparse layers (`strata.moe_options`).
    `api_keys` / `api_keys_file`: the router's client API keys (`router.auth`; none = open doors).
    `cluster_secret_file`: the fleet secret handed to every part in $STRATA_CLUSTER_SECRET (empty: whatever the
    environment holds; `strata serve` draws a random one when it holds none).
    `fleet_tls_cert_file` / `fleet_tls_key_file` / `fleet_tls_ca_file`: fleet TLS on every part (all three or none;
    `worker_common.fleet_tls`): the certificate must name `host`. The router's gRPC port then speaks TLS too
    (clients verify it with the fleet CA), and its registry port mTLS.
    `registry_port`: the router's port for the workers' Registry (`router.grpc_ports`; 0 = a free one, -1 = the
    gRPC port, shared with clients as before); registering workers are pointed at it."""

    model: str | None = None
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    registry_port: int = 0
    transfer: str = "shm"
    policy: str = "kv_aware"
    local_prefill_max_tokens: int | None = 64
    local_prefill_min_backlog_s: float | None = None
    num_blocks: int = 1024
    host_tier_mib: int = 256
    handoff_mib: int = 64
    disk_tier: bool = True
    data_dir: str = ""
    redis_url: str = ""
    s3_url: str = ""
    kv_encryption_key_file: str = ""    # workers' disk, Redis and S3 tiers sealed at rest with this key
    tier_quota_bytes: int = 0           # bytes per namespace (tenant) in each shared tier; 0 = none
    api_keys: tuple[str, ...] = field(default=(), repr=False)   # the router's --api-key (tenant "default")
    api_keys_file: str = ""             # the router's --api-keys-file (`tenant:key` lines)
    cluster_secret_file: str = ""       # the fleet secret every part is handed ($STRATA_CLUSTER_SECRET)
    fleet_tls_cert_file: str = ""       # fleet TLS: every part's certificate, key and the fleet CA (PEM)
    fleet_tls_key_file: str = ""
    fleet_tls_ca_file: str = ""
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    log_level: str = "WARNING"
    ready_timeout_s: float = 300.0
    register_workers: bool = True
    enforce_eager: bool = False
    quantization: str | None = None     # workers' weights: int8, int4, fp8, mxfp4 (None: the checkpoint's own)
    quant_group_size: int = 128
    quantize_vocab: bool = False        # workers quantize the LM head and embedding too (part of the namespace)
    kv_cache_dtype: str = "auto"        # auto, fp8 or int8: workers' KV cache and the router's block namespace
    speculative: str | None = None
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    speculative_model: str | None = None
    speculative_adaptive: bool = True
    expert_parallel: int = 1
    moe_capacity_factor: float | None = None
    moe_overflow: str = "drop"
    num_redundant_experts: int = 0
    eplb_interval: int = 0
    eplb_window: int = 200

    def __post_init__(self) -> None:
        _require(self.prefill >= 0, f"prefill must be >= 0 workers, got {self.prefill}")
        _require(self.decode >= 1, f"decode must be >= 1 worker, got {self.decode}")
        _require(0 <= self.grpc_port <= 65535, f"grpc_port must be in [0, 65535] (0 = free), got {self.grpc_port}")
        _require(-1 <= self.http_port <= 65535, f"http_port must be in [-1, 65535] (0 = free, -1 = off), "
                                                f"got {self.http_port}")
        _require(-1 <= self.registry_port <= 65535, f"registry_port must be in [-1, 65535] (0 = free, -1 = on the "
                                                    f"gRPC port), got {self.registry_port}")
        _require(self.transfer in TRANSFER_BACKENDS,
                 f"transfer must be one of {', '.join(TRANSFER_BACKENDS)}, got {self.transfer!r}")
        _require(not self.redis_url or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
                 f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if self.s3_url:
            s3_config(self.s3_url)  # NOTE: here, in the parent: a bad bucket name fails before any process starts
        _require(self.local_prefill_min_backlog_s is None or self.local_prefill_min_backlog_s >= 0,
                 f"local_prefill_min_backlog_s must be >= 0 seconds (or unset: never), got "
                 f"{self.local_prefill_min_backlog_s}")
        _require(self.tier_quota_bytes >= 0, f"tier_quota_bytes must be >= 0 (0 = none), got {self.tier_quota_bytes}")
        if self.kv_encryption_key_file:
            from kvstore.sealing import load_key  # lazy: cryptography loads only where encryption is on
            load_key(self.kv_encryption_key_file)  # NOTE: in the parent too: a bad key file fails before any start
        ModelConfig("-", quantization=self.quantization, quant_group_size=self.quant_group_size,
                    quantize_vocab=self.quantize_vocab)                                    # names the field
        CacheConfig(kv_cache_dtype=self.kv_cache_dtype)
        # NOTE: here, in the parent: a bad drafter (or a missing draft folder) fails before any process starts
        speculative_config(self.speculative, self.num_speculative_tokens, self.speculative_model,
                           self.speculative_adaptive)
        moe_options.check_options(self._moe_values())  # NOTE: in the parent too: before any process starts
        _require(self.ready_timeout_s > 0, f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")
        object.__setattr__(self, "worker_args", tuple(self.worker_args))
        object.__setattr__(self, "router_args", tuple(self.router_args))
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        self.client_keys()  # NOTE: in the parent too: a bad keys file fails before any process starts
        if self.cluster_secret_file:
            read_cluster_secret(self.cluster_secret_file)
        self.fleet_tls()  # NOTE: in the parent too: a missing or mismatched file fails before any process starts

    def fleet_tls(self) -> FleetTls:
        """The fleet TLS files, as absolute paths (the parts run in the repository root, not in our directory)."""
        files = [os.path.abspath(f) if f else "" for f in (self.fleet_tls_cert_file, self.fleet_tls_key_file,
                                                            self.fleet_tls_ca_file)]
        return FleetTls(*files)

    def client_keys(self):
        """The router's API keys (`router.auth.ApiKeys`; none: the public doors are open)."""
        from router.auth import ApiKeys  # lazy: the HTTP stack loads only where a router is started
        return ApiKeys.load(self.api_keys, [self.api_keys_file] if self.api_keys_file else [])

    def _moe_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name, _, _ in moe_options.OPTIONS}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], **overrides: Any) -> "ServeConfig":
        """A config file's keys (dashes or underscores), then `overrides` that are not None."""
        known = {f.name for f in dataclasses.fields(cls)}
        merged: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            _require(name in known, f"config key {key!r} is unknown; known keys: {sorted(known)}")
            merged[name] = value
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**merged)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "ServeConfig":
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        _require(isinstance(data, dict), f"{path}: the config file must hold a mapping of keys to values")
        return cls.from_mapping(data.get("serve", data), **overrides)


def quant_args(c: ServeConfig) -> list[str]:
    """The quantization flags the router and every worker take alike (the router needs them for the namespace)."""
    args = ["--kv-cache-dtype", c.kv_cache_dtype, "--quant-group-size", str(c.quant_group_size)]
    args += ["--quantize-vocab"] if c.quantize_vocab else []
    return args + (["--quantization", c.quantization] if c.quantization else [])


def speculative_args(c: ServeConfig) -> list[str]:
    """The decode workers' speculative decoding flags (prefill workers sample one token: they never speculate).
    The drafter's folder is resolved here, since the workers run in the repository root, not in our directory."""
    model = c.speculative_model and speculative_config(c.speculative, c.num_speculative_tokens,
                                                       c.speculative_model).draft_model
    return worker_args(c.speculative, c.num_speculative_tokens, str(Path(model).resolve()) if model else None,
                       c.speculative_adaptive)


def fleet_tls_args(c: ServeConfig) -> list[str]:
    """The fleet TLS flags the router and every worker take alike (none when it is off)."""
    tls = c.fleet_tls()
    if not tls.enabled:
        return []
    return ["--fleet-tls-cert-file", tls.cert_file, "--fleet-tls-key-file", tls.key_file,
            "--fleet-tls-ca-file", tls.ca_file]


def moe_args(c: ServeConfig) -> list[str]:
    """The expert-parallel and MoE flags both roles' workers take (only those away from their defaults)."""
    return moe_options.worker_args(c._moe_values())


def worker_args_of(c: ServeConfig, role: str, name: str, model: str, router_address: str, disk_path: str,
                   host: str | None = None) -> list[str]:
    """A prefill or decode worker's flags, for every launcher. `disk_path`: its disk tier ("" = none); `host`: the
    interface it binds (default `c.host`)."""
    args = ["--model", model, "--host", host or c.host, "--port", "0", "--worker-id", name, "--transfer", c.transfer,
            "--num-blocks", str(c.num_blocks), "--host-tier-mib", str(c.host_tier_mib),
            "--handoff-mib", str(c.handoff_mib), "--log-level", c.log_level,
            "--metrics-port", "0"]  # each worker's own /metrics, named on its READY line in the log
    if c.enforce_eager:
        args += ["--enforce-eager"]
    args += quant_args(c) + moe_args(c) + fleet_tls_args(c)
    if role == "decode":
        args += speculative_args(c)
    if disk_path:
        args += ["--disk-path", disk_path]
    if c.redis_url:
        args += ["--redis-url", c.redis_url]
    if c.s3_url:
        args += ["--s3-url", c.s3_url]
    if c.kv_encryption_key_file:
        args += ["--kv-encryption-key-file", os.path.abspath(c.kv_encryption_key_file)]
    if c.tier_quota_bytes:
        args += ["--tier-quota-bytes", str(c.tier_quota_bytes)]
    if router_address:
        args += ["--router", router_address]
    return args + list(c.worker_args)


def router_args_of(c: ServeConfig, model: str, worker_addresses: list[str], key_args: list[str],
                   host: str | None = None) -> list[str]:
    """The router's flags, for every launcher. `key_args`: its API-key flags; `host`: the interface it binds
    (default `c.host`)."""
    args = ["--model", model, "--host", host or c.host, "--grpc-port", str(c.grpc_port),
            "--http-port", str(c.http_port), "--registry-port", str(c.registry_port), "--policy", c.policy,
            "--log-level", "INFO" if c.log_level.upper() in ("DEBUG", "INFO") else "WARNING"]
    args += quant_args(c) + fleet_tls_args(c)
    if c.local_prefill_max_tokens is not None:
        args += ["--local-prefill-max-tokens", str(c.local_prefill_max_tokens)]
    if c.local_prefill_min_backlog_s is not None:
        args += ["--local-prefill-min-backlog-s", repr(float(c.local_prefill_min_backlog_s))]
    for address in worker_addresses:
        args += ["--worker", address]
    return args + key_args + list(c.router_args)


@dataclass(frozen=True)
class Endpoint:
    name: str
    role: str          # "router", "prefill", "decode"
    address: str       # gRPC host:port
    pid: int


@dataclass(frozen=True)
class ClusterInfo:
    grpc_address: str
    http_url: str                       # "" when the HTTP API is off
    model: str
    processes: tuple[Endpoint, ...] = field(default_factory=tuple)
    registry_address: str = ""          # where workers register: the router's registry port, or `grpc_address`


class LaunchError(RuntimeError):
    """A part did not start; the message carries the tail of its output. `part`: its name; `exit_code`: its exit
    status when it exited (negative: killed by that signal), None when it is still running (no READY in time)."""

    def __init__(self, message: str, part: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.part, self.exit_code = part, exit_code


class Launcher(abc.ABC):
    """Starts a cluster and stops it. Contract: after `start()` returns, the router answers on `grpc_address`
    and every worker is registered with it; `stop()` is idempotent and leaves no process behind; `wait()` blocks
    until a part exits on its own (its name and exit code) or `stop_event` is set (None)."""

    @abc.abstractmethod
    def start(self) -> ClusterInfo: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def wait(self, stop_event: threading.Event) -> tuple[str, int] | None: ...

    def __enter__(self) -> "Launcher":
        self.info = self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def router_client(c: ServeConfig, grpc_address: str, timeout_s: float = 5.0):
    """A `StrataClient` of the router as a launcher calls it (its API key, fleet TLS)."""
    from strata.client import StrataClient

    tls = c.fleet_tls()
    return StrataClient(grpc_address, timeout_s=timeout_s, api_key=c.client_keys().any_key(), ca_file="",
                        credentials=tls.channel_credentials() if tls.enabled else None)


def wait_workers(c: ServeConfig, grpc_address: str, done: Callable[[set[str]], bool], timeout_s: float,
                 check: Callable[[], None] = lambda: None, expected: str = "") -> None:
    """Until `done(ids the router lists READY)` (registered, or found by its probe); `check` raises to end the
    wait early (a part exited)."""
    from strata.v1 import common_pb2

    deadline, ready = time.monotonic() + timeout_s, set()
    with router_client(c, grpc_address) as client:
        while not done(ready):
            check()
            if time.monotonic() > deadline:
                raise LaunchError(f"the router at {grpc_address} lists {sorted(ready)} READY after "
                                  f"{timeout_s:.0f}s; {expected}")
            time.sleep(0.2)
            try:
                ready = {w.id for w in client.workers() if w.state == common_pb2.WORKER_STATE_READY}
            except Exception:  # noqa: BLE001 - the router may still be binding; the deadline bounds this
                pass


# ----------------------------------------------------------------------------------------------------- local

def _child_setup(death_signal: int = signal.SIGTERM) -> None:
    """In the child, before exec: lead a process group of its own (so `stop()` reaches what it starts, and a
    terminal's Ctrl-C reaches only the launcher, which stops the parts in order), and get `death_signal` when the
    launcher dies, even by SIGKILL (Linux PDEATHSIG)."""
    os.setpgid(0, 0)
    if sys.platform != "linux":
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, death_signal)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class _Child:
    """One process: its output pumped line by line to the log with its name in front, READY lines noticed."""

    def __init__(self, name: str, role: str, argv: list[str], log: TextIO, ready: re.Pattern,
                 env: Mapping[str, str], death_signal: int = signal.SIGTERM) -> None:
        self.name, self.role, self.ready_pattern, self.log = name, role, ready, log
        self.tail: list[str] = []
        self.ready_match: re.Match | None = None
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=dict(env), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     preexec_fn=lambda: _child_setup(death_signal))
        self._pump = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail = (self.tail + [line])[-40:]
            if self.ready_match is None and (m := self.ready_pattern.match(line)):
                self.ready_match = m
            try:
                self.log.write(f"{self.name:<10}| {line}\n")
                self.log.flush()
            except ValueError:  # the log was closed under us at shutdown
                pass

    def failure(self, waited_s: float) -> LaunchError:
        """Why this part did not start: it exited (its code), or printed no READY line in `waited_s`."""
        code = self.proc.poll()
        if code is None:
            why = f"printed no READY line in {waited_s:.0f}s"
        else:
            # NOTE: bounded: a process it started may still hold the pipe open, so EOF may never come.
            self._pump.join(timeout=2)
            why = f"exited with code {code} during start-up"
        return LaunchError(f"{self.name} {why}; the last lines of its output:\n" + "\n".join(self.tail[-20:]),
                           self.name, code)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(5)
        self._signal_group(signal.SIGKILL)  # whatever it started and left behind
        self._pump.join(timeout=2)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its group id is its pid (`_child_setup`)
        except ProcessLookupError:
            pass  # nobody left in the group
        except PermissionError:  # the id now names a group that is not ours (reused): signal the child alone
            if self.alive:
                self.proc.send_signal(sig)


class LocalLauncher(Launcher):
    def __init__(self, config: ServeConfig, log: TextIO | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.log = log or sys.stderr
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
        if config.cluster_secret_file:  # NOTE: handed down in the environment, never on a command line
            environ[SECRET_ENV] = read_cluster_secret(config.cluster_secret_file)
        self.env = environ
        self._keys_file = ""            # the router's --api-key values, in a private file of ours
        self.children: list[_Child] = []
        self._data_dir: Path | None = None
        self._owns_data_dir = False
        self._stopped = False
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """End a `start()` in progress (it raises LaunchError and stops what it started); safe from a signal
        handler. Children lead their own process groups, so a terminal's Ctrl-C reaches only the launcher."""
        self._interrupted.set()

    # ---- start --------------------------------------------------------------------------------------------------

    def start(self) -> ClusterInfo:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> ClusterInfo:
        from strata.paths import resolve_model

        c = self.config
        model = resolve_model(c.model)
        self._prepare_data_dir()
        # NOTE: registering workers need the router's address first; probed ones are named to the router instead.
        router = self._spawn_router(model, []) if c.register_workers else None
        router_match = self._wait_ready([router], c.ready_timeout_s)[0] if router is not None else None
        registry_address = registry_of(router_match) if router_match is not None else ""
        workers = [self._spawn_worker(role, i, model, registry_address)
                   for role, n in (("prefill", c.prefill), ("decode", c.decode)) for i in range(n)]
        endpoints = [Endpoint(m.group(3), child.role, m.group(1), child.proc.pid)
                     for child, m in zip(workers, self._wait_ready(workers, c.ready_timeout_s))]
        if router is None:
            router = self._spawn_router(model, [e.address for e in endpoints])
            router_match = self._wait_ready([router], c.ready_timeout_s)[0]
        grpc_address, http = router_match.group(1), router_match.group(2)
        info = ClusterInfo(grpc_address, f"http://{http}" if http else "", Path(model).name,
                           (Endpoint("router", "router", grpc_address, router.proc.pid), *endpoints),
                           registry_of(router_match))
        self._wait_registered(grpc_address, [e.name for e in endpoints])  # ListWorkers: the public port
        return info

    def _wait_ready(self, waiting: list[_Child], timeout_s: float) -> list[re.Match]:
        """Until each of `waiting` printed its READY line, in parallel. Any part of this cluster that exits meanwhile
        (one of these, or one already READY, such as the router) ends the wait at once."""
        deadline = time.monotonic() + timeout_s
        while not all(child.ready_match for child in waiting):
            self._raise_if_one_exited()
            if time.monotonic() > deadline:
                raise next(child for child in waiting if child.ready_match is None).failure(timeout_s)
            time.sleep(0.1)
        return [child.ready_match for child in waiting]

    def _raise_if_one_exited(self) -> None:
        """During start-up every part should be running: the first one that is not is the launch's error."""
        if self._interrupted.is_set():
            raise LaunchError("interrupted while starting")
        for child in self.children:
            if not child.alive:
                raise child.failure(0)

    def _prepare_data_dir(self) -> None:
        if self.config.data_dir:
            self._data_dir = Path(self.config.data_dir)
            self._data_dir.mkdir(parents=True, exist_ok=True)
        else:
            self._data_dir, self._owns_data_dir = Path(tempfile.mkdtemp(prefix="strata-serve-")), True

    def _spawn(self, name: str, role: str, module: str, args: list[str], ready: re.Pattern) -> _Child:
        child = _Child(name, role, [sys.executable, "-m", module, *args], self.log, ready, self.env)
        self.children.append(child)
        self.log.write(f"{'strata':<10}| started {name} (pid {child.proc.pid})\n")
        return child

    def _spawn_worker(self, role: str, i: int, model: str, router_address: str) -> _Child:
        c, name = self.config, f"{role}-{i}"
        disk = ""
        if c.disk_tier:
            assert self._data_dir is not None
            disk = str(self._data_dir / name / "disk")
            Path(disk).mkdir(parents=True, exist_ok=True)
        return self._spawn(name, role, f"{role}_worker", worker_args_of(c, role, name, model, router_address, disk),
                           WORKER_READY)

    def _spawn_router(self, model: str, worker_addresses: list[str]) -> _Child:
        return self._spawn("router", "router", "router",
                           router_args_of(self.config, model, worker_addresses, self._key_args()), ROUTER_READY)

    def _key_args(self) -> list[str]:
        """The router's API keys: its keys file, and the `api_keys` written to a private file of ours (0600,
        removed on stop), never on a command line that `ps` shows."""
        from router.auth import DEFAULT_TENANT

        c = self.config
        args = ["--api-keys-file", os.path.abspath(c.api_keys_file)] if c.api_keys_file else []
        if c.api_keys:
            fd, self._keys_file = tempfile.mkstemp(prefix="strata-api-keys-")
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"{DEFAULT_TENANT}:{key}\n" for key in c.api_keys))
            args += ["--api-keys-file", self._keys_file]
        return args

    def _wait_registered(self, grpc_address: str, worker_ids: list[str], timeout_s: float = 60.0) -> None:
        wait_workers(self.config, grpc_address, lambda ready: set(worker_ids) <= ready, timeout_s,
                     self._raise_if_one_exited, f"expected {sorted(worker_ids)}")

    # ---- run and stop -------------------------------------------------------------------------------------------

    def wait(self, stop_event: threading.Event) -> tuple[str, int] | None:
        while not stop_event.wait(0.5):
            for child in self.children:
                code = child.proc.poll()
                # NOTE: a signal meant for everyone (`kill -- -PGID` of the launcher's group, a session's hangup)
                # may reach a child before our own handler runs: give `stop_event` a moment to say so.
                if code is not None and not stop_event.wait(1.0):
                    return child.name, code
        return None

    def stop(self) -> None:
        """SIGTERM the router first and let it drain (it refuses new requests and finishes those in flight, up
        to its --drain-timeout-s), then the workers; SIGKILL whoever outlives the grace."""
        if self._stopped:
            return
        self._stopped = True
        routers = [ch for ch in self.children if ch.role == "router"]
        for child in routers:
            child.terminate()
        for child in routers:
            child.reap(time.monotonic() + _ROUTER_DRAIN_GRACE_S)
        deadline = time.monotonic() + _STOP_GRACE_S
        workers = [ch for ch in self.children if ch.role != "router"]
        for child in workers:
            child.terminate()
        for child in workers:
            child.reap(deadline)
        if self._keys_file:
            Path(self._keys_file).unlink(missing_ok=True)
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        try:
            self.log.write(f"{'strata':<10}| stopped {len(self.children)} processes\n")
            self.log.flush()
        except ValueError:
            pass


LAUNCHERS: dict[str, Callable[..., Launcher]] = {"local": LocalLauncher}


def get_launcher(name: str) -> Callable[..., Launcher]:
    try:
        return LAUNCHERS[name]
    except KeyError:
        raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}, got {name!r}") from None
