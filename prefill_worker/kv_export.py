"""Prefill side of the KV hand-off: pin a finished prompt's full blocks in the hand-off region, write the new ones
to the store, and describe them in a `KvHandle` under one lease (DESIGN §2 step 3). The trailing partial block (the
prompt's last `len % block_size` tokens) goes in the handle's `tail`: hashed like a block (so the reader can verify
it), never stored or indexed, alive only under the lease.

Runs on the engine thread right after the step that sampled the first token: the request's blocks were just freed
(the full ones into the prefix cache), and no later step has run, so they all still hold its KV.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple, Sequence

from kvstore.hashing import hash_block
from kvstore.store import TieredStore
from kvstore.transfer import TransferAgent
from strata.v1 import common_pb2
from worker_common.engine_setup import EngineBundle
from worker_common.handoff_pool import HandoffPool
from worker_common.kv_blocks import encode_block, read_device_payloads, zero_unused_slots
from worker_common.leases import LeaseTable

log = logging.getLogger(__name__)


class Export(NamedTuple):
    handle: common_pb2.KvHandle
    store_s: float


class KvExporter:
    def __init__(self, bundle: EngineBundle, store: TieredStore, agent: TransferAgent, pool: HandoffPool,
                 leases: LeaseTable, worker_id: str) -> None:
        self.bundle, self.store, self.agent, self.pool, self.leases = bundle, store, agent, pool, leases
        self.worker_id = worker_id
        self.worker_address = ""          # set once the gRPC server listens

    def export(self, prompt: Sequence[int], hashes: Sequence[bytes], fingerprint: bytes, ttl_s: float,
               freed_block_ids: Sequence[int] = ()) -> Export:
        """`freed_block_ids`: the request's block table when it finished (its tail block is read from it)."""
        started = time.perf_counter()
        bs = self.bundle.block_size
        slots = self._pin_leading(prompt, hashes, fingerprint)
        handle = common_pb2.KvHandle(namespace_fingerprint=fingerprint, block_size=bs,
                                     block_hashes=list(hashes[:len(slots)]), num_tokens=len(slots) * bs)
        tail = None
        if len(slots) == len(hashes) == len(prompt) // bs and len(freed_block_ids) > len(hashes):
            tail = self._pin_tail(prompt, hashes, fingerprint, freed_block_ids[len(hashes)])
        if slots or tail is not None:
            lease = self.leases.grant(slots + ([tail] if tail is not None else []), ttl_s)
            handle.blocks.extend(self._location(slot, lease.transfer_lease_id) for slot in slots)
            if tail is not None:
                handle.tail.CopyFrom(self._location(tail, lease.transfer_lease_id))
                handle.tail_tokens = len(prompt) % bs
                handle.num_tokens += handle.tail_tokens
            handle.lease_id, handle.lease_deadline_unix_ms = lease.lease_id, lease.deadline_unix_ms
            handle.lease_worker_address = self.worker_address
            handle.agent_metadata = self.agent.export_metadata([lease.transfer_lease_id])
        return Export(handle, time.perf_counter() - started)

    def _pin_tail(self, prompt: Sequence[int], hashes: Sequence[bytes], fingerprint: bytes,
                  block_id: int) -> int | None:
        """A pinned slot holding the encoded partial last block (no store write), or None when none is free."""
        tokens = list(prompt[len(hashes) * self.bundle.block_size:])
        if not tokens:
            return None
        parent = hashes[-1] if hashes else fingerprint
        tail_hash = hash_block(parent, tokens)
        pinned = self.pool.pin(tail_hash)
        if pinned is None:
            return None
        if pinned.view is not None:
            payload = read_device_payloads(self.bundle, [block_id])[0]
            zero_unused_slots(self.bundle, payload, len(tokens))  # not whatever request held the block before
            length = encode_block(pinned.view, self.bundle, fingerprint, tail_hash, hashes[-1] if hashes else None,
                                  tokens, payload)
            self.pool.commit(pinned.slot, tail_hash, length)
        return pinned.slot

    def _pin_leading(self, prompt: Sequence[int], hashes: Sequence[bytes], fingerprint: bytes) -> list[int]:
        """Pin a slot per leading block (encoding the ones the region lacks); stops at the first that cannot be."""
        device = self.bundle.engine.block_manager.pool
        slots: list[int] = []
        fresh: list[tuple[int, int, memoryview]] = []   # (block index, slot, slot view)
        for i, block_hash in enumerate(hashes):
            block_id = device.lookup(block_hash)
            pinned = self.pool.pin(block_hash)
            if pinned is None:
                break
            if pinned.view is not None:
                if block_id is None:  # NOTE: not in the region and no longer on the device: the run ends here
                    self.pool.unpin([pinned.slot])
                    break
                fresh.append((i, pinned.slot, pinned.view))
            slots.append(pinned.slot)
        if fresh:
            self._encode(prompt, hashes, fingerprint, fresh)
        return slots

    def _encode(self, prompt: Sequence[int], hashes: Sequence[bytes], fingerprint: bytes,
                fresh: list[tuple[int, int, memoryview]]) -> None:
        device, bs = self.bundle.engine.block_manager.pool, self.bundle.block_size
        payloads = read_device_payloads(self.bundle, [device.lookup(hashes[i]) for i, _, _ in fresh])
        items = []
        for (i, slot, view), payload in zip(fresh, payloads):
            parent = hashes[i - 1] if i else None
            length = encode_block(view, self.bundle, fingerprint, hashes[i], parent, prompt[i * bs:(i + 1) * bs],
                                  payload)
            self.pool.commit(slot, hashes[i], length)
            items.append((hashes[i], view[:length]))
        self.store.put(items)  # host now (a memcpy), lower tiers in the background

    def _location(self, slot: int, transfer_lease_id: int) -> common_pb2.BlockLocation:
        desc = self.pool.descriptor(slot)
        return common_pb2.BlockLocation(worker_id=self.worker_id, backend=self.agent.backend,
                                        agent_address=desc.agent, region_id=desc.region_id, offset=desc.offset,
                                        length=desc.length, transfer_lease_id=transfer_lease_id)
