"""A certificate authority of the lab's own, made per lab with the openssl CLI, and the load
balancer's certificate from it: the lab serves `loadBalancer.tls` as a stack would, and its
clients trust this CA alone. The monitoring servers' certificate (`monitoring.tls`) comes from
the same CA (`issue`).

    ensure(directory, ip) -> Authority     made once per lab (kept across `lab up` / upgrades)
    issue(authority, ip, stem) -> (certificate, key) paths, made once per stem
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

# Short-lived: a lab lasts minutes; a certificate that outlived it would be of no use.
DAYS = 2


@dataclass(frozen=True)
class Authority:
    directory: Path

    @property
    def ca_certificate(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def certificate(self) -> Path:
        return self.directory / "server.pem"

    @property
    def private_key(self) -> Path:
        return self.directory / "server-key.pem"


_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, text=True)


def ensure(directory: Path, ip: str) -> Authority:
    """The lab CA and a server certificate for `ip` (subjectAltName IP), EC P-256, made once."""
    authority = Authority(directory)
    if authority.certificate.exists() and authority.private_key.exists():
        return authority
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca_key = directory / "ca-key.pem"
    _openssl(
        "req", "-x509", *_CURVE, "-keyout", str(ca_key), "-out", str(authority.ca_certificate),
        "-days", str(DAYS), "-subj", "/CN=qwen-cluster lab CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
    )  # fmt: skip
    _server(authority, ip, authority.certificate, authority.private_key)
    return authority


def _server(authority: Authority, ip: str, certificate: Path, private_key: Path) -> None:
    directory = authority.directory
    request = directory / f"{certificate.stem}.csr"
    _openssl(
        "req", "-new", *_CURVE, "-keyout", str(private_key), "-out", str(request), "-subj", f"/CN={ip}",
    )  # fmt: skip
    extensions = directory / f"{certificate.stem}.ext"
    extensions.write_text(f"subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
    _openssl(
        "x509", "-req", "-in", str(request), "-CA", str(authority.ca_certificate),
        "-CAkey", str(directory / "ca-key.pem"), "-CAcreateserial", "-out", str(certificate),
        "-days", str(DAYS), "-extfile", str(extensions),
    )  # fmt: skip
    for path in directory.iterdir():
        path.chmod(0o600)


def issue(authority: Authority, ip: str, stem: str) -> tuple[Path, Path]:
    """Another server certificate for `ip` from the lab CA (`<stem>.pem`, `<stem>-key.pem`),
    made once: the monitoring servers', or a rotation's."""
    certificate = authority.directory / f"{stem}.pem"
    private_key = authority.directory / f"{stem}-key.pem"
    if not (certificate.exists() and private_key.exists()):
        _server(authority, ip, certificate, private_key)
    return certificate, private_key
