"""The lab's own endpoint secrets, made once per lab: its API keys, its TLS certificate from
a lab CA (labkit/cluster/tlsca.py), its monitoring password and the monitoring servers'
certificate from the same CA. The lab hands them to the program
as a stack's secrets would be
(labkit/engine/substitutions.py), and its clients use them (`client_access`); nothing here prints them.

    ensure(directory, load_balancer_ip) -> Identity
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from labkit.cluster import tlsca
from labkit.cluster.probes import ClientAccess

KEY_COUNT = 2  # the first is in use; the second lets a test rotate to a key the lab knows


@dataclass(frozen=True)
class Identity:
    api_keys: tuple[str, ...] = field(repr=False)
    certificate: str = field(repr=False)
    private_key: str = field(repr=False)
    ca_file: str
    # monitoring.password: what Prometheus and Alertmanager ask for (every lab with Prometheus).
    monitoring_password: str = field(default="", repr=False)
    tls_directory: str = ""  # the lab CA's (tlsca.Authority), which issues monitoring.tls too

    @property
    def ca_certificate(self) -> str:
        return Path(self.ca_file).read_text()

    def monitoring_tls(self, ip: str, stem: str = "monitoring") -> tuple[str, str]:
        """monitoring.tls's chain and key for the monitoring node at `ip`, from the lab CA, made
        once per `stem` (a rotation test asks for another)."""
        certificate, key = tlsca.issue(tlsca.Authority(Path(self.tls_directory)), ip, f"{stem}-{ip}")
        return certificate.read_text(), key.read_text()

    def client(self, key_index: int | None = 0) -> ClientAccess:
        """How the lab's clients reach the endpoint: key `key_index` (None: no key), the lab CA."""
        key = None if key_index is None else self.api_keys[key_index]
        return ClientAccess(api_key=key, ca_file=self.ca_file)


def ensure(directory: Path, load_balancer_ip: str) -> Identity:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    keys_file = directory / "api-keys"
    if not keys_file.exists():
        keys_file.touch(mode=0o600)
        keys_file.write_text("".join(f"{secrets.token_hex(32)}\n" for _ in range(KEY_COUNT)))
    password_file = directory / "monitoring-password"
    if not password_file.exists():
        password_file.touch(mode=0o600)
        password_file.write_text(f"{secrets.token_hex(24)}\n")
    authority = tlsca.ensure(directory / "tls", load_balancer_ip)
    return Identity(
        api_keys=tuple(keys_file.read_text().split()),
        certificate=authority.certificate.read_text(),
        private_key=authority.private_key.read_text(),
        ca_file=str(authority.ca_certificate),
        monitoring_password=password_file.read_text().strip(),
        tls_directory=str(authority.directory),
    )
