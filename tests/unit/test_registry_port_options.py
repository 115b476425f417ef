"""The router's registry port (issue 15) without processes: its flags and their refusals, the READY line old and new
readers parse, `strata serve` pointing its workers at the registry port, and the `--ca-file` of the operator CLI and
`StrataClient`."""
from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from router.__main__ import parse_args
from strata.cli import app
from strata.client import CA_FILE_ENV, StrataClient, tls_credentials
from strata.dev_certs import CertFiles, write_fleet_certs
from strata.launcher import ROUTER_READY, WORKER_READY, LocalLauncher, ServeConfig, registry_of


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[CertFiles, CertFiles]:
    return write_fleet_certs(tmp_path_factory.mktemp("certs"))


def fleet_flags(files: CertFiles) -> list[str]:
    return ["--fleet-tls-cert-file", files.cert, "--fleet-tls-key-file", files.key, "--fleet-tls-ca-file", files.ca]


def public_flags(files: CertFiles) -> list[str]:
    return ["--tls-cert-file", files.cert, "--tls-key-file", files.key]


# ------------------------------------------------------------------------------------------------ router flags

def test_the_registry_shares_the_grpc_port_unless_a_registry_port_is_given():
    assert parse_args([]).registry_port == -1
    args = parse_args(["--registry-port", "0", "--registry-host", "10.0.0.5"])
    assert (args.registry_port, args.registry_host) == (0, "10.0.0.5")
    assert parse_args(["--registry-port", "0"]).registry_host is None  # None: the same --host


def test_public_tls_and_fleet_tls_go_together_only_with_a_registry_port(certs, capsys):
    fleet, public = certs
    args = parse_args(fleet_flags(fleet) + public_flags(public) + ["--registry-port", "0"])
    assert args.fleet_tls.enabled and args.tls_cert_file == public.cert
    with pytest.raises(SystemExit):
        parse_args(fleet_flags(fleet) + public_flags(public))
    assert "give --registry-port" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--registry-port", "-2"], "--registry-port must be in [-1, 65535]"),
    (["--registry-port", "70000"], "--registry-port must be in [-1, 65535]"),
    (["--grpc-port", "50051", "--registry-port", "50051"], "--registry-port must differ from --grpc-port (50051)"),
])
def test_a_bad_registry_port_is_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ READY line

def test_old_readers_still_match_the_ready_line_and_new_ones_find_the_registry():
    new = "READY grpc=127.0.0.1:50051 http=127.0.0.1:8000 registry=127.0.0.1:50052"
    old_reader = re.match(r"READY grpc=(\S+) http=(\S+)", new)
    assert old_reader.groups() == ("127.0.0.1:50051", "127.0.0.1:8000")
    assert registry_of(ROUTER_READY.match(new)) == "127.0.0.1:50052"
    no_http = ROUTER_READY.match("READY grpc=127.0.0.1:50051 http= registry=127.0.0.1:50052")
    assert no_http.groups() == ("127.0.0.1:50051", "", "127.0.0.1:50052")
    # a router that prints no registry field: workers register at its gRPC address
    assert registry_of(ROUTER_READY.match("READY grpc=127.0.0.1:50051 http=")) == "127.0.0.1:50051"


# ------------------------------------------------------------------------------------------------ strata serve

def test_serve_config_takes_a_registry_port_and_refuses_a_bad_one():
    assert ServeConfig().registry_port == 0
    assert ServeConfig(registry_port=-1).registry_port == -1
    with pytest.raises(ValueError, match=r"registry_port must be in \[-1, 65535\].*got 65536"):
        ServeConfig(registry_port=65536)


class FakeChild:
    def __init__(self, name: str, role: str, args: list[str], ready: re.Match) -> None:
        self.name, self.role, self.args, self.ready_match = name, role, args, ready
        self.proc = SimpleNamespace(pid=1000 + len(name))


def test_serve_starts_the_router_with_a_registry_port_and_points_workers_at_it(monkeypatch, tmp_path):
    """The workers' --router is the READY line's registry address; ListWorkers (waiting for them) asks the public
    gRPC address; both are in the cluster's info."""
    launcher = LocalLauncher(ServeConfig(prefill=1, decode=1, grpc_port=0, data_dir=str(tmp_path)), log=io.StringIO())
    spawned: dict[str, FakeChild] = {}
    lines = {"router": "READY grpc=127.0.0.1:41000 http=127.0.0.1:41001 registry=127.0.0.1:41002"}

    def spawn(name, role, module, args, ready):
        line = lines.get(name, f"READY 127.0.0.1:{42000 + len(spawned)} role={role} worker_id={name} transfer=shm")
        spawned[name] = FakeChild(name, role, args, ready.match(line))
        return spawned[name]

    asked: list[str] = []
    monkeypatch.setattr(launcher, "_spawn", spawn)
    monkeypatch.setattr(launcher, "_wait_ready", lambda children, timeout_s: [c.ready_match for c in children])
    monkeypatch.setattr(launcher, "_wait_registered", lambda address, ids: asked.append(address))
    info = launcher._start()
    router_args = spawned["router"].args
    assert router_args[router_args.index("--registry-port") + 1] == "0"
    for name in ("prefill-0", "decode-0"):
        worker_args = spawned[name].args
        assert worker_args[worker_args.index("--router") + 1] == "127.0.0.1:41002"
        assert spawned[name].ready_match.re is WORKER_READY
    assert asked == ["127.0.0.1:41000"]
    assert (info.grpc_address, info.registry_address) == ("127.0.0.1:41000", "127.0.0.1:41002")


def test_serve_flag_reaches_the_serve_config(monkeypatch):
    from tests.unit.recording_launcher import RecordingLauncher

    monkeypatch.setattr("strata.launcher.LocalLauncher", RecordingLauncher)
    RecordingLauncher.configs.clear()
    out = CliRunner().invoke(app, ["serve", "--registry-port", "-1"])
    assert out.exit_code == 3, out.output  # the recording launcher's "not started"
    assert RecordingLauncher.configs[-1].registry_port == -1


# ------------------------------------------------------------------------------------------------ --ca-file

def test_client_ca_file_gives_tls_credentials_and_names_an_unreadable_file(certs, tmp_path, monkeypatch):
    fleet, _ = certs
    monkeypatch.delenv(CA_FILE_ENV, raising=False)
    assert tls_credentials() is None and tls_credentials("") is None
    assert tls_credentials(fleet.ca) is not None
    monkeypatch.setenv(CA_FILE_ENV, fleet.ca)
    assert tls_credentials() is not None and tls_credentials("") is None  # "" turns the environment's off
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=r"ca_file '.*nope.pem' cannot be read"):
        StrataClient("127.0.0.1:1", ca_file=missing)


@pytest.mark.parametrize("command", [["workers"], ["cache", "stats"], ["cache", "flush", "--yes"],
                                     ["cache", "evict", "--bytes", "1"]])
def test_cli_ca_file_that_cannot_be_read_is_a_usage_error(command, tmp_path):
    out = CliRunner().invoke(app, [*command, "--router", "127.0.0.1:1", "--ca-file", str(tmp_path / "nope.pem")])
    assert out.exit_code == 2 and "--ca-file" in out.output and "nope.pem" in out.output, out.output
