"""The front of an expert-parallel worker group: the `strata.v1.Worker` service rank 0 serves for all N ranks, in
place of its own servicer. The router (and peers) see one worker; each request runs whole on one rank.

    router ──> rank 0's gRPC server: EPFront ──> rank 0's own service (a direct call)
                                             └─> rank r's service (a loopback gRPC call, streamed back)

- Prefill, Decode, Generate: to the rank holding the longest cached prefix of the prompt (`ep_events.RankHoldings`,
  learned from every rank's KV events), unless it has more than `PREFIX_LOAD_SLACK` requests in flight beyond the
  least busy rank; otherwise to the rank with the fewest requests in flight, ties going by a stable hash of the
  prompt's first tokens (a block's worth), so that prompts sharing a prefix meet the same rank's cache.
  A forwarded call carries the caller's deadline; the caller's cancel (or its going away) cancels it; the rank's
  error status and details come back unchanged, but for a rank that is gone, or an UNAVAILABLE that does not name
  the rank: UNAVAILABLE naming it. Once the group failed (`fail`), every call ends UNAVAILABLE (the router retries
  on another worker), forwarded ones in flight included.
- A forwarded Prefill's handle names the front as `lease_worker_address`: ReleaseKv comes here and goes to the rank
  that holds the lease. Abort goes to the rank running the request id. Either falls back to asking every rank.
- EvictCache, FlushCache: every rank (the rank's own `worker_id` filter cleared), counts summed per tier into one
  result per tier under rank 0's id; a shared tier (redis, s3), when named, is acted on by rank 0 alone, once for the
  group. Health: rank 0's, DEAD once the group failed or a rank is gone. Stats (and heartbeats, `load`): rank 0's,
  with the request and token counts (`SUMMED_LOAD`) summed over the ranks that answer within a second.
"""
from __future__ import annotations

import array
import logging
import threading
import zlib
from collections import OrderedDict
from concurrent import futures
from contextlib import contextmanager
from typing import Callable, Iterator, NoReturn, Sequence

import grpc

from kvstore.hashing import hash_blocks
from strata.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_common.cache_stats import SHARED_TIERS
from worker_common.ep_events import RankHoldings
from worker_common.fleet_tls import NO_TLS, FleetTls
from worker_common.grpc_auth import attach_secret
from worker_common.server import GRPC_OPTIONS, WorkerBase

log = logging.getLogger(__name__)

SUMMED_LOAD = ("running", "waiting", "pending_prefill_tokens", "running_tokens")
_STATS_TIMEOUT_S = 1.0
_CONTROL_TIMEOUT_S = 10.0          # Abort, ReleaseKv
_ADMIN_TIMEOUT_S = 60.0            # EvictCache, FlushCache
_MAX_LEASES = 1 << 16              # remembered lease owners (an unknown lease asks every rank)
# A request goes to the rank holding its prefix while that rank has at most this many more requests in flight than
# the least busy one (a load guard: one hot shared prefix must not pile every request onto one rank).
PREFIX_LOAD_SLACK = 2


def affinity(token_ids: Sequence[int], num_tokens: int) -> int:
    """A stable (cross-process, seed-free) hash of the first `num_tokens` prompt tokens."""
    return zlib.crc32(array.array("I", token_ids[:num_tokens]).tobytes())


class _Peer:
    def __init__(self, rank: int, address: str, cluster_secret: str = "", tls: FleetTls = NO_TLS) -> None:
        self.rank, self.address = rank, address
        self.channel = attach_secret(tls.channel(address, GRPC_OPTIONS), cluster_secret)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)


class EPFront(worker_pb2_grpc.WorkerServicer):
    def __init__(self, local: WorkerBase, addresses: Sequence[str],
                 alive: Callable[[int], bool] = lambda rank: True, affinity_tokens: int | None = None,
                 holdings: RankHoldings | None = None) -> None:
        """`local`: rank 0's service; `addresses`: ranks 1..N-1's gRPC addresses, in rank order; `alive(rank)`:
        whether that rank's process still runs; `affinity_tokens`: prompt tokens hashed for ties (default: a block);
        `holdings`: which rank holds which blocks (None: placement by load alone)."""
        self.holdings = holdings
        self.relay = None                                    # the group's `ep_events.EventRelay`, closed with us
        self.local = local
        self.world_size = 1 + len(addresses)
        self.peers = [None] + [_Peer(r, a, local.config.cluster_secret, local.config.fleet_tls())
                               for r, a in enumerate(addresses, start=1)]
        self._alive = alive
        self._affinity_tokens = affinity_tokens or local.config.block_size
        self._lock = threading.Lock()
        self._inflight = [0] * self.world_size
        self._owners: dict[str, int] = {}                    # request id -> rank running it
        self._leases: OrderedDict[str, int] = OrderedDict()  # lease id -> rank holding it
        self._calls: set = set()                             # forwarded calls in flight (`fail` cancels them)
        self._pool = futures.ThreadPoolExecutor(max_workers=max(2, self.world_size), thread_name_prefix="ep-front")
        self.failure = ""

    def describe(self, rank: int) -> str:
        return f"expert-parallel rank {rank} of {self.world_size}"

    # ---- group state ----------------------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """The group is unusable: refuse every new call and end every forwarded one, UNAVAILABLE with `reason`."""
        with self._lock:
            self.failure = self.failure or reason
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def idle(self) -> bool:
        with self._lock:
            return not self._owners and not self._calls

    def inflight(self) -> list[int]:
        """Requests in flight through the front, per rank."""
        with self._lock:
            return list(self._inflight)

    def dead_ranks(self) -> list[int]:
        return [r for r in range(1, self.world_size) if not self._alive(r)]

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for peer in self.peers[1:]:
            peer.channel.close()

    # ---- placement ------------------------------------------------------------------------------------------

    def pick(self, token_ids: Sequence[int], cache_salt: str = "") -> int:
        """The rank holding the prompt's longest cached prefix within the load guard; else the rank with the fewest
        requests in flight, among equals the prompt's affinity."""
        lengths = self._prefix_lengths(token_ids, cache_salt)
        with self._lock:
            return self._pick_locked(token_ids, lengths)

    def _prefix_lengths(self, token_ids: Sequence[int], cache_salt: str) -> list[int] | None:
        if self.holdings is None:
            return None
        bundle = self.local.bundle
        hashes = hash_blocks(bundle.fingerprint_for(cache_salt), token_ids, bundle.block_size)
        with self.holdings.lock:
            return self.holdings.prefix_lengths(hashes)

    def _pick_locked(self, token_ids: Sequence[int], lengths: list[int] | None = None) -> int:
        least = min(self._inflight)
        if lengths is not None:
            best = max(range(self.world_size), key=lambda r: (lengths[r], -self._inflight[r], -r))
            if lengths[best] and self._inflight[best] <= least + PREFIX_LOAD_SLACK:
                return best
        candidates = [r for r, n in enumerate(self._inflight) if n == least]
        return candidates[affinity(token_ids, self._affinity_tokens) % len(candidates)]

    @contextmanager
    def _placed(self, request_id: str, token_ids: Sequence[int], context: grpc.ServicerContext,
                cache_salt: str = "") -> Iterator[int]:
        """Choose the request's rank and count it in flight there until the call ends."""
        if self.failure:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
        if not request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        if self.local.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.local.worker_id} is draining")
        lengths = self._prefix_lengths(token_ids, cache_salt)
        with self._lock:
            rank = None if request_id in self._owners else self._pick_locked(token_ids, lengths)
            if rank is not None:
                self._owners[request_id] = rank
                self._inflight[rank] += 1
        if rank is None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        try:
            yield rank
        finally:
            with self._lock:
                self._owners.pop(request_id, None)
                self._inflight[rank] -= 1

    # ---- requests -------------------------------------------------------------------------------------------

    def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        with self._placed(request.request_id, request.token_ids, context, request.cache_salt) as rank:
            if rank == 0:
                response = self.local.Prefill(request, context)
            else:
                response = self._forward_unary(rank, "Prefill", request, context)
                if response.kv.lease_id:
                    response.kv.lease_worker_address = self.local.address  # ReleaseKv comes through the front
            if response.kv.lease_id:
                self._remember_lease(response.kv.lease_id, rank)
            return response

    def PrefillStream(self, request: worker_pb2.PrefillRequest, context) -> Iterator[worker_pb2.PrefillResponse]:
        with self._placed(request.request_id, request.token_ids, context, request.cache_salt) as rank:
            answers = self.local.PrefillStream(request, context) if rank == 0 else \
                self._forward_stream(rank, "PrefillStream", request, context)
            for response in answers:
                if response.kv.lease_id:
                    if rank:
                        response.kv.lease_worker_address = self.local.address  # ReleaseKv comes through the front
                    self._remember_lease(response.kv.lease_id, rank)
                yield response

    def Decode(self, request: worker_pb2.DecodeRequest, context) -> Iterator[worker_pb2.TokenChunk]:
        yield from self._stream("Decode", request, context)

    def Generate(self, request: worker_pb2.WorkerGenerateRequest, context) -> Iterator[worker_pb2.TokenChunk]:
        yield from self._stream("Generate", request, context)

    def _stream(self, method: str, request, context) -> Iterator[worker_pb2.TokenChunk]:
        with self._placed(request.request_id, request.token_ids, context, request.cache_salt) as rank:
            if rank == 0:
                yield from getattr(self.local, method)(request, context)
            else:
                yield from self._forward_stream(rank, method, request, context)

    # ---- forwarding -----------------------------------------------------------------------------------------

    def _forward_unary(self, rank: int, method: str, request, context):
        call = getattr(self.peers[rank].stub, method).future(request, timeout=context.time_remaining())
        self._track(call, context)
        try:
            return call.result()
        except grpc.FutureCancelledError:
            self._abort_cancelled(rank, context)
        except grpc.RpcError as exc:
            self._abort_broken(rank, exc, context)
        finally:
            self._untrack(call)

    def _forward_stream(self, rank: int, method: str, request, context) -> Iterator[worker_pb2.TokenChunk]:
        call = getattr(self.peers[rank].stub, method)(request, timeout=context.time_remaining())
        self._track(call, context)
        try:
            yield from call
        except grpc.RpcError as exc:
            self._abort_broken(rank, exc, context)
        finally:
            call.cancel()  # NOTE: a no-op once it ended; ends it when our caller went away mid-stream
            self._untrack(call)

    def _track(self, call, context) -> None:
        context.add_callback(call.cancel)  # the caller cancelled, its deadline passed, or it went away
        with self._lock:
            self._calls.add(call)
            failed = bool(self.failure)
        if failed:                         # NOTE: `fail` ran between placing the call and tracking it
            call.cancel()

    def _untrack(self, call) -> None:
        with self._lock:
            self._calls.discard(call)

    def _abort_cancelled(self, rank: int, context) -> NoReturn:
        if self.failure:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
        context.abort(grpc.StatusCode.CANCELLED, f"the call to {self.describe(rank)} was cancelled")

    def _abort_broken(self, rank: int, exc: grpc.RpcError, context) -> NoReturn:
        """End the caller's call the way the rank's ended: unchanged, but UNAVAILABLE naming the rank when the group
        failed, the rank is gone, or the rank was unreachable."""
        code, details = exc.code(), exc.details() or ""
        if self.failure:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.failure} ({code.name}: {details})")
        if not self._alive(rank):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.describe(rank)} is gone ({code.name}: {details})")
        if code == grpc.StatusCode.CANCELLED and context.is_active():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.describe(rank)} cancelled the call: {details}")
        if code == grpc.StatusCode.UNAVAILABLE and f"-rank{rank}" not in details:
            details = f"{self.describe(rank)} at {self.peers[rank].address}: {details}"
        context.abort(code, details)

    def _on_rank(self, rank: int, method: str, request, context, timeout_s: float):
        """One rank's answer to a control call (rank 0: a direct call); an error is logged and answers None."""
        if rank == 0:
            return getattr(self.local, method)(request, context)
        try:
            return getattr(self.peers[rank].stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            log.warning("%s on %s failed: %s %s", method, self.describe(rank), exc.code().name, exc.details())
            return None

    def _on_children(self, method: str, request, timeout_s: float) -> list[tuple[int, object]]:
        """(rank, answer or the RpcError) of ranks 1..N-1, asked in parallel."""
        calls = [(r, self._pool.submit(getattr(self.peers[r].stub, method), request, timeout=timeout_s))
                 for r in range(1, self.world_size)]
        answers = []
        for rank, call in calls:
            try:
                answers.append((rank, call.result(timeout=timeout_s + 1)))
            except (grpc.RpcError, futures.TimeoutError, futures.CancelledError) as exc:
                answers.append((rank, exc))
        return answers

    # ---- control --------------------------------------------------------------------------------------------

    def Abort(self, request: worker_pb2.WorkerAbortRequest, context) -> worker_pb2.WorkerAbortResponse:
        with self._lock:
            owner = self._owners.get(request.request_id)
        ranks = [owner] if owner is not None else range(self.world_size)
        answers = [self._on_rank(r, "Abort", request, context, _CONTROL_TIMEOUT_S) for r in ranks]
        return worker_pb2.WorkerAbortResponse(found=any(a is not None and a.found for a in answers))

    def ReleaseKv(self, request: worker_pb2.ReleaseKvRequest, context) -> worker_pb2.ReleaseKvResponse:
        with self._lock:
            owner = self._leases.pop(request.lease_id, None)
        ranks = [owner] if owner is not None else range(self.world_size)
        for rank in ranks:
            answer = self._on_rank(rank, "ReleaseKv", request, context, _CONTROL_TIMEOUT_S)
            if answer is not None and answer.released:
                return answer
        return worker_pb2.ReleaseKvResponse(released=False)

    def _remember_lease(self, lease_id: str, rank: int) -> None:
        with self._lock:
            self._leases[lease_id] = rank
            while len(self._leases) > _MAX_LEASES:
                self._leases.popitem(last=False)

    def Health(self, request, context) -> worker_pb2.HealthResponse:
        answer = self.local.Health(request, context)
        dead = self.dead_ranks()
        if self.failure or dead:
            answer.state = common_pb2.WORKER_STATE_DEAD
            answer.detail = self.failure or ", ".join(f"{self.describe(r)} is gone" for r in dead)
        return answer

    def Stats(self, request, context) -> worker_pb2.StatsResponse:
        answer = self.local.Stats(request, context)
        answer.load.CopyFrom(self.load())
        return answer

    def load(self) -> common_pb2.WorkerLoad:
        """Rank 0's load, its `SUMMED_LOAD` counts summed over every rank that answers Stats in time."""
        load = self.local.load()
        for rank, answer in self._on_children("Stats", worker_pb2.StatsRequest(), _STATS_TIMEOUT_S):
            if isinstance(answer, worker_pb2.StatsResponse):
                for name in SUMMED_LOAD:
                    setattr(load, name, getattr(load, name) + getattr(answer.load, name))
        return load

    # ---- cache admin ----------------------------------------------------------------------------------------

    def EvictCache(self, request: common_pb2.EvictCacheRequest, context) -> common_pb2.EvictCacheResponse:
        return common_pb2.EvictCacheResponse(results=self._admin("EvictCache", request, context))

    def FlushCache(self, request: common_pb2.FlushCacheRequest, context) -> common_pb2.FlushCacheResponse:
        return common_pb2.FlushCacheResponse(results=self._admin("FlushCache", request, context))

    def _admin(self, method: str, request, context) -> list[common_pb2.CacheAdminResult]:
        results = list(getattr(self.local, method)(request, context).results)  # validates the request first
        if request.tier in SHARED_TIERS:
            return results  # one rank acts on a shared tier for the whole group
        forwarded = type(request)()
        forwarded.CopyFrom(request)
        forwarded.worker_id = ""  # a rank accepts only its own id or none
        by_tier = {r.tier: r for r in results}
        for rank, answer in self._on_children(method, forwarded, _ADMIN_TIMEOUT_S):
            if isinstance(answer, grpc.RpcError):
                for result in results:
                    _add_error(result, f"{self.describe(rank)}: {answer.code().name}: {answer.details()}")
            elif not hasattr(answer, "results"):
                for result in results:
                    _add_error(result, f"{self.describe(rank)}: no answer in {_ADMIN_TIMEOUT_S:.0f}s")
            else:
                for theirs in answer.results:
                    _add_counts(by_tier, results, theirs, self.describe(rank))
        return results


def _add_counts(by_tier: dict, results: list, theirs: common_pb2.CacheAdminResult, who: str) -> None:
    ours = by_tier.get(theirs.tier)
    if ours is None:  # a tier rank 0 does not run (ranks share one config: should not happen)
        ours = by_tier[theirs.tier] = common_pb2.CacheAdminResult(worker_id=results[0].worker_id if results else "",
                                                                  tier=theirs.tier, shared=theirs.shared)
        results.append(ours)
    ours.blocks_removed += theirs.blocks_removed
    ours.bytes_freed += theirs.bytes_freed
    ours.blocks_demoted += theirs.blocks_demoted
    if theirs.error:
        _add_error(ours, f"{who}: {theirs.error}")


def _add_error(result: common_pb2.CacheAdminResult, error: str) -> None:
    result.error = f"{result.error}; {error}" if result.error else error
