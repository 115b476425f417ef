"""Requests that do not decode are the caller's error: INVALID_ARGUMENT naming the field, never grpc's INTERNAL.

grpc-python answers a request its deserializer cannot parse with INTERNAL "Exception deserializing request!", as if
the server broke. `DecodeErrors` gives every unary-request method a deserializer that hands the failure on as an
`Undecodable`, which the method's wrapper aborts with INVALID_ARGUMENT: "text: not valid UTF-8 ..." when a string
field holds bytes that are not UTF-8 (proto3 strings must be), "request: not a serialized ..." otherwise.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor


class Undecodable(NamedTuple):
    """What the lenient deserializer returns for bytes that are not the method's request message."""

    message: str


class DecodeErrors(grpc.ServerInterceptor):
    """Wraps every unary-request handler (streaming requests are left as they are: none of the public ones)."""

    def __init__(self) -> None:
        # method -> (grpc's handler, its lenient twin), made once per method
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, _lenient_handler(handler))
        return cached[1]


def _lenient_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)

    def lenient(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # noqa: BLE001 - whatever the parser says, the bytes are the caller's
            return Undecodable(describe(raw, descriptor, exc))

    if handler.response_streaming:
        def stream(request, context):
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            yield from handler.unary_stream(request, context)
        return grpc.unary_stream_rpc_method_handler(stream, lenient, handler.response_serializer)

    def unary(request, context):
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return handler.unary_unary(request, context)
    return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)


def describe(raw: bytes, descriptor: Descriptor | None, exc: Exception) -> str:
    """The error message for bytes that did not parse: the first string field that is not UTF-8, by its path."""
    name = descriptor.full_name if descriptor is not None else "request message"
    field = bad_text_field(raw, descriptor) if descriptor is not None else None
    if field is not None:
        return f"{field}: not valid UTF-8 (a string field of {name} must be UTF-8 text)"
    return f"request: not a serialized {name} ({len(raw)} bytes): {exc}"


def bad_text_field(raw: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """Walk the wire format; the dotted path of the first string field whose bytes are not UTF-8 (None when there
    is none, or the bytes are not protobuf at all)."""
    try:
        for number, chunk in _length_delimited(raw):
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            path = prefix + field.name
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = bad_text_field(chunk, field.message_type, path + ".")
                if found is not None:
                    return found
    except IndexError:
        return None
    return None


def _length_delimited(raw: bytes):
    """(field number, payload) of every length-delimited field, skipping the others; IndexError when cut short."""
    pos = 0
    while pos < len(raw):
        key, pos = _varint(raw, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(raw, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _varint(raw, pos)
            if pos + size > len(raw):
                raise IndexError("cut short")
            yield number, raw[pos:pos + size]
            pos += size
        else:
            raise IndexError(f"wire type {wire}")


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
