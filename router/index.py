"""The router's global prefix index (DESIGN §6): which worker holds which blocks, in which tier.

Fed by KV-event batches (`kvstore.events`, vLLM's schema) with a per-publisher sequence number; queried with a
request's chained block hashes (DESIGN §3), so "holds the block at position i" means "holds the whole prefix through
block i" and a match is a leading run.

    _holders:  hash -> {worker_id: tier bitmask}       what `match` walks: one dict lookup per block
    _owned:    worker_id -> {hash: tier bitmask}       what `AllBlocksCleared` / `remove_worker` drop; insertion
                                                       ordered, so the memory bound drops a worker's oldest entries

Shared tiers (redis, s3) are pooled: a block there, whoever reported it, counts for every worker. So a removal
from a shared tier (`BlockRemoved`, or a flush: `AllBlocksCleared(medium="redis")`) removes it for every worker,
while one from a local tier touches only the publisher's entries of that tier, and a clear without a medium all of
the publisher's:

    AllBlocksCleared()                  worker w: every entry              (restart, cache reset)
    AllBlocksCleared(medium="host")     worker w: the host bit             (its other tiers stay)
    AllBlocksCleared(medium="redis")    every worker: the redis bit        (one shared backend)

A publisher with several KV-cache groups (vLLM on a hybrid model: one group per attention type) stores and evicts the
same hash once per group (`group_idx`): a block stays held in a tier while any of its groups holds it there, so one
group's eviction (a sliding window's) never drops the hash the full-attention group still holds.

    _groups:   worker_id -> {(hash, tier bit): {group_idx, ...}}   only for events that name a group

A `medium` the index does not know (a tier a later vLLM release added) is never an error: the event is skipped and
counted (`ApplyResult.skipped`, `unknown_media`), since a skipped store costs a recompute and a skipped removal of a
block in a tier the index never recorded removes nothing.

Bookkeeping only: hashes, ids, ints. No sockets here (the subscriber feeds `apply`), no tensors.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Literal, Mapping, NewType, Sequence

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

WorkerId = NewType("WorkerId", str)
BlockKey = Hashable  # a 16-byte `BlockHash`, or an int from a vLLM publisher

# Fastest first: the order the cost model walks, and the bit order of a tier mask.
TIERS: tuple[str, ...] = ("device", "host", "disk", "redis", "s3")
TIER_BIT: dict[str, int] = {t: 1 << i for i, t in enumerate(TIERS)}
SHARED_TIERS: frozenset[str] = frozenset({"redis", "s3"})
SHARED_MASK = TIER_BIT["redis"] | TIER_BIT["s3"]
# NOTE: vLLM's offload media ("STORAGE" since 0.33; "FS" and "OBJ" in 0.26-0.32) are that worker's own storage,
# never a backend other workers read, so they map to the local disk tier, not to the pooled redis / s3 tiers.
_ALIASES = {"gpu": "device", "cuda": "device", "device": "device", "g1": "device",
            "cpu": "host", "host": "host", "g2": "host", "disk": "disk", "g3": "disk",
            "storage": "disk", "fs": "disk", "obj": "disk",
            "redis": "redis", "s3": "s3"}


def tier_of_medium(medium: str | None) -> str | None:
    """vLLM's and Strata's tier names -> one of `TIERS`; None (vLLM's default) is the device tier. A medium no
    release has used -> None (the caller skips it)."""
    if medium is None:
        return "device"
    return _ALIASES.get(medium.lower())


def normalize_medium(medium: str | None) -> str:
    """`tier_of_medium`, where an unknown name is the caller's error (ValueError naming the allowed names)."""
    tier = tier_of_medium(medium)
    if tier is None:
        raise ValueError(f"medium must be one of {sorted(_ALIASES)} (any case) or None, got {medium!r}")
    return tier


def tiers_of(mask: int) -> tuple[str, ...]:
    """The tier names in a bitmask, fastest first."""
    return tuple(t for t in TIERS if mask & TIER_BIT[t])


def fastest_tier(mask: int) -> str | None:
    if not mask:
        return None
    return TIERS[(mask & -mask).bit_length() - 1]


@dataclass(frozen=True)
class IndexConfig:
    """`max_blocks_per_worker` bounds memory: past it a worker's oldest entries are dropped (a lost hint costs a
    recompute, never wrong KV, since workers verify every block they read)."""

    max_blocks_per_worker: int = 1_000_000

    def __post_init__(self) -> None:
        if self.max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {self.max_blocks_per_worker}")


ApplyStatus = Literal["applied", "duplicate", "gap"]


@dataclass(frozen=True)
class ApplyResult:
    """What `apply` did. On "gap" nothing was applied: replay from `expected_seq` (or load a snapshot).
    `skipped`: events of the batch left out because their medium is unknown."""

    status: ApplyStatus
    worker_id: WorkerId
    expected_seq: int
    received_seq: int
    num_events: int = 0
    skipped: int = 0

    @property
    def needs_resync(self) -> bool:
        return self.status == "gap"


@dataclass(frozen=True)
class WorkerMatch:
    """One worker's view of a query: `block_masks[i]` = tiers (own or shared) holding block i, 0 = none.

    Covers the pooled run (see `MatchResult`), trimmed after the worker's last held block; a 0 inside it is a block
    the worker can only get from a peer.
    """

    worker_id: WorkerId
    block_masks: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        """Longest leading run this worker holds in any of its tiers or a shared tier."""
        for i, m in enumerate(self.block_masks):
            if not m:
                return i
        return len(self.block_masks)

    def tier_run(self, tier: str) -> int:
        """Longest leading run held in `tier` alone."""
        bit = TIER_BIT[normalize_medium(tier)]
        for i, m in enumerate(self.block_masks):
            if not m & bit:
                return i
        return len(self.block_masks)

    def tier_runs(self) -> dict[str, int]:
        return {t: self.tier_run(t) for t in TIERS}


@dataclass(frozen=True)
class MatchResult:
    """Per-worker, per-tier leading runs of one query.

    `pooled_blocks`: the leading run held anywhere (any worker, any tier): what a worker could load by fetching
    from peers. `shared_masks[i]`: shared tiers holding block i. `local[w][i]`: worker w's own tiers for block i.
    """

    num_query_blocks: int
    pooled_blocks: int
    shared_masks: tuple[int, ...]
    local: Mapping[WorkerId, Mapping[int, int]] = field(default_factory=dict)

    def for_worker(self, worker_id: WorkerId) -> WorkerMatch:
        own = self.local.get(worker_id, {})
        masks = [own.get(i, 0) | self.shared_masks[i] for i in range(self.pooled_blocks)]
        while masks and not masks[-1]:
            masks.pop()
        return WorkerMatch(worker_id, tuple(masks))

    def workers(self) -> tuple[WorkerId, ...]:
        """Workers holding at least block 0 in one of their own tiers."""
        return tuple(sorted(w for w, own in self.local.items() if 0 in own))


class PrefixIndex:
    """Global prefix index. Not thread-safe: one owner thread applies batches and answers matches."""

    def __init__(self, config: IndexConfig = IndexConfig()) -> None:
        self.config = config
        self._holders: dict[BlockKey, dict[WorkerId, int]] = {}
        self._owned: dict[WorkerId, dict[BlockKey, int]] = {}
        self._groups: dict[WorkerId, dict[tuple[BlockKey, int], set[int]]] = {}
        self._next_seq: dict[WorkerId, int] = {}
        self.num_dropped = 0  # entries dropped by the memory bound
        self.unknown_media: Counter = Counter()  # events skipped, by medium

    # ------------------------------------------------------------------------------------------------- updates

    def apply(self, worker_id: WorkerId, batch: KVEventBatch, seq: int) -> ApplyResult:
        """Apply one batch if `seq` is the next expected from this worker (the first batch seen is accepted).

        An older `seq` is a duplicate (ignored); a newer one is a gap: nothing is applied and the caller replays
        from `expected_seq` or loads a snapshot (`load_snapshot`). A router that joins a stream late knows nothing
        of the blocks stored before its first batch: it should load a snapshot too.
        """
        expected = self._next_seq.get(worker_id, seq)
        if seq < expected:
            return ApplyResult("duplicate", worker_id, expected, seq)
        if seq > expected:
            return ApplyResult("gap", worker_id, expected, seq)
        applied = sum(self._apply_event(worker_id, event) for event in batch.events)
        self._next_seq[worker_id] = seq + 1
        return ApplyResult("applied", worker_id, seq, seq, applied, len(batch.events) - applied)

    def _apply_event(self, worker_id: WorkerId, event: object) -> bool:
        """False when the event was skipped (its medium is unknown)."""
        medium = getattr(event, "medium", None)
        if tier_of_medium(medium) is None:
            self.unknown_media[medium] += 1
            return False
        if isinstance(event, BlockStored):
            self.add_blocks(worker_id, event.block_hashes, medium, event.group_idx)
        elif isinstance(event, BlockRemoved):
            self.remove_blocks(worker_id, event.block_hashes, medium, event.group_idx)
        elif isinstance(event, AllBlocksCleared):
            if medium is None:
                self.clear_worker(worker_id)
            else:
                self.clear_tier(worker_id, medium)
        else:
            raise TypeError(f"event must be BlockStored, BlockRemoved or AllBlocksCleared, got {type(event).__name__}")
        return True

    def add_blocks(self, worker_id: WorkerId, hashes: Iterable[BlockKey], medium: str | None,
                   group: int | None = None) -> None:
        bit = TIER_BIT[normalize_medium(medium)]
        owned = self._owned.setdefault(worker_id, {})
        groups = self._groups.setdefault(worker_id, {}) if group is not None else None
        for h in hashes:
            mask = owned.pop(h, 0) | bit  # pop + reinsert: a re-stored block becomes the newest entry
            owned[h] = mask
            self._holders.setdefault(h, {})[worker_id] = mask
            if groups is not None:
                groups.setdefault((h, bit), set()).add(group)
        self._enforce_bound(worker_id, owned)

    def remove_blocks(self, worker_id: WorkerId, hashes: Iterable[BlockKey], medium: str | None,
                      group: int | None = None) -> None:
        """The blocks left `medium`: the worker's entries of a local tier; every worker's of a shared tier (one
        backend: a block evicted from it by one worker is gone for all). With `group`, only that KV-cache group's
        copy left: the entry stays while another group of the worker holds the block in that tier."""
        tier = normalize_medium(medium)
        bit = TIER_BIT[tier]
        for h in hashes:
            holders = list(self._holders.get(h, ())) if tier in SHARED_TIERS else [worker_id]
            for w in holders:
                if group is None or not self._other_group_holds(w, h, bit, group):
                    self._unset(w, h, bit)

    def _other_group_holds(self, worker_id: WorkerId, h: BlockKey, bit: int, group: int) -> bool:
        """Forget `group`'s copy; whether another group still holds the block in that tier."""
        groups = self._groups.get(worker_id, {}).get((h, bit))
        if groups is None:
            return False  # stored without naming a group: the removal takes it
        groups.discard(group)
        return bool(groups)

    def _unset(self, worker_id: WorkerId, h: BlockKey, bit: int) -> None:
        owned = self._owned.get(worker_id, {})
        if h not in owned:
            return
        self._groups.get(worker_id, {}).pop((h, bit), None)
        mask = owned[h] & ~bit
        if mask:
            owned[h] = self._holders[h][worker_id] = mask
        else:
            self._drop(worker_id, owned, h)

    def clear_worker(self, worker_id: WorkerId) -> None:
        """Drop every entry of a worker (`AllBlocksCleared`); its sequence tracking stays."""
        owned = self._owned.pop(worker_id, {})
        self._groups.pop(worker_id, None)
        for h in owned:
            self._unlink(worker_id, h)

    def clear_tier(self, worker_id: WorkerId, medium: str) -> None:
        """Drop one tier's entries (`AllBlocksCleared(medium)`): the worker's own for a local tier, every worker's
        for a shared tier (one backend for all); entries in other tiers stay, in their insertion order."""
        tier = normalize_medium(medium)
        bit = TIER_BIT[tier]
        workers = list(self._owned) if tier in SHARED_TIERS else [worker_id]
        for w in workers:
            for h in [h for h, mask in self._owned.get(w, {}).items() if mask & bit]:
                self._unset(w, h, bit)

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget a worker entirely (dead or drained): entries and sequence tracking."""
        self.clear_worker(worker_id)
        self._next_seq.pop(worker_id, None)

    def load_snapshot(self, worker_id: WorkerId, blocks: Iterable[tuple[BlockKey, str | None]], next_seq: int) -> None:
        """Replace a worker's entries by a snapshot of (hash, medium) and expect `next_seq` next (resync after a gap
        that the replay buffer no longer covers)."""
        self.clear_worker(worker_id)
        for h, medium in blocks:
            if tier_of_medium(medium) is None:
                self.unknown_media[medium] += 1
                continue
            self.add_blocks(worker_id, (h,), medium)
        self._next_seq[worker_id] = next_seq

    def _enforce_bound(self, worker_id: WorkerId, owned: dict[BlockKey, int]) -> None:
        while len(owned) > self.config.max_blocks_per_worker:
            self._drop(worker_id, owned, next(iter(owned)))
            self.num_dropped += 1

    def _drop(self, worker_id: WorkerId, owned: dict[BlockKey, int], h: BlockKey) -> None:
        mask = owned.pop(h)
        groups = self._groups.get(worker_id)
        if groups:
            for bit in TIER_BIT.values():
                if mask & bit:
                    groups.pop((h, bit), None)
        self._unlink(worker_id, h)

    def _unlink(self, worker_id: WorkerId, h: BlockKey) -> None:
        holders = self._holders[h]
        del holders[worker_id]
        if not holders:
            del self._holders[h]

    # ------------------------------------------------------------------------------------------------- queries

    def match(self, hashes: Sequence[BlockKey]) -> MatchResult:
        """Walk the chain until nobody holds the next block. O(blocks × holders per block); reads only."""
        shared: list[int] = []
        local: dict[WorkerId, dict[int, int]] = {}
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            shared_mask = 0
            for w, mask in holders.items():
                shared_mask |= mask & SHARED_MASK
                own = mask & ~SHARED_MASK
                if own:
                    local.setdefault(w, {})[i] = own
            shared.append(shared_mask)
        return MatchResult(len(hashes), len(shared), tuple(shared), local)

    # --------------------------------------------------------------------------------------------- inspection

    def expected_seq(self, worker_id: WorkerId) -> int | None:
        return self._next_seq.get(worker_id)

    def worker_ids(self) -> tuple[WorkerId, ...]:
        return tuple(sorted(set(self._owned) | set(self._next_seq)))

    def num_blocks(self, worker_id: WorkerId | None = None) -> int:
        """Distinct blocks indexed (of one worker, or overall)."""
        if worker_id is None:
            return len(self._holders)
        return len(self._owned.get(worker_id, ()))

    def blocks_of(self, worker_id: WorkerId) -> dict[BlockKey, tuple[str, ...]]:
        return {h: tiers_of(m) for h, m in self._owned.get(worker_id, {}).items()}

    def check_integrity(self) -> None:
        """`_holders` and `_owned` describe the same (hash, worker, mask) entries; no empty masks or holder sets."""
        from_owned = {(h, w, m) for w, owned in self._owned.items() for h, m in owned.items()}
        from_holders = {(h, w, m) for h, hs in self._holders.items() for w, m in hs.items()}
        assert from_owned == from_holders, "holders and owned entries disagree"
        assert all(m for _, _, m in from_owned), "an entry has an empty tier mask"
        assert all(self._holders.values()), "a hash has an empty holder set"
        assert all(len(o) <= self.config.max_blocks_per_worker for o in self._owned.values())
        for w, groups in self._groups.items():
            for (h, bit), held_by in groups.items():
                assert held_by, "a group set is empty"
                assert self._owned.get(w, {}).get(h, 0) & bit, "a group entry outlived its tier bit"
