"""Decode side of the KV hand-off (DESIGN §2 step 4): get a handle's blocks, never hang, never use wrong KV.

    fallback chain, each step covering the blocks the previous one did not (a leading run at a time):
      device prefix cache  ->  transfer (one batched one-sided read, bounded by a deadline)
                           ->  this worker's store tiers (host, disk, Redis, S3)  ->  recompute

Every transferred or stored block is verified by the codec (namespace, hash, layout, checksum) before use; a bad
block ends the run there. The handle's partial last block (`tail`) rides in the same read and is verified the same
way against the hash of the prompt's last tokens; it is never in the store, so without it those tokens are
recomputed. A failed read is reported in `reason` ("lease expired", "peer unreachable",
"deadline exceeded", "checksum mismatch", ...) and counted, not raised.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple, Sequence

from kvstore.hashing import hash_block
from kvstore.store import TieredStore
from kvstore.transfer import (Descriptor, LeaseExpired, PeerUnavailable, TransferAgent, TransferError,
                              TransferTimeout, UnknownRegion, pack_views)
from strata.v1 import common_pb2
from worker_common.engine_setup import EngineBundle
from worker_common.kv_blocks import device_prefix_blocks, slot_bytes, verified_payloads
from worker_common.prefix_load import load_from_store
from worker_common.read_costs import TransferCounter

log = logging.getLogger(__name__)

_REASONS = ((LeaseExpired, "lease expired"), (PeerUnavailable, "peer unreachable"),
            (TransferTimeout, "deadline exceeded"), (UnknownRegion, "unknown region"))


class PullResult(NamedTuple):
    payloads: list[memoryview | None]   # leading blocks: None = already on the device, else verified payload
    on_device: int
    transferred: int
    from_store: int
    reason: str                          # why blocks were not transferred; "" when every block was
    elapsed_s: float
    tail: memoryview | None = None       # verified payload of the handle's partial last block, when usable


class HandoffCounts:
    """Totals over every Decode of this worker (exported as `strata_worker_kv_handoff_*`); thread-safe."""

    FIELDS = ("blocks_transferred", "blocks_from_store", "blocks_recomputed", "tail_tokens_transferred",
              "failed_reads")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(self.FIELDS, 0)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._totals[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)


class KvPuller:
    def __init__(self, bundle: EngineBundle, store: TieredStore, agent: TransferAgent, deadline_s: float,
                 costs: TransferCounter | None = None) -> None:
        """`costs`: where each successful hand-off read's bytes and seconds go (the router prices transfers with
        them: `transfer_read_*` in this worker's load)."""
        self.bundle, self.store, self.agent, self.deadline_s = bundle, store, agent, deadline_s
        self.costs = costs or TransferCounter()
        self.counts = HandoffCounts()

    def pull(self, kv: common_pb2.KvHandle, num_blocks: int, prompt: Sequence[int]) -> PullResult:
        """The first `num_blocks` blocks of the handle (the rest are recomputed by the engine anyway), and its tail
        when it ends the prompt right after them (read in the same batch; only of use when every block is had)."""
        started = time.perf_counter()
        hashes = list(kv.block_hashes[:num_blocks])
        tail_hash = self._tail_hash(kv, hashes, prompt)
        on_device = device_prefix_blocks(self.bundle, hashes)
        payloads: list[memoryview | None] = [None] * on_device
        transferred, tail, reason = self._transfer(kv, hashes, on_device, tail_hash)
        payloads += transferred
        from_store = list(load_from_store(self.bundle, self.store, hashes[len(payloads):],
                                          kv.namespace_fingerprint).payloads)
        payloads += from_store
        if len(transferred) < len(hashes) - on_device and not reason:
            reason = "not transferred"
        return PullResult(payloads, on_device, len(transferred), len(from_store), reason,
                          time.perf_counter() - started, tail if len(payloads) == len(hashes) else None)

    def _tail_hash(self, kv: common_pb2.KvHandle, hashes: Sequence[bytes], prompt: Sequence[int]) -> bytes | None:
        """The hash the handle's tail must carry, when it holds exactly the prompt's tokens after `hashes`."""
        bs = self.bundle.block_size
        if not kv.HasField("tail") or len(hashes) != len(kv.block_hashes) or \
                len(hashes) * bs + kv.tail_tokens != len(prompt) or not 0 < kv.tail_tokens < bs:
            return None
        return hash_block(hashes[-1] if hashes else bytes(kv.namespace_fingerprint), prompt[len(hashes) * bs:])

    def _transfer(self, kv: common_pb2.KvHandle, hashes: Sequence[bytes], start: int,
                  tail_hash: bytes | None) -> tuple[list, memoryview | None, str]:
        locations = list(kv.blocks[start:len(hashes)]) + ([kv.tail] if tail_hash is not None else [])
        if not locations:
            return [], None, ""
        if any(loc.backend != self.agent.backend for loc in locations):
            return [], None, f"backend {locations[0].backend!r} is not this worker's ({self.agent.backend!r})"
        largest = slot_bytes(self.bundle)
        if any(not 0 < loc.length <= largest for loc in locations):
            # NOTE: the handle comes from the caller: never allocate what it asks unchecked (a block is at most this)
            bad = next(loc.length for loc in locations if not 0 < loc.length <= largest)
            return [], None, f"a block location's length {bad} is outside (0, {largest}] bytes"
        remaining_s = kv.lease_deadline_unix_ms / 1000.0 - time.time() if kv.lease_deadline_unix_ms else None
        if remaining_s is not None and remaining_s <= 0:
            return [], None, "lease expired"
        descs = [Descriptor(loc.agent_address, loc.region_id, loc.offset, loc.length,
                            loc.transfer_lease_id if loc.HasField("transfer_lease_id") else None)
                 for loc in locations]
        buf = bytearray(sum(d.length for d in descs))
        views = pack_views(buf, descs)
        try:
            if kv.agent_metadata:
                self.agent.add_peer(descs[0].agent, kv.agent_metadata)
            started = time.perf_counter()
            self.agent.read(descs, views, deadline_s=self.deadline_s)
            self.costs.record(len(buf), time.perf_counter() - started)
        except TransferError as exc:
            self.counts.add(failed_reads=1)
            log.info("KV transfer failed (%s); falling back to the store", exc)
            return [], None, next((text for cls, text in _REASONS if isinstance(exc, cls)), f"transfer error: {exc}")
        block_views = views[:len(hashes) - start]
        payloads, reason = self._verify(kv.namespace_fingerprint, hashes[start:], block_views)
        tail = None
        if tail_hash is not None and not reason:
            tail, reason = self._verify(kv.namespace_fingerprint, [tail_hash], views[-1:])
            tail = tail[0] if tail else None
        return payloads, tail, reason

    def _verify(self, fingerprint: bytes, hashes: Sequence[bytes], views: list[memoryview]) -> tuple[list, str]:
        payloads, failure = verified_payloads(self.bundle, views, fingerprint, hashes)
        if failure is not None:
            log.warning("transferred block %s failed verification: %s", bytes(hashes[len(payloads)]).hex(), failure)
            return payloads, "checksum mismatch"
        return payloads, ""
