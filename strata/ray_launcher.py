"""The Ray launcher: `strata serve --ray` runs the router and the prefill and decode pools as Ray actors.

The parts are the same processes with the same flags as `LocalLauncher`'s (`worker_args_of`, `router_args_of`): each
part is one `Part` actor that starts its process on the node Ray placed it on, prints its output to the actor's log
(the Ray dashboard and `ray logs` show it under the actor's name), and exits when its process does, so Ray restarts
the actor (`max_restarts`) and the new process registers with the router again.

    driver (strata serve --ray) ──> Controller actor "controller" (namespace "strata") ──owns──> Part actors
                                        │  "router", "prefill-0", "decode-0", ...: each in a placement group of its own
    strata scale decode 2 ─────────────>┘  (one bundle: the worker's CPUs and GPUs for all its expert-parallel ranks)

- Placement: a worker's placement group has one STRICT_PACK bundle holding every expert-parallel rank of the worker
  (the worker starts its ranks itself, on one host), with `gpus_per_worker` GPUs per rank where the cluster has GPUs.
  The router prefers the driver's node, so the addresses printed are where `strata serve --ray` runs.
- Addresses: parts bind the address of their node (or `--host` when it is not loopback) and advertise it, so parts on
  other nodes reach them. The model folder must be at the same path on every node (the container image has the
  bundled models at /opt/strata/models); small files the parts read (API keys, the encryption key, fleet TLS files)
  travel with the actor and are written, private, to the part's own folder on its node.
- Scaling down drains: the worker is sent SIGTERM, leaves the router's routing at once, finishes what is in flight
  (`--drain-timeout-s`), deregisters and exits; only then is its actor removed.
- The controller and the parts belong to the driver: when `strata serve --ray` exits, Ray removes them all.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvstore.transfer.segment import reap_orphaned_segments
from strata.launcher import (REPO_ROOT, ROUTER_READY, WORKER_READY, ClusterInfo, Endpoint, LaunchError, Launcher,
                             ServeConfig, _Child, registry_of, router_args_of, wait_workers, worker_args_of)

NAMESPACE = "strata"
CONTROLLER = "controller"
NODE_IP = "@NODE_IP@"             # in a part's flags: the address of the node the part runs on
PART_DIR = "@PART_DIR@"           # ... and that part's own folder there
API_KEYS = "@API_KEYS@"           # ... and its copy of the router's API keys
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_FILE_FLAGS = ("--kv-encryption-key-file", "--fleet-tls-cert-file", "--fleet-tls-key-file", "--fleet-tls-ca-file")
_STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class RayOptions:
    """How the parts run on Ray. `address`: the cluster (`auto`, `ray://HOST:PORT`, `HOST:PORT`; "" = $RAY_ADDRESS
    or a new local cluster); `namespace`: where the actors are named (one Strata cluster per namespace);
    `cpus_per_worker` / `gpus_per_worker`: each expert-parallel rank's bundle (GPUs None = 1 where the cluster has
    GPUs, else 0); `router_cpus`: the router's; `max_restarts`: Ray restarts a part that died this many times
    (-1 = always); `num_cpus`: a local cluster started here gets this many (None = Ray's count)."""

    address: str = ""
    namespace: str = NAMESPACE
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None
    router_cpus: float = 1.0
    max_restarts: int = -1
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.cpus_per_worker < 0 or (self.gpus_per_worker or 0) < 0 or self.router_cpus < 0:
            raise ValueError("cpus_per_worker, gpus_per_worker and router_cpus must be >= 0")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1 (-1 = always), got {self.max_restarts}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.namespace):
            raise ValueError(f"namespace must be letters, digits, '_', '.', '-', got {self.namespace!r}")


# ------------------------------------------------------------------------------------------------------ a part

class Part:
    """One part's process on the node Ray placed this actor on. A process that exits after it was READY takes the
    actor with it, so Ray restarts both (`max_restarts`); one that fails during start-up is reported by `ready()`."""

    def __init__(self, name: str, role: str, module: str, args: list[str], env: dict[str, str],
                 files: dict[str, bytes], run_id: str) -> None:
        import ray

        self.name, self.role = name, role
        self.node_ip = ray.util.get_node_ip_address()
        # NOTE: one folder per launch and part, the same after a restart: a restarted worker finds its disk tier
        self.dir = Path(tempfile.gettempdir()) / f"strata-ray-{run_id}" / name
        self.dir.mkdir(parents=True, exist_ok=True)
        local = {}
        for i, (key, data) in enumerate(sorted(files.items())):
            path = self.dir / f"file-{i}"
            path.write_bytes(data)
            path.chmod(0o600)
            local[key] = str(path)
        args = [local.get(a, a).replace(NODE_IP, self.node_ip).replace(PART_DIR, str(self.dir)) for a in args]
        if "--disk-path" in args:
            Path(args[args.index("--disk-path") + 1]).mkdir(parents=True, exist_ok=True)
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
        # NOTE: SIGKILL when this actor dies: a process left draining would deregister its restarted successor.
        self.child = _Child(name, role, [sys.executable, "-m", module, *args], sys.stdout,
                            ROUTER_READY if role == "router" else WORKER_READY, environ, death_signal=signal.SIGKILL)
        self.stopping = False
        with warnings.catch_warnings():   # NOTE: Ray's own property calls a deprecated one
            warnings.simplefilter("ignore")
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:   # the killed process left its shared-memory segments behind
            reap_orphaned_segments()
        _export_state(name, role, self.restarted)
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return self.name

    def _watch(self) -> None:
        code = self.child.proc.wait()
        if self.stopping or self.child.ready_match is None:
            return   # stopped by us, or failed while starting: `ready()` reports it
        print(f"{self.name} exited with code {code}; its actor exits so that Ray restarts it", flush=True)
        os._exit(1)

    def ready(self, timeout_s: float) -> dict[str, Any]:
        """Once the process printed its READY line: what it printed there, and where it runs. LaunchError when it
        exits first or prints nothing in `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.child.ready_match is None:
            if not self.child.alive or time.monotonic() > deadline:
                self.stopping = True
                raise self.child.failure(timeout_s)
            time.sleep(0.1)
        return {"groups": self.child.ready_match.groups(), "pid": self.child.proc.pid, "node_ip": self.node_ip,
                "restarted": self.restarted}

    def stop(self, grace_s: float = _STOP_GRACE_S) -> int | None:
        """SIGTERM (a worker drains: it leaves routing, finishes what is in flight, deregisters), SIGKILL after
        `grace_s`; the exit code."""
        self.stopping = True
        self.child.terminate()
        self.child.reap(time.monotonic() + grace_s)
        reap_orphaned_segments()   # a process killed after the grace cannot unlink its own
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.dir.parent.exists() and not any(self.dir.parent.iterdir()):
            self.dir.parent.rmdir()
        return self.child.proc.returncode


def _export_state(name: str, role: str, restarted: bool) -> None:
    """Ray's own metrics (the dashboard's Prometheus export): each part up, and its restarts."""
    try:
        from ray.util.metrics import Counter, Gauge

        tags = {"part": name, "role": role}
        Gauge("strata_part_up", "1 while this Strata part's actor runs", tag_keys=("part", "role")).set(1, tags)
        if restarted:
            Counter("strata_part_restarts", "Ray restarts of this Strata part",
                    tag_keys=("part", "role")).inc(1, tags)
    except Exception:  # noqa: BLE001 - metrics are best effort: a cluster without Ray's metrics agent still serves
        pass


# ------------------------------------------------------------------------------------------------ the controller

@dataclass
class _Placed:
    name: str
    role: str
    actor: Any
    group: Any                     # its placement group (None for the router)
    ready: dict[str, Any]


class Controller:
    """Starts, scales and stops one cluster's parts; named `controller` in the options' namespace, so that
    `strata scale` finds it. Calls may come in parallel (a threaded actor): one lock orders them."""

    def __init__(self, config: ServeConfig, options: RayOptions, env: dict[str, str], files: dict[str, bytes],
                 driver_node: str) -> None:
        self.config, self.options, self.env, self.files, self.driver_node = config, options, env, files, driver_node
        self.run_id = os.urandom(4).hex()
        self.parts: dict[str, _Placed] = {}
        self.info: ClusterInfo | None = None
        self.model = ""
        self._lock = threading.Lock()

    # ---- start ----------------------------------------------------------------------------------------------

    def start(self) -> ClusterInfo:
        import ray
        from strata.paths import resolve_model

        c = self.config
        with self._lock:
            self.model = resolve_model(c.model)
            router = self._router()
            groups = router.ready["groups"]
            registry = registry_of(_Match(groups))
            for role, n in (("prefill", c.prefill), ("decode", c.decode)):
                for i in range(n):
                    self._add_worker(role, i, registry, wait=False)
            pending = [p for p in self.parts.values() if p.role != "router"]
            for part, ready in zip(pending, ray.get([p.actor.ready.remote(c.ready_timeout_s) for p in pending])):
                part.ready = ready
            grpc_address, http = groups[0], groups[1]
            self.info = ClusterInfo(grpc_address, f"http://{http}" if http else "", Path(self.model).name, (),
                                    registry)
            self._wait_listed({p.name for p in pending})
            return self._info()

    def _info(self) -> ClusterInfo:
        assert self.info is not None
        endpoints = tuple(Endpoint(p.name, p.role, p.ready["groups"][0], p.ready["pid"]) for p in self.parts.values())
        return ClusterInfo(self.info.grpc_address, self.info.http_url, self.info.model, endpoints,
                           self.info.registry_address)

    def _bind(self) -> tuple[str, list[str]]:
        """The interface parts bind, and the worker flags that advertise it to the others."""
        host = self.config.host
        if host in _LOOPBACK:
            host = NODE_IP          # parts on other nodes must reach it
        events = ["--kv-events-endpoint", f"tcp://{host}:*", "--kv-replay-endpoint", f"tcp://{host}:*"]
        advertise = ["--advertise-host", NODE_IP] if host in ("0.0.0.0", "::", "*") else []
        return host, events + advertise

    def _router(self) -> _Placed:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        c = self.config
        host, _ = self._bind()
        keys = ["--api-keys-file", API_KEYS] if API_KEYS in self.files else []
        args = router_args_of(c, self.model, [], keys, host=host)
        actor = ray.remote(Part).options(
            name="router", namespace=self.options.namespace, num_cpus=self.options.router_cpus,
            max_restarts=self.options.max_restarts, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.driver_node, soft=True),
        ).remote("router", "router", "router", args, self.env, self.files, self.run_id)
        part = _Placed("router", "router", actor, None, {})
        self.parts["router"] = part
        part.ready = ray.get(actor.ready.remote(c.ready_timeout_s))
        return part

    def _gpus(self) -> float:
        import ray

        if self.options.gpus_per_worker is not None:
            return self.options.gpus_per_worker
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0

    def _add_worker(self, role: str, i: int, registry: str, wait: bool = True) -> _Placed:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, name = self.config, f"{role}-{i}"
        ranks = c.expert_parallel
        bundle = {"CPU": self.options.cpus_per_worker * ranks}
        gpus = self._gpus() * ranks
        if gpus:
            bundle["GPU"] = gpus
        group = placement_group([bundle], strategy="STRICT_PACK", name=f"{self.options.namespace}-{name}")
        try:
            ray.get(group.ready(), timeout=c.ready_timeout_s)
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError: the cluster lacks the resources
            ray.util.remove_placement_group(group)
            raise LaunchError(f"{name}: Ray could not place a bundle of {bundle} in {c.ready_timeout_s:.0f}s "
                              f"(cluster resources: {ray.cluster_resources()})", name) from exc
        host, extra = self._bind()
        disk = f"{c.data_dir.rstrip('/')}/{name}/disk" if c.data_dir else f"{PART_DIR}/disk"
        args = worker_args_of(c, role, name, self.model, registry, disk if c.disk_tier else "", host=host) + extra
        actor = ray.remote(Part).options(
            name=name, namespace=self.options.namespace, num_cpus=0, max_restarts=self.options.max_restarts,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        ).remote(name, role, f"{role}_worker", args, self.env, self.files, self.run_id)
        part = _Placed(name, role, actor, group, {})
        self.parts[name] = part
        if wait:
            part.ready = ray.get(actor.ready.remote(c.ready_timeout_s))
        return part

    def _wait_listed(self, names: set[str], timeout_s: float = 60.0) -> None:
        assert self.info is not None
        wait_workers(self.config, self.info.grpc_address, lambda ready: names <= ready, timeout_s,
                     expected=f"expected {sorted(names)}")

    # ---- run ------------------------------------------------------------------------------------------------

    def cluster_info(self) -> ClusterInfo:
        with self._lock:
            return self._info()

    def scale(self, role: str, n: int) -> list[str]:
        """Grow or shrink a pool to `n` workers while serving; the pool's worker names afterwards. New workers are
        READY at the router when this returns; removed ones drained first (nothing in flight on them fails)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if n < (1 if role == "decode" else 0):
            raise ValueError(f"a {role} pool needs at least {1 if role == 'decode' else 0} workers, got {n}")
        with self._lock:
            assert self.info is not None
            pool = sorted((p for p in self.parts.values() if p.role == role), key=lambda p: _index(p.name))
            if n > len(pool):
                used = {_index(p.name) for p in pool}
                fresh = [i for i in range(n + len(used)) if i not in used][:n - len(pool)]
                added = [self._add_worker(role, i, self.info.registry_address) for i in fresh]
                self._wait_listed({p.name for p in added})
            for part in reversed(pool[n:]):
                self._remove(part)
            return [p.name for p in sorted(self.parts.values(), key=lambda p: _index(p.name)) if p.role == role]

    def _remove(self, part: _Placed) -> None:
        import ray

        self.parts.pop(part.name, None)   # NOTE: first: `gone()` must not report the part it sees die here
        try:
            ray.get(part.actor.stop.remote(self.config_drain_s()), timeout=self.config_drain_s() + 30)
        finally:
            ray.kill(part.actor, no_restart=True)
            if part.group is not None:
                ray.util.remove_placement_group(part.group)

    def config_drain_s(self) -> float:
        """How long a removed worker may take to drain: its --drain-timeout-s (30 s unless the worker args say)."""
        args = list(self.config.worker_args)
        return float(args[args.index("--drain-timeout-s") + 1]) + 10 if "--drain-timeout-s" in args else 40.0

    def gone(self) -> tuple[str, int] | None:
        """A part Ray will not restart any more (its restarts used up): its name, and 1. A part being restarted
        answers late, not with an error."""
        import ray

        for p in list(self.parts.values()):   # NOTE: no lock: answers while a scale is under way
            try:
                ray.get(p.actor.ready.remote(1.0), timeout=5)
            except ray.exceptions.ActorDiedError:
                if self.parts.get(p.name) is p:   # not one that a scale or stop removed meanwhile
                    return p.name, 1
            except Exception:  # noqa: BLE001 - restarting, or busy: not gone
                pass
        return None

    def stop(self) -> None:
        """The router first (it drains), then the workers; every placement group removed."""
        import ray

        with self._lock:
            parts = sorted(self.parts.values(), key=lambda p: p.role != "router")
            self.parts.clear()   # NOTE: first, as in `_remove`
            for group in ([p for p in parts if p.role == "router"], [p for p in parts if p.role != "router"]):
                calls = [p.actor.stop.remote(40.0 if p.role == "router" else _STOP_GRACE_S) for p in group]
                for call in calls:
                    try:
                        ray.get(call, timeout=60)
                    except Exception:  # noqa: BLE001 - a part already gone: killed below anyway
                        pass
            for p in parts:
                ray.kill(p.actor, no_restart=True)
                if p.group is not None:
                    ray.util.remove_placement_group(p.group)


class _Match:
    """A READY line's groups as `registry_of` reads them."""

    def __init__(self, groups: tuple) -> None:
        self._groups = groups

    def group(self, i: int) -> str:
        return self._groups[i - 1]


def _index(name: str) -> int:
    return int(name.rsplit("-", 1)[1]) if name[-1].isdigit() else -1


# ----------------------------------------------------------------------------------------------------- driver side

def connect(options: RayOptions, min_cpus: float = 0) -> bool:
    """Join the cluster (or start a local one, with at least `min_cpus` logical CPUs: the parts' bundles, which may
    oversubscribe a small machine as the local launcher does); True when this call started Ray here (and so must
    shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": options.namespace, "log_to_driver": True, "configure_logging": False}
    address = options.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, **kwargs)
    else:
        cpus = options.num_cpus or max(os.cpu_count() or 1, math.ceil(min_cpus))
        ray.init(num_cpus=cpus, **kwargs)   # with Ray's dashboard where its packages are installed
    return True


def cpus_needed(config: ServeConfig, options: RayOptions) -> float:
    """The CPUs the parts' bundles reserve: the router's, and each worker's ranks'."""
    return options.router_cpus + (config.prefill + config.decode) * config.expert_parallel * options.cpus_per_worker


def controller(options: RayOptions):
    """The running cluster's controller actor (ValueError naming the namespace when there is none)."""
    import ray

    try:
        return ray.get_actor(CONTROLLER, namespace=options.namespace)
    except ValueError:
        raise ValueError(f"no Strata cluster runs in Ray namespace {options.namespace!r} (start one with "
                         f"`strata serve --ray`)") from None


def _files(config: ServeConfig) -> dict[str, bytes]:
    """What the parts read from files, to travel with them: each named by the path (or placeholder) in their flags."""
    from router.auth import DEFAULT_TENANT

    files = {}
    tls = config.fleet_tls()
    for path in (config.kv_encryption_key_file, tls.cert_file, tls.key_file, tls.ca_file):
        if path:
            files[os.path.abspath(path)] = Path(path).read_bytes()
    keys = "".join(f"{DEFAULT_TENANT}:{key}\n" for key in config.api_keys)
    if config.api_keys_file:
        keys += Path(config.api_keys_file).read_text()
    if keys:
        files[API_KEYS] = keys.encode()
    return files


class RayLauncher(Launcher):
    """`Launcher` on Ray: `start()` creates the controller actor and has it start every part."""

    def __init__(self, config: ServeConfig, log: TextIO | None = None, env: dict[str, str] | None = None,
                 options: RayOptions | None = None) -> None:
        self.config, self.log, self.env = config, log or sys.stderr, dict(env or {})
        self.options = options or RayOptions()
        if config.cluster_secret_file:
            from worker_common.grpc_auth import SECRET_ENV, read_cluster_secret
            self.env[SECRET_ENV] = read_cluster_secret(config.cluster_secret_file)
        self.controller = None
        self._started_ray = False
        self._stopped = False

    def start(self) -> ClusterInfo:
        import ray

        try:
            self._started_ray = connect(self.options, cpus_needed(self.config, self.options))
            driver_node = ray.get_runtime_context().get_node_id()
            self.controller = ray.remote(Controller).options(
                name=CONTROLLER, namespace=self.options.namespace, num_cpus=0, max_concurrency=16,
            ).remote(self.config, self.options, self.env, _files(self.config), driver_node)
            try:
                return ray.get(self.controller.start.remote())
            except ray.exceptions.RayTaskError as exc:
                cause = exc.as_instanceof_cause()
                raise LaunchError(str(cause)) if not isinstance(cause, LaunchError) else cause from None
        except BaseException:
            self.stop()
            raise

    def scale(self, role: str, n: int) -> list[str]:
        import ray

        return ray.get(self.controller.scale.remote(role, n))

    def wait(self, stop_event: threading.Event) -> tuple[str, int] | None:
        import ray

        while not stop_event.wait(1.0):
            try:
                gone = ray.get(self.controller.gone.remote(), timeout=120)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError:   # the controller itself is gone
                return CONTROLLER, 1
            if gone is not None:
                return gone
        return None

    def stop(self) -> None:
        import ray

        if self._stopped:
            return
        self._stopped = True
        if self.controller is not None:
            try:
                ray.get(self.controller.stop.remote(), timeout=120)
            except Exception:  # noqa: BLE001 - what is left dies with the controller below
                pass
            ray.kill(self.controller, no_restart=True)
        if self._started_ray:
            ray.shutdown()


def scale(role: str, n: int, options: RayOptions) -> list[str]:
    """`strata scale`: grow or shrink a running cluster's pool (from any process that reaches the Ray cluster)."""
    import ray

    connect(options)
    return ray.get(controller(options).scale.remote(role, n))

