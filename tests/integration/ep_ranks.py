"""Run an expert-parallel group as real processes for tests: `run_group(world, target, *args)` spawns `world`
processes, each joins one `EPGroup` and calls `target(group, rank, *args)`; their results come back in rank order.

`target` must be a module-level function (spawned processes import it by name).
"""
from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

from engine.moe.ep_group import EPGroup, EPGroupSpec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, target: Callable, args: tuple, results: mp.Queue,
               shm_bytes: int, backend: str) -> None:
    import torch
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    group = EPGroup.init(EPGroupSpec(world, rank, f"tcp://127.0.0.1:{port}", timeout_s=120.0, shm_bytes=shm_bytes,
                                     backend=backend, device=device))
    try:
        # NOTE: pickled by value here: a tensor put on the queue as is travels as a file descriptor that dies with
        # this process, which may exit before the parent reads it
        results.put((rank, "ok", pickle.dumps(target(group, rank, *args))))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", traceback.format_exc()))
    finally:
        group.close()


def run_group(world: int, target: Callable, *args: Any, timeout_s: float = 300.0,
              expect: tuple[int, ...] | None = None, shm_bytes: int = 8 << 20, backend: str = "gloo") -> list[Any]:
    """Results in rank order; `expect`: the ranks that report (a test may make the others die), None = all;
    `shm_bytes`: the group's shared-memory buffers (0: every exchange through gloo); `backend`: nccl puts rank r on
    cuda:r."""
    expect = tuple(range(world)) if expect is None else expect
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, target, args, results, shm_bytes, backend),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in expect:
            rank, status, value = results.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    except queue.Empty:
        raise AssertionError(f"expert-parallel ranks gave no result in {timeout_s}s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [out[r] for r in expect]
