"""A tcp read request as it crosses the wire: built and signed by the reader, checked and parsed by the owner.

    body    : msgpack [request_id, [[region_id, offset, length, lease_id], ...]]
    message : body                                   (no secret configured)
              HMAC-SHA256(secret, DOMAIN + body) + body     (a secret: 32 bytes of proof, then the body)

The owner trusts nothing in a message before it is parsed here: the proof is checked in constant time before the
body is unpacked, msgpack runs with limits that keep every allocation proportional to the message (itself at most
`MAX_HEADER_BYTES`), and every field is checked for its type and range. What fails raises `MalformedRequest` or
`AccessDenied`, which the server answers with an error reply; bounds against a region and leases are the server's.

NOTE: the proof authenticates the request, it does not encrypt anything: whoever can watch the wire sees the
bytes it asks for. It keeps a peer without the fleet's secret (a scanner, another tenant's process) out.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any, NamedTuple

import msgpack

from kvstore.transfer.base import MAX_REGION_ID_BYTES
from kvstore.transfer.errors import AccessDenied, MalformedRequest

MAX_READS_PER_REQUEST = 1 << 16  # a request for 64k blocks; the reader splits bigger batches
MAX_FIELD = (1 << 63) - 1        # offsets, lengths and lease ids are int64 everywhere else (control block, proto)
PROOF_BYTES = 32
DOMAIN = b"strata-transfer-read-v1\x00"


class ReadRequest(NamedTuple):
    region_id: str
    offset: int
    length: int
    lease_id: int | None


class Request(NamedTuple):
    request_id: int
    reads: list[ReadRequest]


def secret_key(secret: str) -> bytes:
    return secret.encode()


def encode_request(request_id: int, reads: list[list[Any]], key: bytes) -> bytes:
    """The reader's message; signed when `key` is set."""
    body = msgpack.packb([request_id, reads])
    return _proof(key, body) + body if key else body


def decode_request(message: bytes | bytearray, key: bytes) -> Request:
    """The owner's view of a message (`key` empty: no proof expected)."""
    body = _verified_body(memoryview(message), key)
    try:
        raw = msgpack.unpackb(body, use_list=True, raw=False, max_str_len=MAX_REGION_ID_BYTES * 4,
                              max_bin_len=0, max_ext_len=0, max_map_len=0, max_array_len=MAX_READS_PER_REQUEST)
    except (ValueError, msgpack.UnpackException) as exc:  # every unpack failure: garbage, limits, extra data
        raise MalformedRequest(f"request is not msgpack within the limits: {exc}") from None
    if not (isinstance(raw, list) and len(raw) == 2 and _is_uint(raw[0]) and isinstance(raw[1], list)):
        raise MalformedRequest("request must be [request_id, [[region_id, offset, length, lease_id], ...]]")
    return Request(raw[0], [_read(i, r) for i, r in enumerate(raw[1])])


def request_id_of(message: bytes | bytearray, key: bytes) -> int | None:
    """The id to answer a refused message with, when one can be read from it (None otherwise)."""
    body = bytes(memoryview(message)[PROOF_BYTES if key else 0:])
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(body), 1), max_str_len=0, max_bin_len=0, max_ext_len=0,
                                max_map_len=0, max_array_len=0)
    unpacker.feed(body)
    try:
        unpacker.read_array_header()
        request_id = unpacker.unpack()  # only the first element: the reads are not looked at
    except Exception:  # noqa: BLE001 - a best effort for the error reply only
        return None
    return request_id if _is_uint(request_id) else None


def _verified_body(message: memoryview, key: bytes) -> memoryview:
    if not key:
        return message
    if message.nbytes < PROOF_BYTES:
        raise AccessDenied("request carries no proof of the cluster secret")
    proof, body = message[:PROOF_BYTES], message[PROOF_BYTES:]
    if not hmac.compare_digest(bytes(proof), _proof(key, body)):
        raise AccessDenied("request's proof of the cluster secret is wrong (or missing)")
    return body


def _proof(key: bytes, body: bytes | memoryview) -> bytes:
    mac = hmac.new(key, DOMAIN, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def _read(index: int, raw: Any) -> ReadRequest:
    if not (isinstance(raw, list) and len(raw) == 4):
        raise MalformedRequest(f"read {index} must be [region_id, offset, length, lease_id]", index)
    region_id, offset, length, lease_id = raw
    if not isinstance(region_id, str) or not 0 < len(region_id.encode()) <= MAX_REGION_ID_BYTES:
        raise MalformedRequest(f"read {index}: region_id must be 1..{MAX_REGION_ID_BYTES} UTF-8 bytes", index)
    if not (_is_uint(offset) and _is_uint(length)):
        raise MalformedRequest(f"read {index}: offset and length must be integers in [0, 2**63)", index)
    if lease_id is not None and not _is_uint(lease_id):
        raise MalformedRequest(f"read {index}: lease_id must be an integer in [0, 2**63) or nil", index)
    return ReadRequest(region_id, offset, length, lease_id)


def _is_uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_FIELD
