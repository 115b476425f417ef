"""Throwaway certificates for fleet TLS on one machine (tests, benchmarks, trying it out): a CA and certificates it
signs for `127.0.0.1` / `localhost`, written as PEM files. Never for production: the keys sit unencrypted on disk.

    fleet, foreign = write_fleet_certs(tmp_dir)   # CertFiles(cert, key, ca) each; `foreign`: another CA's
    python -m router --fleet-tls-cert-file fleet.cert --fleet-tls-key-file fleet.key --fleet-tls-ca-file fleet.ca
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import NamedTuple, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("127.0.0.1", "localhost")


class CertFiles(NamedTuple):
    """One certificate's PEM files and the CA that signed it (`ca`: that CA's certificate)."""

    cert: str
    key: str
    ca: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def make_ca(folder: Path, name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
    """A self-signed CA, valid for a day; its certificate written to `folder/name-ca.pem`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(f"{name} CA")).issuer_name(_name(f"{name} CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    path = folder / f"{name}-ca.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key, path


def issue(folder: Path, name: str, ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path],
          hosts: Sequence[str] = LOCAL_NAMES) -> CertFiles:
    """A certificate for `hosts` (SAN: IP addresses as IPs, names as DNS), good as server and as client."""
    ca_cert, ca_key, ca_path = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    return CertFiles(str(cert_path), str(key_path), str(ca_path))


def write_fleet_certs(folder: str | Path, hosts: Sequence[str] = LOCAL_NAMES) -> tuple[CertFiles, CertFiles]:
    """The fleet's files (a CA and one certificate for `hosts`) and, for tests of refusal, a foreign fleet's."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fleet = issue(folder, "fleet", make_ca(folder, "fleet"), hosts)
    foreign = issue(folder, "foreign", make_ca(folder, "foreign"), hosts)
    return fleet, foreign
