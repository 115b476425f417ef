"""How busy the machine was with other work while a benchmark ran: `with cpu_contention() as load: ...` fills
`load` with the average number of cores that other processes used (the machine's busy time from /proc/stat less
this process's and its exited children's CPU time) and that the hypervisor stole, over the block's wall time.

A multi-process measurement (EP 2 uses every core of a 2-core machine) loses more to other work than a
one-process one, so its figures are read beside this. Where /proc/stat is missing (not Linux) `load` stays empty.
"""
from __future__ import annotations

import contextlib
import os
import resource
import time
from typing import Iterator


def _proc_stat() -> tuple[float, float] | None:
    """(busy seconds of all cores, stolen seconds) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _own_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def cpu_contention() -> Iterator[dict]:
    load: dict = {}
    start, own, wall = _proc_stat(), _own_cpu(), time.perf_counter()
    yield load
    end = _proc_stat()
    if start is None or end is None:
        return
    seconds = max(time.perf_counter() - wall, 1e-9)
    load["other_cores"] = max(0.0, (end[0] - start[0]) - (_own_cpu() - own)) / seconds
    load["stolen_cores"] = (end[1] - start[1]) / seconds
    load["cores"] = os.cpu_count()
