"""The other ranks of an expert-parallel worker group, as rank 0 sees them: rank 0 (the process a user or launcher
started with `--expert-parallel N`) starts ranks 1..N-1 as its children on this host, reads each one's gRPC address
from its READY line, watches them, and stops them.

    python -m decode_worker --expert-parallel 2 --worker-id decode-0 --router R ...     rank 0: registers, serves
      └─ python -m decode_worker <the same argv> --ep-rank 1 --ep-init tcp://127.0.0.1:P --port 0 --host 127.0.0.1
             --worker-id decode-0-rank1 --router '' --metrics-port -1 [--disk-path PATH-rank1]
             --kv-events-endpoint tcp://127.0.0.1:* --kv-replay-endpoint tcp://127.0.0.1:*

A child's stdout comes through rank 0 with `ep-rank1| ` in front (its READY line too, so a launcher reading rank 0's
output never takes it for rank 0's own); its stderr (its log) is rank 0's. A child gets SIGTERM when rank 0 dies,
even by SIGKILL (Linux PDEATHSIG), and leads no process group of its own, so whatever stops rank 0's group (the
local launcher's `killpg`) stops it too. Every wait here is bounded.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from worker_common.config import WorkerConfig
from worker_common.launch import READY

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
RANK_READY = READY      # a rank prints the READY line every worker prints (worker_common.launch)
_POLL_S = 0.1
_STOP_GRACE_S = 10.0


class RankStartError(RuntimeError):
    """A rank exited, or printed no READY line in time, while the group was starting."""


class RankExit(NamedTuple):
    rank: int
    code: int                  # negative: killed by that signal


def free_loopback_port() -> int:
    """A port nobody listens on now, for the group's rendezvous (rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_worker_id(worker_id: str, rank: int) -> str:
    return f"{worker_id}-rank{rank}"


def rank_disk_path(path: str, rank: int) -> str:
    """Each rank keeps its own disk tier: a sibling folder `PATH-rank{r}` (inside PATH it would look like a shard)."""
    return f"{path.rstrip('/' + os.sep) or path}-rank{rank}" if path else ""


def rank_argv(argv: Sequence[str], config: WorkerConfig, rank: int) -> list[str]:
    """Rank `rank`'s command-line arguments: rank 0's own, then what differs (argparse: the last value wins).
    `config` is rank 0's, its `worker_id` and `ep_init` filled in."""
    local = "tcp://127.0.0.1:*"
    overrides = ["--ep-rank", str(rank), "--ep-init", config.ep_init, "--port", "0", "--host", "127.0.0.1",
                 "--worker-id", rank_worker_id(config.worker_id, rank), "--router", "", "--metrics-port", "-1",
                 "--kv-events-endpoint", local if config.kv_events_endpoint else "",
                 "--kv-replay-endpoint", local if config.kv_replay_endpoint else ""]
    if config.disk_path:
        overrides += ["--disk-path", rank_disk_path(config.disk_path, rank)]
    return [*argv, *overrides]


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def setup() -> None:
        """In the child, before exec: SIGTERM when rank 0 dies (PR_SET_PDEATHSIG = 1)."""
        if sys.platform == "linux":
            try:
                import ctypes
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
            except Exception:  # noqa: BLE001 - no prctl: rank 0 still stops its children itself
                pass
        if os.getppid() != parent_pid:   # rank 0 died before prctl: nobody would ever signal us
            os._exit(1)
    return setup


class RankProcess:
    """One child rank: its process, its stdout pumped line by line (to rank 0's stderr, prefixed), its READY."""

    def __init__(self, role: str, rank: int, argv: list[str]) -> None:
        self.rank = rank
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        # NOTE: PDEATHSIG fires when the *thread* that forked the child ends: spawn only from the main thread.
        self.proc = subprocess.Popen([sys.executable, "-m", f"{role}_worker", *argv], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=_die_with_parent(os.getpid()))
        self.address = self.worker_id = ""
        self.events_endpoint = self.replay_endpoint = ""       # its KV-event PUB and replay sockets ("" = none)
        self.ready = threading.Event()
        self._pump = threading.Thread(target=self._read, name=f"ep-rank{rank}-out", daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if not self.ready.is_set() and (match := RANK_READY.match(line)):
                self.address, self.worker_id = match.group(1), match.group(3)
                self.events_endpoint, self.replay_endpoint = match.group(6) or "", match.group(7) or ""
                self.ready.set()
            try:
                print(f"ep-rank{self.rank}| {line}", file=sys.stderr, flush=True)
            except (ValueError, OSError):  # our stderr is gone at shutdown
                pass

    def poll(self) -> int | None:
        return self.proc.poll()


class ChildRanks:
    """Ranks 1..N-1 of rank 0's group. Contract: `wait_ready` returns their addresses in rank order or raises
    `RankStartError` naming the rank; `watch` calls `on_exit` once, from its own thread, for the first rank that
    exits; `stop` ends them all (SIGTERM, a grace, SIGKILL) and is idempotent."""

    def __init__(self, role: str, argv: Sequence[str], config: WorkerConfig) -> None:
        self.world_size = config.expert_parallel
        self.ranks = [RankProcess(role, r, rank_argv(argv, config, r)) for r in range(1, self.world_size)]
        self._watching = threading.Event()
        self._stopped = False

    def describe(self, rank: int) -> str:
        return f"expert-parallel rank {rank} of {self.world_size}"

    def first_exit(self) -> RankExit | None:
        for child in self.ranks:
            code = child.poll()
            if code is not None:
                return RankExit(child.rank, code)
        return None

    def wait_exit(self, timeout_s: float) -> RankExit | None:
        """The first rank that exited, waiting up to `timeout_s` for one to (None: all still run)."""
        deadline = time.monotonic() + timeout_s
        while (exited := self.first_exit()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return exited

    def exit_reason(self, exited: RankExit) -> str:
        return f"{self.describe(exited.rank)} exited with code {exited.code}; failing the group"

    def alive(self, rank: int) -> bool:
        """Rank 0 is the caller itself: alive while it asks."""
        return rank == 0 or self.ranks[rank - 1].poll() is None

    def wait_ready(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        for child in self.ranks:
            while not child.ready.wait(_POLL_S):
                if (exited := self.first_exit()) is not None:
                    raise RankStartError(f"{self.describe(exited.rank)} exited with code {exited.code} during "
                                         "start-up (its log is above)")
                if time.monotonic() > deadline:
                    raise RankStartError(f"{self.describe(child.rank)} printed no READY line in {timeout_s:.0f}s")
        return [child.address for child in self.ranks]

    def watch(self, on_exit: Callable[[RankExit], None]) -> None:
        self._watching.set()
        threading.Thread(target=self._watch, args=(on_exit,), name="ep-ranks-watch", daemon=True).start()

    def _watch(self, on_exit: Callable[[RankExit], None]) -> None:
        while self._watching.is_set():
            exited = self.first_exit()
            if exited is not None:
                if self._watching.is_set():   # NOTE: not when `stop()` is what ended it
                    on_exit(exited)
                return
            time.sleep(_POLL_S)

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._watching.clear()
        for child in self.ranks:
            if child.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.ranks:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", self.describe(child.rank), grace_s)
                child.proc.kill()
                child.proc.wait(5)
            child._pump.join(timeout=2)
