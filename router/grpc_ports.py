"""The router's gRPC ports: the public one, and with `--registry-port` the workers' own (issue 15).

    no --registry-port (-1, as before):
      host:grpc-port           Strata + Registry + health + reflection   one pool (service.GRPC_THREADS)
                               TLS: --tls-* or fleet TLS without client certificates (never both), else plain text
    --registry-port P (0 = a free port):
      host:grpc-port           Strata + health + reflection              TLS: --tls-*, else fleet TLS without client
                                                                         certificates, else plain text
      registry-host:P          Registry + health                         its own small pool (REGISTRY_THREADS);
                                                                         fleet mTLS (a CA-signed client certificate
                                                                         required), else plain text

The fleet secret guards the Registry wherever it is served (`service.make_grpc_server`); a Registry call on a public
port that does not serve it is UNIMPLEMENTED. Why a port of its own: public clients never share the workers' door,
so it can require client certificates, and heartbeats never wait behind client streams for a thread.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc

from router.auth import ApiKeys
from router.service import (GRPC_THREADS, RegistryService, ServedHealth, StrataService, add_services, make_grpc_server,
                            mark_serving)

REGISTRY_THREADS = 64   # heartbeats and registrations are short unary calls: a few threads answer a large fleet
SHARED = -1             # --registry-port: the Registry stays on the public port


@dataclass
class GrpcPorts:
    """The started servers and the addresses they listen on; `registry_address` is `public_address` when the
    Registry shares the public port."""

    public: grpc.Server
    public_address: str
    registry_address: str
    health: tuple[ServedHealth, ...]
    registry: grpc.Server | None = None

    def mark_serving(self) -> None:
        for served in self.health:
            mark_serving(served)

    def enter_graceful_shutdown(self) -> None:
        for served in self.health:
            served.servicer.enter_graceful_shutdown()

    def stop(self, grace_s: float = 3.0) -> None:
        """The public port first; the registry port last, so workers' heartbeats are answered while clients drain."""
        for server in (self.public, self.registry):
            if server is not None:
                server.stop(grace=grace_s).wait(grace_s + 1)


def open_grpc_ports(args: argparse.Namespace, strata: StrataService, registry: RegistryService) -> GrpcPorts:
    """Bind and start the public server (and the registry server with `--registry-port`); SystemExit naming the
    address that cannot be bound."""
    own_port = args.registry_port != SHARED
    public = make_grpc_server(GRPC_THREADS, keys=args.keys, cluster_secret="" if own_port else args.cluster_secret,
                              max_request_bytes=args.max_request_bytes)
    health = [add_services(public, strata, None if own_port else registry)]
    public_address = _bind(public, args.host, args.grpc_port, lambda address: _add_public_port(public, address, args))
    registry_address, registry_server = public_address, None
    if own_port:
        registry_server = make_grpc_server(REGISTRY_THREADS, keys=ApiKeys(), cluster_secret=args.cluster_secret,
                                           max_request_bytes=args.max_request_bytes)
        health.append(add_services(registry_server, None, registry, reflect=False))
        registry_address = _bind(registry_server, args.registry_host or args.host, args.registry_port,
                                 lambda address: args.fleet_tls.add_port(registry_server, address,
                                                                         require_client_auth=True))
    ports = GrpcPorts(public, public_address, registry_address, tuple(health), registry_server)
    public.start()
    if registry_server is not None:
        registry_server.start()
    return ports


def _bind(server: grpc.Server, host: str, port: int, add_port) -> str:
    bound = add_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"router: cannot bind gRPC port {host}:{port}")
    return f"{host}:{bound}"


def _add_public_port(server: grpc.Server, address: str, args: argparse.Namespace) -> int:
    """Over TLS with --tls-cert-file / --tls-key-file, else with fleet TLS (--fleet-tls-*), else plain text. NOTE:
    fleet TLS asks no client certificate here (`require_client_auth=False`): public clients connect over TLS,
    verifying the router with the fleet CA; the Registry, when it shares this port, is kept to the fleet by the
    fleet secret (with --registry-port it has a port of its own, full mTLS). The workers' own ports are full mTLS."""
    if args.tls_cert_file:
        with open(args.tls_key_file, "rb") as key, open(args.tls_cert_file, "rb") as cert:
            credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
        return server.add_secure_port(address, credentials)
    return args.fleet_tls.add_port(server, address, require_client_auth=False)
