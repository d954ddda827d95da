"""Prometheus's and Alertmanager's web config (`--web.config.file`, the exporter-toolkit format):
one basic-auth user whose bcrypt hash comes from the monitoring password. Pure: text.

Both servers read the file again on every request (prometheus/exporter-toolkit web/handler.go,
`webHandler.ServeHTTP` calls `getConfig(tlsConfigPath)`), and a successful check is cached by
(user, hash, password), so bcrypt runs once per new hash, not per request. A new password is
therefore a new file and nothing else: no restart, no reload, and Alertmanager keeps its silences
and notification log, Prometheus its data.

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


def web_config(password_hash_value: str, *, user: str = USER) -> str:
    """The file both servers read with `--web.config.file`."""
    return yaml.safe_dump({"basic_auth_users": {user: password_hash_value}}, sort_keys=False)
