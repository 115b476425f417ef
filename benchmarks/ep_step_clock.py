"""Where an expert-parallel step's time goes: `with step_clock(group, layer) as clock:` adds up, per rank, the
seconds spent in the layer's local experts ("experts"), in `EPGroup.join_step` ("join") and in
`EPGroup.all_to_all` ("all_to_all": the exchange itself and the wait for the slower rank). The rest of a step is
routing, packing and combining. The group and the layer are restored on exit.

It wraps the group's methods and the layer's executor's entry points (`run_pairs`, `forward`) on the instances, so
the step takes the same code path as without the clock: a benchmark's instrument, not a product API.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Iterator

import torch

from engine.moe.ep_group import EPGroup

PHASES = ("experts", "join", "all_to_all")


class StepClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


@contextlib.contextmanager
def step_clock(group: EPGroup, layer: torch.nn.Module) -> Iterator[StepClock]:
    clock, inner = StepClock(), layer.inner
    entries = [name for name in ("run_pairs", "forward") if hasattr(inner, name)]
    for name in entries:
        setattr(inner, name, clock.wrap("experts", getattr(inner, name)))
    group.join_step = clock.wrap("join", group.join_step)
    group.all_to_all = clock.wrap("all_to_all", group.all_to_all)
    try:
        yield clock
    finally:
        for name in entries:
            delattr(inner, name)                    # the instance attributes: the class's methods show again
        del group.join_step, group.all_to_all
