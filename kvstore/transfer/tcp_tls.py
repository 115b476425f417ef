"""TLS for the `tcp` backend (`TransferConfig.tls_*`): the KV bytes encrypted on the wire, both ends authenticated.

    reader ──TCP──> owner ── TLS handshake (owner: CERT_REQUIRED, the reader's certificate must chain to the CA;
                              reader: the owner's certificate must chain to the CA and name the host it dialled)
                          ── then the same messages as plain tcp (tcp_server.py), inside TLS records

What TLS costs the plain path's shortcuts: the owner cannot splice region pages into the socket (the bytes must be
encrypted in user space first) and the reader cannot `recvmsg_into` (decrypted one record, <= 16 KiB, per call), so a
TLS read is a copy and a cipher pass on each side. Deadlines use Python's socket timeouts (the kernel's SO_RCVTIMEO
would surface inside OpenSSL as a WANT_READ error mid-record). A reader without TLS that dials a TLS owner fails its
handshake there: the owner closes the connection and the reader gets `PeerUnavailable` at once, no hang.
"""
from __future__ import annotations

import socket
import ssl
from typing import Sequence

from kvstore.transfer.base import TransferConfig
from kvstore.transfer.errors import AccessDenied, PeerUnavailable, TransferError

HANDSHAKE_TIMEOUT_S = 10.0   # the owner's bound on a connecting reader's handshake (a silent peer holds no thread)


def server_context(config: TransferConfig) -> ssl.SSLContext | None:
    """The owner's context (None: plain tcp): its certificate, and a reader certificate the CA signed required."""
    if not config.tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    context.load_verify_locations(cafile=config.tls_ca_file)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(config: TransferConfig) -> ssl.SSLContext | None:
    """The reader's context (None: plain tcp): owners verified against the CA (and their host name), its own
    certificate shown to them."""
    if not config.tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # NOTE: CERT_REQUIRED and check_hostname by default
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=config.tls_ca_file)
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    return context


def wrap_accepted(context: ssl.SSLContext, conn: socket.socket) -> ssl.SSLSocket:
    """The owner's side of a connection just accepted, not yet shaken hands (no I/O here: the accept loop never
    waits on a peer; `handshake` runs in the connection's own thread)."""
    return context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)


def handshake(conn: ssl.SSLSocket) -> None:
    """The owner's handshake, bounded by `HANDSHAKE_TIMEOUT_S`; `ssl.SSLError` (a plain-text reader, a certificate
    the CA did not sign, none at all) or `socket.timeout` when it fails."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    conn.do_handshake()
    conn.settimeout(None)


def send_tls(sock: ssl.SSLSocket, framed: bytes, payload: Sequence[memoryview] = ()) -> None:
    """A framed message (length prefix and header) and its payload over TLS (`SSLSocket` has no `sendmsg`; each view
    is encrypted from where it lies, never joined into one copy first)."""
    sock.sendall(framed)
    for view in payload:
        if view.nbytes:
            sock.sendall(view)


def tls_failure(error: ssl.SSLError, what: str) -> TransferError:
    """A reader's TLS error as a transfer error: `AccessDenied` when a certificate was refused (ours by the owner:
    an alert; the owner's by us: verification), else `PeerUnavailable` (a broken or closed connection)."""
    refused = isinstance(error, ssl.SSLCertVerificationError) or "ALERT" in (error.reason or "")
    return (AccessDenied if refused else PeerUnavailable)(f"{what}: {error}")
