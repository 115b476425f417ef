"""Typed transfer errors (DESIGN §7): every failed read raises one of these, never a bare library error or a hang.

Callers (the decode worker's KV pull) catch `TransferError` and fall back to the store, then to recompute.
"""
from __future__ import annotations


class TransferError(RuntimeError):
    """Base of every transfer failure. `desc_index` names the failing descriptor of a batch when one is known."""

    def __init__(self, message: str, desc_index: int | None = None) -> None:
        super().__init__(message)
        self.desc_index = desc_index


class PeerUnavailable(TransferError):
    """The owner process is gone, closed its agent, or its address cannot be reached."""


class UnknownRegion(TransferError):
    """The descriptor names a region the owner never registered (or has unregistered)."""


class LeaseExpired(TransferError):
    """The read's lease ran out or was released: the owner may already have reused the bytes."""


class TransferTimeout(TransferError):
    """The read did not complete before its deadline."""


class OutOfBounds(TransferError):
    """The descriptor's range falls outside its region, outside its lease, or overflows its destination buffer."""


class LeaseRequired(TransferError):
    """The read carries no lease, and the owner serves only leased ranges (tcp: a read reaches owner memory)."""


class AccessDenied(TransferError):
    """The request lacks a valid proof of the fleet's secret (`TransferConfig.secret`), or the owner has none."""


class MalformedRequest(TransferError):
    """The owner could not parse the request (wrong shape, bad field, past a size limit)."""


class BackendUnavailable(TransferError):
    """An optional backend (nixl, mooncake) was chosen but its package cannot be imported here."""
