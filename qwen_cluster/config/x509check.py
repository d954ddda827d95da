"""A certificate chain and its private key judged as a TLS server would use them, before any host
sees them: parsed, matched, in date, in order, naming the server. Pure: the caller gives the time.

    certificate_problems(chain_pem, key_pem, now=..., names=()) -> (errors, warnings)
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

# `cryptography` is imported where a pair is judged, not with the module: qwen_cluster.config is
# imported by what runs on the nodes and in the lab's stand-in images (the vLLM stand-in reads
# HEALTH_PATH through it), whose Python has no cryptography.

# A certificate that expires within this many days is said (an advisory, not a refusal). Certbot,
# the most common ACME client, renews a certificate once it has 30 days left (its documented
# default `renew_before_expiry = 30 days`, certbot docs "Configuration file"): a certificate closer
# to its end than that is one whose automated renewal has already failed or was never set up.
EXPIRY_ADVISORY_DAYS = 30


def _name(certificate: x509.Certificate) -> str:
    return certificate.subject.rfc4514_string() or "an empty subject"


def _label(index: int, certificate: x509.Certificate) -> str:
    return f"certificate {index + 1} ({_name(certificate)})"


def _signed(child: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether `issuer` signed `child` (names and signature; validity and constraints apart)."""
    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm

    try:
        child.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _public_key_der(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _covers(pattern: str, name: str) -> bool:
    """A DNS name of the certificate covers `name` (RFC 6125 section 6.4.3: a wildcard is the whole
    leftmost label and stands for exactly one label; names compare case-insensitively)."""
    pattern, name = pattern.lower().rstrip("."), name.lower().rstrip(".")
    if pattern.startswith("*."):
        head, _, rest = name.partition(".")
        return bool(head) and rest == pattern[2:]
    return pattern == name


def _name_problems(leaf: x509.Certificate, names: Iterable[str]) -> list[str]:
    from cryptography import x509

    wanted = [name for name in names if name]
    if not wanted:
        return []
    try:
        alternative = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        # Browsers and Go's crypto/tls ignore the common name (RFC 6125 section 6.4.4 leaves it as
        # a fallback only); a server certificate names its server in subjectAltName.
        return [
            f"certificate 1 ({_name(leaf)}) has no subjectAltName, so it names no server: "
            f"clients reaching {', '.join(wanted)} would refuse it"
        ]
    dns = alternative.get_values_for_type(x509.DNSName)
    addresses = alternative.get_values_for_type(x509.IPAddress)
    missing = []
    for name in wanted:
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            if not any(_covers(pattern, name) for pattern in dns):
                missing.append(name)
        else:
            if address not in addresses:
                missing.append(name)
    if not missing:
        return []
    held = ", ".join([*dns, *map(str, addresses)]) or "nothing"
    return [
        f"certificate 1 ({_name(leaf)}) does not name {', '.join(missing)} (its subjectAltName "
        f"holds {held}): clients reaching the server by that name would refuse it"
    ]


def certificate_problems(
    chain_pem: str,
    key_pem: str,
    *,
    now: datetime,
    names: Iterable[str] = (),
    advisory_days: int = EXPIRY_ADVISORY_DAYS,
) -> tuple[list[str], list[str]]:
    """The errors and the warnings of a PEM chain (server certificate first, then each issuer,
    as nginx's ssl_certificate and Prometheus's web config cert_file read it) with its PEM key.

    Errors: unparsable PEM, a key that is not the server certificate's, a certificate expired or
    not yet valid, a chain out of order (each certificate must be signed by the next), a server
    certificate that does not name every one of `names` (DNS names or IP addresses). Warnings: a
    certificate that expires within `advisory_days`. Messages speak of `certificate` and
    `privateKey` (the keys' names under `loadBalancer.tls`) and never show the key."""
    from cryptography import x509
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    errors: list[str] = []
    warnings: list[str] = []
    try:
        chain = x509.load_pem_x509_certificates(chain_pem.encode())
    except ValueError as exc:
        errors.append(f"certificate is not a readable PEM certificate chain ({exc})")
        chain = []
    try:
        key = serialization.load_pem_private_key(key_pem.encode(), password=None)
    except TypeError:
        errors.append(
            "privateKey is encrypted: the server would ask for a passphrase at every start; "
            "give it unencrypted (it is a Pulumi secret)"
        )
        key = None
    except (ValueError, UnsupportedAlgorithm):
        # The library's message may quote the key's bytes: not shown.
        errors.append("privateKey is not a readable PEM private key (the value is not shown)")
        key = None
    if not chain:
        return errors, warnings

    public = _public_key_der(key.public_key()) if key is not None else None
    if public is not None and public != _public_key_der(chain[0].public_key()):
        matching = [i for i, c in enumerate(chain) if _public_key_der(c.public_key()) == public]
        where = (
            f"; it is the key of {_label(matching[0], chain[matching[0]])}: the server certificate "
            "comes first in the chain"
            if matching
            else ""
        )
        errors.append(f"privateKey does not match the server certificate, {_label(0, chain[0])}{where}")

    pairs = list(zip(chain, chain[1:], strict=False))
    if pairs and not all(_signed(child, issuer) for child, issuer in pairs):
        backwards = list(reversed(chain))
        if all(_signed(child, issuer) for child, issuer in zip(backwards, backwards[1:], strict=False)):
            errors.append(
                f"certificate is in reverse order: {_label(len(chain) - 1, chain[-1])} is the "
                "server's; the server certificate comes first, then the certificate that "
                "signed it, and so on"
            )
        else:
            for index, (child, issuer) in enumerate(pairs):
                if not _signed(child, issuer):
                    errors.append(
                        f"certificate is out of order: {_label(index + 1, issuer)} did not sign "
                        f"{_label(index, child)}; each certificate must be followed by its issuer"
                    )
                    break

    for index, certificate in enumerate(chain):
        label = _label(index, certificate)
        after, before = certificate.not_valid_after_utc, certificate.not_valid_before_utc
        if after <= now:
            errors.append(f"certificate: {label} expired on {after:%Y-%m-%d %H:%M} UTC")
        elif before > now:
            errors.append(f"certificate: {label} is not valid before {before:%Y-%m-%d %H:%M} UTC")
        elif after - now <= timedelta(days=advisory_days):
            left = (after - now).days
            warnings.append(
                f"certificate: {label} expires on {after:%Y-%m-%d} UTC, in {left} days "
                f"(less than {advisory_days}): renew it"
            )
    errors += _name_problems(chain[0], names)
    return errors, warnings


def utc_now() -> datetime:
    return datetime.now(UTC)


def server_names(chain_pem: str) -> tuple[str, ...]:
    """The DNS names and IP addresses the server certificate (the chain's first) holds in its
    subjectAltName; () without one or when unreadable (certificate_problems says why)."""
    from cryptography import x509

    try:
        leaf = x509.load_pem_x509_certificates(chain_pem.encode())[0]
        alternative = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, IndexError, x509.ExtensionNotFound):
        return ()
    return (
        *alternative.get_values_for_type(x509.DNSName),
        *map(str, alternative.get_values_for_type(x509.IPAddress)),
    )


def issuer_problems(chain_pem: str, ca_pem: str) -> list[str]:
    """Whether clients that trust `ca_pem` alone (Prometheus's `tls_config.ca_file`, doctor) accept
    the chain: its last certificate is that CA or was signed by it. Messages speak of
    `caCertificate` (monitoring.tls)."""
    from cryptography import x509

    try:
        chain = x509.load_pem_x509_certificates(chain_pem.encode())
        authority = x509.load_pem_x509_certificate(ca_pem.encode())
    except ValueError as exc:
        return [f"caCertificate is not a readable PEM certificate ({exc})"]
    top = chain[-1]
    if top == authority or _signed(top, authority):
        return []
    return [
        f"caCertificate ({_name(authority)}) did not issue {_label(len(chain) - 1, top)}: Prometheus and "
        "doctor trust that CA alone and would refuse the servers"
    ]
