"""KV events (DESIGN §6), wire-compatible with vLLM's ZeroMQ KV-event stream.

    from kvstore.events import BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch
    from kvstore.events import ZmqEventPublisher, ZmqEventSubscriber
"""
from kvstore.events.types import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)

from kvstore.events.holdings import Holdings
from kvstore.events.publisher import DEFAULT_TOPIC, ZmqEventPublisher, worker_topic
from kvstore.events.snapshot import Snapshot
from kvstore.events.subscriber import ReceivedBatch, ZmqEventSubscriber
from kvstore.events.wire import WIRE_PRESETS, DecodeStats, WireError, WireOptions, decode_batch, encode_batch

__all__ = [
    "DEFAULT_TOPIC", "ZmqEventPublisher", "worker_topic", "ReceivedBatch", "ZmqEventSubscriber",
    "WIRE_PRESETS", "DecodeStats", "WireError", "WireOptions", "decode_batch", "encode_batch", "Holdings", "Snapshot",
    "MEDIUM_DEVICE", "AllBlocksCleared", "BlockRemoved", "BlockStored", "ExternalBlockHash", "KVEvent", "KVEventBatch",
]
