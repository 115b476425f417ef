"""KV event types (DESIGN §6): what a worker or the store tells routers about the blocks it holds.

The types mirror vLLM's published KV-event schema (vllm/distributed/kv_events.py, checked against vLLM 0.34) field
for field and in the same order, so `kvstore.events.wire` can encode them exactly the way msgspec encodes vLLM's
structs. They keep the fields a router acts on; vLLM's other defaulted fields (kv_cache_spec_kind, locality,
ownership, session_id, lookahead_token_ids, ...) are read and dropped by the decoder. Strata publishes its 16-byte
`BlockHash` values; a batch decoded from a vLLM publisher may carry `int` hashes (vLLM's default
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` sends the low 64 bits of its digest as an unsigned int).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

# What a hash looks like on the wire: Strata's 16 bytes, or an int from a vLLM publisher (vLLM's ExternalBlockHash).
ExternalBlockHash = Union[bytes, int]

# `medium` values Strata publishes: the tier names of DESIGN §5 ("GPU" is vLLM's name for the device tier).
MEDIUM_DEVICE = "GPU"
# What a block's extra hash keys look like on the wire: one entry per block (vLLM's LoRA name, multimodal
# (identifier, offset) pairs, cache salt), None where a block has none.
ExtraKeys = list[Union[list, tuple, None]]


@dataclass(frozen=True)
class BlockStored:
    """Blocks became readable in `medium` (tier name: "GPU", "host", "disk", "redis", "s3").

    `token_ids` holds the tokens of all `block_hashes` in order (len == len(block_hashes) * block_size);
    `parent_block_hash` is the hash before the first block, None when the chain starts at the namespace.
    `group_idx` names the publisher's KV-cache group (a hybrid model keeps one per attention type, each storing and
    evicting the same hash on its own); None: the publisher has one group (Strata's workers).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: ExtraKeys | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks are no longer readable in `medium` (in KV-cache group `group_idx`; None: in every group)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the publisher is gone (cache reset, restart); with `medium`, every block of that tier only
    (a flush of one tier, e.g. a shared redis or s3 tier whose keys the publisher cannot list).

    NOTE: `medium` is Strata's addition; vLLM's struct has no field. It goes on the wire only when set, as one
    key (map events) or trailing element (array events), which vLLM's msgspec decoders ignore, so a vLLM consumer
    reads a one-tier clear as a clear of the publisher's every tier: an under-estimate, never a wrong hit.
    """

    medium: str | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    """Events published together under one sequence number; `ts` is seconds since the epoch."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
