"""Prometheus's and Alertmanager's web config (`--web.config.file`, the exporter-toolkit format):
TLS (`tls_server_config`) and one basic-auth user whose bcrypt hash comes from the monitoring
password. Pure: text.

Both servers read the file again on every request (prometheus/exporter-toolkit web/handler.go,
`webHandler.ServeHTTP` calls `getConfig(tlsConfigPath)`), and a successful check is cached by
(user, hash, password), so bcrypt runs once per new hash, not per request. A new password is
therefore a new file and nothing else: no restart, no reload, and Alertmanager keeps its silences
and notification log, Prometheus its data. The certificate and key are read again on every new
connection (web/tls_config.go at v0.8.2, the release Prometheus 2.42 and Alertmanager 0.25 build
with: `Serve` sets `GetConfigForClient`, which re-reads this file, and `GetCertificate` calls
`tls.LoadX509KeyPair`), so a new certificate needs no restart either. Whether a server speaks TLS
at all is decided once, when it starts (`Serve` falls back to plain HTTP when the file has no
`tls_server_config`): turning TLS on must start the servers again (containers.WEB_CONFIG_FILE).

The hash must be the same for the same password on every `pulumi up`, or the file (and the step
that writes it) would change on every run. bcrypt salts at random, so the salt is derived here,
from what is public anyway: the stack's identity and the user. Never from the password: the salt
is printed in the hash, and a fast hash of the password there would let anyone who reads the file
guess passwords at SHA-256 speed instead of bcrypt's.
"""

from __future__ import annotations

import base64
import functools
import hashlib

import yaml

from qwen_cluster.render import nginx

# The one user the cluster's own clients (Prometheus's scrapes and alert pushes, doctor, the lab's
# checks) and operators log in as.
USER = "qwen-monitoring"
# exporter-toolkit's own example uses cost 10 (docs/web-configuration.md); a check costs ~50-80 ms
# of CPU, paid once per new hash (the cache above).
BCRYPT_COST = 10
_BCRYPT_ALPHABET = b"./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_STANDARD_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_SALT_DOMAIN = b"qwen-cluster monitoring web config salt v1\0"


def salt(context: str, *, cost: int = BCRYPT_COST) -> bytes:
    """A bcrypt salt (`$2b$<cost>$` and 22 characters of bcrypt's base64) derived from `context`
    (the stack and the user: public facts), the same on every run."""
    digest = hashlib.sha256(_SALT_DOMAIN + context.encode()).digest()[:16]
    encoded = base64.b64encode(digest).rstrip(b"=")  # 22 characters, canonical (zero tail bits)
    bcrypt_encoded = encoded.translate(bytes.maketrans(_STANDARD_ALPHABET, _BCRYPT_ALPHABET))
    return b"$2b$%02d$" % cost + bcrypt_encoded


@functools.lru_cache(maxsize=32)
def password_hash(password: str, context: str) -> str:
    """The bcrypt hash exporter-toolkit checks `password` against (golang.org/x/crypto/bcrypt
    reads `$2b$`), stable for one (password, context)."""
    import bcrypt

    return bcrypt.hashpw(password.encode(), salt(context)).decode()


def salt_context(stack: str, user: str = USER) -> str:
    return f"{stack}/{user}"


def cipher_suites() -> list[str]:
    """The endpoint's TLS 1.2 suites (nginx.TLS_CIPHERS, OpenSSL's names), in Go's names, which
    exporter-toolkit reads (`Cipher.UnmarshalYAML` looks them up in `tls.CipherSuites()`). TLS 1.3
    suites are not configurable in Go and are all AEAD with forward secrecy."""
    return [_GO_CIPHER_NAMES[name] for name in nginx.TLS_CIPHERS.split(":")]


# OpenSSL's names -> the IANA names Go's crypto/tls gives them (cipher_suites.go).
_GO_CIPHER_NAMES = {
    "ECDHE-ECDSA-AES128-GCM-SHA256": "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256": "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384": "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384": "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305": "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
    "ECDHE-RSA-CHACHA20-POLY1305": "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
}
# exporter-toolkit's name for TLS 1.2 (web/tls_config.go `TLSVersions`).
MIN_TLS_VERSION = "TLS12"


def web_config(password_hash_value: str | None, *, tls_file: str | None = None, user: str = USER) -> str:
    """The file both servers read with `--web.config.file`. `tls_file`: one PEM file holding the
    certificate chain and its key (cert_file and key_file both: `tls.LoadX509KeyPair` takes the
    CERTIFICATE blocks of one and the PRIVATE KEY block of the other), so that a new pair replaces
    the old in one rename and no handshake reads a new certificate with an old key. No client
    certificates: the servers' clients log in with the password."""
    config: dict = {}
    if tls_file is not None:
        config["tls_server_config"] = {
            "cert_file": tls_file,
            "key_file": tls_file,
            "min_version": MIN_TLS_VERSION,
            "cipher_suites": cipher_suites(),
        }
    if password_hash_value is not None:
        config["basic_auth_users"] = {user: password_hash_value}
    return yaml.safe_dump(config, sort_keys=False)
