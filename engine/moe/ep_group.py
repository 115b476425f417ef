"""`EPGroup`: the ranks of one expert-parallel worker, joined in a `torch.distributed` process group (gloo on CPU,
NCCL would be the GPU choice), and the collectives the MoE layers and the engine loop use.

Every rank runs its own requests (attention is data-parallel); the sparse layers exchange tokens. So every rank must
make the same collective calls in the same order. One engine step is:

    join_step(rows, rebalance)   all-reduce MAX: does anyone run a forward this step, with how many rows at most,
                                 and does anyone ask for an expert rebalance
    per sparse layer:            all_to_all (dispatch: tokens to their experts' ranks)
                                 all_to_all (combine: expert outputs back)

A rank with no requests still joins: it sends only padding. A collective that fails (a rank died: gloo notices the
closed socket at once; a rank hung: after `timeout_s`) raises `EPGroupError`, and the group is unusable from then on.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from engine.moe import shm_exchange
from engine.moe.shm_exchange import ShmExchange

T = TypeVar("T")


class EPGroupError(RuntimeError):
    """A collective of the expert-parallel group failed (a rank died or timed out). The group cannot be used again;
    the worker fails its requests (retryable elsewhere) and exits."""


@dataclass(frozen=True)
class EPGroupSpec:
    """`init_method`: tcp://HOST:PORT where rank 0 listens for the others (one host: 127.0.0.1)."""

    world_size: int
    rank: int
    init_method: str
    timeout_s: float = 30.0
    shm_bytes: int = 8 << 20        # per rank and buffer, for same-host exchanges (0: gloo only)
    # gloo with CPU tensors, or nccl with each rank's tensors on its own GPU (`device`: cuda:N; NCCL cannot put
    # two ranks on one device). NOTE: the nccl path is written for GPUs and not yet run on any (none was lent).
    backend: str = "gloo"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= 64:
            raise ValueError(f"expert_parallel (world size) must be in [1, 64], got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ep rank must be in [0, {self.world_size - 1}], got {self.rank}")
        if not self.init_method.startswith("tcp://"):
            raise ValueError(f"ep init_method must be tcp://HOST:PORT, got {self.init_method!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"ep timeout_s must be > 0, got {self.timeout_s}")
        if (self.backend, self.device.split(":")[0]) not in (("gloo", "cpu"), ("nccl", "cuda")):
            raise ValueError(f"ep backend/device must be gloo with cpu or nccl with cuda[:N], got "
                             f"{self.backend!r} with {self.device!r}")


def _shared_memory(spec: EPGroupSpec) -> ShmExchange | None:
    """The group's shared-memory exchange when every rank is on this host and the platform allows it (a
    collective: every rank calls it once, after joining)."""
    me = (socket.gethostname(), os.getpid())
    everyone: list = [None] * spec.world_size
    dist.all_gather_object(everyone, me)
    size = shm_exchange.segment_bytes(spec.world_size, spec.shm_bytes)
    usable = torch.tensor([int(shm_exchange.supported(size) and all(h == me[0] for h, _ in everyone))])
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    if not usable.item():
        return None
    name = [ShmExchange.fresh_name() if spec.rank == 0 else None]
    if spec.rank == 0:
        exchange = ShmExchange(0, spec.world_size, name[0], spec.shm_bytes, True, [p for _, p in everyone],
                               spec.timeout_s)
    dist.broadcast_object_list(name, src=0)
    if spec.rank != 0:
        exchange = ShmExchange(spec.rank, spec.world_size, name[0], spec.shm_bytes, False,
                               [p for _, p in everyone], spec.timeout_s)
    dist.barrier()
    if spec.rank == 0:
        exchange.unlink()           # every rank mapped it: nothing is left behind, whatever happens next
    return exchange


class StepPlan(NamedTuple):
    """What `join_step` agreed on: the most rows any rank's forward has (0: no rank runs a forward this step) and
    whether any rank asked for a rebalance before it."""

    rows: int
    rebalance: bool


class EPGroup:
    def __init__(self, rank: int, world_size: int, pg: object | None, device: str = "cpu") -> None:
        """Use `init` (or `single()` for a one-rank group that needs no process group)."""
        self.rank, self.world_size, self._pg = rank, world_size, pg
        self.device = torch.device(device)     # where the group's collectives take their tensors
        self.error: EPGroupError | None = None
        self.offline_depth = 0          # > 0: forwards do not exchange (warm-up, compile)
        self.step_rows = 0              # rows per rank of the forward in progress (join_step's agreement)
        self.in_step = False
        self.shm: ShmExchange | None = None     # same-host exchanges through shared memory (None: gloo)
        self.bytes_to_peers = 0         # all-to-all bytes this rank sent to other ranks (padding included)
        self.rank_pairs = [0] * world_size      # pairs each rank's experts computed, cumulative (via join_step)
        self.last_pairs = [0] * world_size      # the same, reported at the last join

    @classmethod
    def init(cls, spec: EPGroupSpec) -> EPGroup:
        """Join the group; blocks until every rank has (or raises EPGroupError after `timeout_s`)."""
        if spec.world_size == 1:
            return cls.single()
        try:
            if spec.backend == "nccl":
                torch.cuda.set_device(torch.device(spec.device))
            dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s))
        except Exception as exc:  # noqa: BLE001 - any rendezvous failure is the same error to the caller
            raise EPGroupError(f"expert-parallel rank {spec.rank} of {spec.world_size} could not join the group at "
                               f"{spec.init_method}: {exc}") from exc
        group = cls(spec.rank, spec.world_size, dist.group.WORLD, spec.device)
        if spec.shm_bytes and spec.backend == "gloo":
            group.shm = group._run(lambda: _shared_memory(spec), "shared-memory setup")
        return group

    @classmethod
    def single(cls) -> EPGroup:
        return cls(0, 1, None)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self._pg is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._pg = None

    # ---- collectives (every rank, same order) ---------------------------------------------------------------

    def join_step(self, rows: int, rebalance: bool = False, pairs: int = 0) -> StepPlan:
        """Agree on this step: the largest forward (rows) and whether to rebalance experts first. `pairs`: the
        (token, expert) pairs this rank computed since its last join; every rank learns every rank's
        (`rank_pairs`), so any rank can report the group's load per rank."""
        mine = torch.tensor([rows, int(rebalance), pairs], dtype=torch.int64, device=self.device)
        if self.shm is not None:        # an all-gather as an all-to-all of the same block to everyone
            every = self._exchange(mine.expand(self.world_size, 3).contiguous(), "join_step")   # [N, 3]
        else:
            every = self.all_gather(mine)                                         # [N, 3]
        plan = StepPlan(int(every[:, 0].max()), bool(every[:, 1].max()))
        self.last_pairs = every[:, 2].tolist()
        self.rank_pairs = [a + b for a, b in zip(self.rank_pairs, self.last_pairs)]
        self.step_rows, self.in_step = plan.rows, plan.rows > 0
        return plan

    def end_step(self) -> None:
        self.in_step = False

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """`send [N, ...]`: block j goes to rank j; returns `[N, ...]` where block j came from rank j."""
        if self.world_size == 1:
            return send
        send = send.contiguous()
        self.bytes_to_peers += send.numel() * send.element_size() * (self.world_size - 1) // self.world_size
        return self._exchange(send, "all_to_all")

    def _exchange(self, send: torch.Tensor, what: str) -> torch.Tensor:
        """Equal blocks, block j to rank j: through shared memory when it fits, else gloo (all ranks alike)."""
        if self.shm is not None and not send.is_cuda and self.shm.fits(send.numel() * send.element_size()):
            return self._run(lambda: self.shm.all_to_all(send), what)
        recv = torch.empty_like(send)
        self._run(lambda: dist.all_to_all_single(recv, send, group=self._pg), what)
        return recv

    def all_to_all_uneven(self, send: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        """Rows `send[sum(send_rows[:j]) : ...]` go to rank j; both sides know the counts (no count exchange)."""
        if self.world_size == 1:
            return send.clone()
        recv = send.new_empty(sum(recv_rows), *send.shape[1:])
        self._run(lambda: dist.all_to_all_single(recv, send.contiguous(), recv_rows, send_rows, group=self._pg),
                  "all_to_all")
        return recv

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            self._run(lambda: dist.all_reduce(tensor, group=self._pg), "all_reduce")
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[N, *tensor.shape]`: every rank's tensor."""
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run(lambda: dist.all_gather(parts, tensor.contiguous(), group=self._pg), "all_gather")
        return torch.stack(parts)

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def broken(self) -> bool:
        return self.error is not None

    @property
    def exchanging(self) -> bool:
        """Whether a sparse layer called now must exchange (inside a joined step, not warming up)."""
        return self.offline_depth == 0 and self.world_size > 1

    @contextlib.contextmanager
    def offline(self) -> Iterator[None]:
        """Forwards inside run without exchanging (remote experts contribute zeros): for warm-ups and compiles,
        which ranks do not run in lockstep. Never for a forward whose output is used."""
        self.offline_depth += 1
        try:
            yield
        finally:
            self.offline_depth -= 1

    def _run(self, fn: Callable[[], T], what: str) -> T:
        """`fn()`; a failure breaks the group for good (`error`), and every later collective raises it."""
        if self.error is not None:
            raise self.error
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses of several kinds
            self.error = EPGroupError(f"expert-parallel group: {what} failed on rank {self.rank} of "
                                      f"{self.world_size} (another rank died or hung): {exc}")
            raise self.error from exc
