"""Expert-parallel ranks as real processes for moe_bench: `run_ranks(world, target, *args)` spawns `world`
processes; each sets one torch thread, joins one `EPGroup` over TCP on 127.0.0.1 and returns
`target(group, *args)`. The results come back in rank order. Every process is stopped before it returns: joined,
then killed if it has not exited.

`target` must be a module-level function (a spawned process imports it by name).
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from typing import Any, Callable

GROUP_TIMEOUT_S = 600.0        # a rank may wait this long in a collective while its peer measures alone


class RankFailed(RuntimeError):
    """A rank raised, or the ranks gave no result in time; the message carries the rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, target: Callable, args: tuple, results: Any) -> None:
    import torch

    from engine.moe.ep_group import EPGroup, EPGroupSpec

    torch.set_num_threads(1)
    group = EPGroup.init(EPGroupSpec(world, rank, f"tcp://127.0.0.1:{port}", timeout_s=GROUP_TIMEOUT_S))
    try:
        results.put((rank, None, target(group, *args)))
    except BaseException:  # noqa: BLE001 - the parent raises it with the traceback
        results.put((rank, traceback.format_exc(), None))
    finally:
        group.close()


def run_ranks(world: int, target: Callable, *args: Any, timeout_s: float = 1800.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world, port, target, args, results), daemon=True)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            rank, error, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if error is not None:
                raise RankFailed(f"expert-parallel rank {rank} failed:\n{error}")
            out[rank] = value
    except queue.Empty:
        raise RankFailed(f"expert-parallel ranks gave no result in {timeout_s:.0f}s") from None
    finally:
        _stop(procs)
    return [out[rank] for rank in range(world)]


def _stop(procs: list) -> None:
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
