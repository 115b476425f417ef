"""Fleet TLS options (`--fleet-tls-cert-file / --fleet-tls-key-file / --fleet-tls-ca-file`): all three or none, files
readable and holding what they should, the same on the worker CLI, the router, `strata serve`'s config and the
transfer config; every refusal names the option."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvstore.transfer import TransferConfig
from router.__main__ import parse_args
from strata.dev_certs import CertFiles, write_fleet_certs
from strata.launcher import ServeConfig, fleet_tls_args
from worker_common.cli import parse_config
from worker_common.config import WorkerConfig
from worker_common.fleet_tls import FleetTls


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[CertFiles, CertFiles]:
    return write_fleet_certs(tmp_path_factory.mktemp("certs"))


def flags(files: CertFiles) -> list[str]:
    return ["--fleet-tls-cert-file", files.cert, "--fleet-tls-key-file", files.key, "--fleet-tls-ca-file", files.ca]


def test_fleet_tls_is_off_without_files_and_on_with_all_three(certs):
    fleet, _ = certs
    assert not FleetTls().enabled
    assert FleetTls(fleet.cert, fleet.key, fleet.ca).enabled


@pytest.mark.parametrize("missing", ["cert_file", "key_file", "ca_file"])
def test_fleet_tls_wants_all_three_files_naming_the_missing_one(certs, missing):
    fleet, _ = certs
    files = {"cert_file": fleet.cert, "key_file": fleet.key, "ca_file": fleet.ca, missing: ""}
    with pytest.raises(ValueError, match=f"give all three or none \\(missing: fleet_tls_{missing}\\)"):
        FleetTls(**files)


def test_an_unreadable_file_is_refused_naming_it(certs, tmp_path):
    fleet, _ = certs
    with pytest.raises(ValueError, match="fleet_tls_ca_file '.*nope.pem' cannot be read"):
        FleetTls(fleet.cert, fleet.key, str(tmp_path / "nope.pem"))


def test_a_key_that_is_not_the_certificates_is_refused(certs):
    fleet, foreign = certs
    with pytest.raises(ValueError, match="must hold a PEM certificate and its private key"):
        FleetTls(fleet.cert, foreign.key, fleet.ca)


def test_a_ca_file_without_certificates_is_refused(certs, tmp_path):
    fleet, _ = certs
    (tmp_path / "empty.pem").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="fleet_tls_ca_file .* must hold PEM CA certificates"):
        FleetTls(fleet.cert, fleet.key, str(tmp_path / "empty.pem"))


def test_worker_config_validates_the_three_fields_together(certs):
    fleet, _ = certs
    with pytest.raises(ValueError, match="fleet_tls_key_file"):
        WorkerConfig(role="decode", model="-", fleet_tls_cert_file=fleet.cert, fleet_tls_ca_file=fleet.ca)
    config = WorkerConfig(role="decode", model="-", fleet_tls_cert_file=fleet.cert, fleet_tls_key_file=fleet.key,
                          fleet_tls_ca_file=fleet.ca)
    assert config.fleet_tls() == FleetTls(fleet.cert, fleet.key, fleet.ca)


def test_worker_cli_fills_the_config_and_refuses_a_partial_set(certs, capsys):
    fleet, _ = certs
    config = parse_config("prefill", flags(fleet))
    assert (config.fleet_tls_cert_file, config.fleet_tls_key_file, config.fleet_tls_ca_file) == fleet
    with pytest.raises(SystemExit) as exit_info:
        parse_config("prefill", flags(fleet)[:4])
    assert exit_info.value.code == 2
    assert "missing: fleet_tls_ca_file" in capsys.readouterr().err


def test_router_cli_takes_fleet_tls_and_names_the_missing_flag(certs, capsys):
    fleet, _ = certs
    assert parse_args(flags(fleet)).fleet_tls == FleetTls(fleet.cert, fleet.key, fleet.ca, prefix="--fleet-tls-")
    assert not parse_args([]).fleet_tls.enabled
    with pytest.raises(SystemExit):
        parse_args(flags(fleet)[2:])
    assert "missing: --fleet-tls-cert-file" in capsys.readouterr().err


def test_router_refuses_public_tls_and_fleet_tls_on_its_one_port(certs, capsys):
    fleet, _ = certs
    with pytest.raises(SystemExit):
        parse_args(flags(fleet) + ["--tls-cert-file", fleet.cert, "--tls-key-file", fleet.key])
    assert "cannot both serve the router's one gRPC port" in capsys.readouterr().err


def test_serve_config_checks_the_files_and_hands_every_part_absolute_paths(certs, tmp_path, monkeypatch):
    fleet, _ = certs
    for name in ("cert", "key", "ca"):
        shutil.copy(getattr(fleet, name), tmp_path / f"{name}.pem")
    monkeypatch.chdir(tmp_path)
    config = ServeConfig(fleet_tls_cert_file="cert.pem", fleet_tls_key_file="key.pem", fleet_tls_ca_file="ca.pem")
    assert fleet_tls_args(config) == ["--fleet-tls-cert-file", str(tmp_path / "cert.pem"),
                                      "--fleet-tls-key-file", str(tmp_path / "key.pem"),
                                      "--fleet-tls-ca-file", str(tmp_path / "ca.pem")]
    assert fleet_tls_args(ServeConfig()) == []
    with pytest.raises(ValueError, match="missing: fleet_tls_key_file"):
        ServeConfig(fleet_tls_cert_file="cert.pem", fleet_tls_ca_file="ca.pem")


def test_transfer_config_wants_all_three_and_keeps_them_out_of_its_repr(certs):
    fleet, _ = certs
    with pytest.raises(ValueError, match="go together"):
        TransferConfig(backend="tcp", tls_cert_file=fleet.cert)
    config = TransferConfig(backend="tcp", tls_cert_file=fleet.cert, tls_key_file=fleet.key, tls_ca_file=fleet.ca)
    assert config.tls and not TransferConfig(backend="tcp").tls
    assert Path(fleet.key).name not in repr(config) and "tls_" not in repr(config)
