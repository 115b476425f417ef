"""An owner agent in its own process, driven over a pipe: what the transfer benchmark and integration tests read from.

    with OwnerProcess("tcp", {"pool": 8 << 20}) as owner:
        handle = owner.handles["pool"]                       # RegionHandle, address of the child's agent
        lease = owner.grant("pool", [(0, 4096)], ttl_s=1.0)
        expected = region_bytes("pool", 8 << 20)               # the bytes the child wrote, recomputed here
        owner.kill()                                           # SIGKILL, for fault tests

Region contents are a pure function of (region_id, size), so readers check exact bytes without shipping them.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import zlib
from typing import Any, Sequence

import numpy as np

from kvstore.transfer.base import LeaseId, MemoryRegion, RegionHandle, TransferConfig, create_agent
from kvstore.transfer.segment import unlink_quietly


def region_bytes(region_id: str, nbytes: int) -> np.ndarray:
    """The deterministic contents of a test/benchmark region."""
    rng = np.random.default_rng(zlib.crc32(region_id.encode()))
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def _serve(config: TransferConfig, sizes: dict[str, int], conn: Any) -> None:
    agent = create_agent(config)
    regions = {rid: MemoryRegion.shared(rid, n) for rid, n in sizes.items()}
    handles = {}
    for rid, region in regions.items():
        np.frombuffer(region.buffer, np.uint8)[:] = region_bytes(rid, region.length)
        handles[rid] = tuple(agent.register(region))
    conn.send((os.getpid(), handles, [r.shm_name for r in regions.values()] + _control_names(agent)))
    while True:
        verb, args = conn.recv()
        if verb == "stop":
            break
        try:
            conn.send(("ok", getattr(agent, verb)(*args)))
        except Exception as e:  # noqa: BLE001 - the error goes back to the driving process, typed by name
            conn.send(("err", f"{type(e).__name__}: {e}"))
    agent.close()
    for region in regions.values():
        region.close()
    conn.send(("ok", None))


def _control_names(agent: Any) -> list[str]:
    ctl = getattr(agent, "_ctl", None)
    return [ctl.seg.name] if ctl is not None else []


def _all_threads_stopped(pid: int) -> bool:
    task_dir = f"/proc/{pid}/task"
    if not os.path.isdir(task_dir):  # no procfs (macOS): give the signal a moment instead
        time.sleep(0.05)
        return True
    states = []
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    return all(state in ("T", "t") for state in states)


class OwnerProcess:
    """Start with `start()` (or as a context manager); `stop()` closes cleanly, `kill()` SIGKILLs."""

    def __init__(self, backend: str, sizes: dict[str, int], config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig(backend=backend)
        self.sizes = dict(sizes)
        self.handles: dict[str, RegionHandle] = {}
        self.pid = 0
        self._shm_names: list[str] = []
        self._proc = None
        self._conn = None

    def start(self) -> OwnerProcess:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(self.config, self.sizes, child), daemon=True)
        self._proc.start()
        for _ in range(600):
            if self._conn.poll(0.1):
                break
            if not self._proc.is_alive():
                raise RuntimeError(f"owner process exited with code {self._proc.exitcode} before serving")
        else:
            raise RuntimeError("owner process did not start within 60 s")
        self.pid, handles, self._shm_names = self._conn.recv()
        self.handles = {rid: RegionHandle(*h) for rid, h in handles.items()}
        return self

    def call(self, verb: str, *args: Any) -> Any:
        self._conn.send((verb, args))
        status, value = self._conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value

    def grant(self, region_id: str, ranges: Sequence[tuple[int, int]], ttl_s: float) -> LeaseId:
        return LeaseId(self.call("grant_lease", region_id, list(ranges), ttl_s))

    def release(self, lease_id: int) -> bool:
        return self.call("release", lease_id)

    def unregister(self, region_id: str) -> None:
        self.call("unregister", region_id)

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread of the owner has stopped (delivery is asynchronous)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not _all_threads_stopped(self.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join(10)

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            try:
                self.resume()
                self._conn.send(("stop", ()))
                self._conn.poll(10) and self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(10)
        for name in self._shm_names:  # a killed owner leaves its segments behind
            unlink_quietly(name)
        self._proc = None

    def __enter__(self) -> OwnerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
