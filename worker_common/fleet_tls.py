"""Fleet TLS: the fleet's internal links encrypted, and the workers' doors open only to holders of a certificate the
fleet's CA signed (`--fleet-tls-cert-file / --fleet-tls-key-file / --fleet-tls-ca-file`, the same on every process).

    router ──channel(CA, its cert)──> worker gRPC port      mTLS: the worker requires a CA-signed client cert
    decode ──channel(CA, its cert)──> prefill gRPC port     mTLS (ReleaseKv)
    worker ──channel(CA, its cert)──> router registry port  mTLS (`--registry-port`: the workers' own port); the
                                                            Registry also wants the fleet secret
    worker ──channel(CA, its cert)──> router gRPC port      without --registry-port: TLS, verified against the CA, no
                                                            client cert required (public clients share the port: see
                                                            router/grpc_ports.py); the fleet secret keeps it closed
    decode ──ssl(CA, its cert)──────> prefill tcp transfer  mTLS (kvstore/transfer/tcp_tls.py)

Certificates name hosts: each process's certificate must name (SAN DNS or IP) the host its peers dial it at, since
every client checks it (gRPC and the tcp transfer alike). One certificate naming every host may serve the whole fleet.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

FIELDS = ("cert_file", "key_file", "ca_file")


@dataclass(frozen=True)
class FleetTls:
    """The three PEM files, all set (fleet TLS on) or all empty (off). Constructing one checks that the files can be
    read and hold what they should (a key that matches the certificate, at least one CA), naming the field."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    prefix: str = "fleet_tls_"   # how errors name the fields: `fleet_tls_cert_file`, or `--fleet-tls-cert-file`

    def __post_init__(self) -> None:
        given = [name for name in FIELDS if getattr(self, name)]
        if given and len(given) != len(FIELDS):
            missing = [self._label(n) for n in FIELDS if n not in given]
            raise ValueError(f"{', '.join(self._label(n) for n in FIELDS)} go together: give all three or none "
                             f"(missing: {', '.join(missing)})")
        if given:
            self._check_files()

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def _label(self, name: str) -> str:
        return self.prefix + (name.replace("_", "-") if self.prefix.startswith("--") else name)

    def _check_files(self) -> None:
        for name in FIELDS:
            path = getattr(self, name)
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{self._label(name)} {path!r} cannot be read: {exc.strerror}") from None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{self._label('cert_file')} {self.cert_file!r} and {self._label('key_file')} "
                             f"{self.key_file!r} must hold a PEM certificate and its private key: {exc}") from None
        try:
            context.load_verify_locations(cafile=self.ca_file)
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"{self._label('ca_file')} {self.ca_file!r} must hold PEM CA certificates: "
                             f"{exc}") from None

    def _pems(self) -> tuple[bytes, bytes, bytes]:
        return tuple(Path(getattr(self, name)).read_bytes() for name in FIELDS)  # type: ignore[return-value]

    def server_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials:
        """A gRPC port's credentials: this certificate; with `require_client_auth`, only clients showing a certificate
        the CA signed get through the handshake (mTLS)."""
        cert, key, ca = self._pems()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client's credentials: servers are verified against the CA, and this certificate is shown to them."""
        cert, key, ca = self._pems()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to `address`: over TLS with this fleet's credentials when on, else plain text."""
        if not self.enabled:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.channel_credentials(), options=list(options))

    def add_port(self, server: grpc.Server, address: str, require_client_auth: bool = True) -> int:
        """Bind `address` on `server`: TLS (mTLS by default) when on, else plain text. 0 = could not bind."""
        if not self.enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials(require_client_auth))


NO_TLS = FleetTls()


def add_fleet_tls_flags(p, what: str) -> None:
    """The three flags on an argparse parser (`what`: which links this process uses them for)."""
    p.add_argument("--fleet-tls-cert-file", default="", metavar="PEM",
                   help=f"fleet TLS: this process's certificate (signed by the fleet CA; it must name the host peers "
                        f"dial): {what}")
    p.add_argument("--fleet-tls-key-file", default="", metavar="PEM", help="fleet TLS: its private key")
    p.add_argument("--fleet-tls-ca-file", default="", metavar="PEM",
                   help="fleet TLS: the fleet CA certificate(s) every peer is verified against")
