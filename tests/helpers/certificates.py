"""Certificates made in a test with `cryptography`: a CA, an intermediate, a server certificate,
each with the validity and names the test wants, as PEM text."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Issued:
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode()

    @property
    def key_pem(self) -> str:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()


def issue(
    common_name: str,
    issuer: Issued | None = None,
    *,
    ca: bool = False,
    names: tuple[str, ...] = (),
    not_before: datetime = NOW - timedelta(days=1),
    not_after: datetime = NOW + timedelta(days=90),
) -> Issued:
    """A certificate for `common_name`, signed by `issuer` (self-signed without one); `names` its
    subjectAltName (IP addresses or DNS names)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.certificate.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if names:
        entries: list[x509.GeneralName] = []
        for name in names:
            try:
                entries.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                entries.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
    signer = issuer.key if issuer else key
    return Issued(builder.sign(signer, hashes.SHA256()), key)


def chain(root_name: str = "test root CA", **server) -> tuple[Issued, Issued, Issued]:
    """A root CA, an intermediate it signed, and a server certificate the intermediate signed
    (`server`: issue()'s keywords)."""
    root = issue(root_name, ca=True, not_after=NOW + timedelta(days=3650))
    intermediate = issue("test intermediate CA", root, ca=True, not_after=NOW + timedelta(days=1825))
    leaf = issue("endpoint.example.com", intermediate, **{"names": ("endpoint.example.com",), **server})
    return root, intermediate, leaf
