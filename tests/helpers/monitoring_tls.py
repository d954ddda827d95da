"""Certificates for the monitoring servers' TLS (monitoring.tls) in tests: a CA and a server
certificate for an address, made with `cryptography` (EC P-256, as the lab's CA), and the stack
config with them as an engine would hand them over (`secure:` values, the CA in plain text)."""

from __future__ import annotations

import datetime
import functools
import ipaddress
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_certificate: str
    certificate: str
    private_key: str


def _pem(certificate: x509.Certificate) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode()


def issue(ip: str, serial: int = 1, days: int = 30) -> Pki:
    """A CA and a certificate for `ip` (subjectAltName IP) from it, valid for `days` from now (or
    expired `-days` ago); the same for the same arguments within one test run, another for
    another `serial` (a rotation)."""
    return _issue(ip, serial, days)


@functools.lru_cache(maxsize=16)
def _issue(ip: str, serial: int, days: int) -> Pki:
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    if days <= 0:  # expired `-days` ago: valid for as long before that
        now += datetime.timedelta(days=2 * days - 1)
        days = -days + 1
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"qwen-cluster test CA {serial}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(serial)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(serial + 1000)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    private_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return Pki(_pem(ca), _pem(server), private_key)


def tls_section(pki: Pki) -> dict[str, Any]:
    """`monitoring.tls` as the engine hands it to the program: the pair secret, the CA plain."""
    return {
        "certificate": {"secure": pki.certificate},
        "privateKey": {"secure": pki.private_key},
        "caCertificate": pki.ca_certificate,
    }


def with_monitoring(stack_config: dict[str, Any], pki: Pki, password: str | None = None) -> dict[str, Any]:
    """A stack file's config map with monitoring.tls (and monitoring.password) set."""
    key = "qwen-cluster:monitoring"
    section = {**(stack_config.get(key) or {}), "tls": tls_section(pki)}
    if password is not None:
        section["password"] = {"secure": password}
    return {**stack_config, key: section}
