"""The endpoint's secrets in the stack config: API keys (`access.apiKeys`), the TLS
certificate and key (`loadBalancer.tls`), the monitoring password (`monitoring.password`) and
the monitoring servers' certificate and key (`monitoring.tls`), each set with
`pulumi config set --secret --path`.

The validated ClusterConfig never holds a secret: a secret field validates the value it is given
(plain text from the engine, `{secure: ...}` ciphertext from a stack file read offline) and keeps
only REDACTED in its place, so the summary, the plan, the lab's reports and every renderer see
that a key exists, never what it is. The values themselves are read apart (`read_secrets`) into
`EndpointSecrets`, Pulumi Output secrets end to end.

How the engine hands them over: a config object with a `secure:` value anywhere inside it is a
secure object value (pulumi/pulumi sdk/go/common/resource/config/value.go,
NewSecureObjectValue), so its top-level key (`qwen-cluster:access`) is among the map's
SecureKeys (config/map.go), which reach the program as PULUMI_CONFIG_SECRET_KEYS
(sdk/python/lib/pulumi/runtime/config.py, `is_config_secret`); the object itself arrives
decrypted, as JSON text. So the whole `access` object is marked secret; only `apiKeys` in it is
one, and `read_secrets` wraps exactly that part in `Output.secret`. A key written in plain text
in the stack file leaves the object unmarked, and is refused (it would be committed).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator

REDACTED = "[secret]"
# RFC 6750 b64token characters, at least 32 of them (e.g. `openssl rand -hex 32`): nginx compares
# the whole `Authorization: Bearer <key>` header with each key as a case-sensitive regex, so the
# alphabet is kept to characters that need no quoting in an nginx string.
API_KEY_PATTERN = re.compile(r"^[A-Za-z0-9._~+/=-]{32,512}$")
API_KEY_RULE = "32 to 512 characters of A-Z a-z 0-9 . _ ~ + / = - (e.g. `openssl rand -hex 32`)"
_PEM_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----[\s\S]+-----END CERTIFICATE-----")
_PEM_PRIVATE_KEY = re.compile(
    r"-----BEGIN ([A-Z]+ )?PRIVATE KEY-----[\s\S]+-----END ([A-Z]+ )?PRIVATE KEY-----"
)


def _is_ciphertext(value: object) -> bool:
    """`{secure: v1:...}` as a stack file holds a secret; checked by the engine once decrypted."""
    return isinstance(value, Mapping) and set(value) == {"secure"} and isinstance(value["secure"], str)


def _secret(check, rule: str):
    def validate(value: object) -> str:
        # The value is never named in a message: it may be a real secret.
        if value == REDACTED or _is_ciphertext(value):
            return REDACTED
        if not isinstance(value, str) or not check(value):
            raise ValueError(f"is not valid ({rule}); the value is not shown")
        return REDACTED

    return validate


ApiKey = Annotated[str, BeforeValidator(_secret(API_KEY_PATTERN.match, API_KEY_RULE))]
# Prometheus trims a password file's whitespace (prometheus/common basicAuthRoundTripper), and the
# value travels in an HTTP Basic header: printable ASCII without spaces.
MONITORING_PASSWORD_PATTERN = re.compile(r"^[!-~]{16,512}$")
MONITORING_PASSWORD_RULE = "16 to 512 printable ASCII characters without spaces (e.g. `openssl rand -hex 24`)"
MonitoringPassword = Annotated[
    str, BeforeValidator(_secret(MONITORING_PASSWORD_PATTERN.match, MONITORING_PASSWORD_RULE))
]
_CHAIN_RULE = "a PEM certificate chain, server certificate first"
PemCertificate = Annotated[str, BeforeValidator(_secret(_PEM_CERTIFICATE.search, _CHAIN_RULE))]
PemPrivateKey = Annotated[str, BeforeValidator(_secret(_PEM_PRIVATE_KEY.search, "a PEM private key"))]
# A CA certificate is public: kept as text (the servers' clients verify with it), never a secret.
PEM_CERTIFICATE = _PEM_CERTIFICATE

# Where each secret lives in the raw config: (top-level key, path inside it).
API_KEYS_PATH = ("access", ("apiKeys",))
TLS_CERTIFICATE_PATH = ("loadBalancer", ("tls", "certificate"))
TLS_PRIVATE_KEY_PATH = ("loadBalancer", ("tls", "privateKey"))
MONITORING_PASSWORD_PATH = ("monitoring", ("password",))
MONITORING_TLS_CERTIFICATE_PATH = ("monitoring", ("tls", "certificate"))
MONITORING_TLS_PRIVATE_KEY_PATH = ("monitoring", ("tls", "privateKey"))
SECRET_PATHS = (
    API_KEYS_PATH,
    TLS_CERTIFICATE_PATH,
    TLS_PRIVATE_KEY_PATH,
    MONITORING_PASSWORD_PATH,
    MONITORING_TLS_CERTIFICATE_PATH,
    MONITORING_TLS_PRIVATE_KEY_PATH,
)


def _dig(raw: Mapping[str, Any], key: str, path: tuple[str, ...]) -> Any:
    value: Any = raw.get(key)
    for part in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def set_command(path: tuple[str, tuple[str, ...]], namespace: str = "qwen-cluster") -> str:
    key, inner = path
    suffix = "[0]" if inner == ("apiKeys",) else ""
    return f"pulumi config set --secret --path '{namespace}:{key}.{'.'.join(inner)}{suffix}'"


@dataclass(frozen=True)
class EndpointSecrets:
    """The endpoint's secrets as Pulumi Output secrets (None: not configured)."""

    api_keys: Any = None  # Output[list[str]]
    tls_certificate: Any = None  # Output[str]
    tls_private_key: Any = None  # Output[str]
    monitoring_password: Any = None  # Output[str]: Prometheus's and Alertmanager's login
    monitoring_tls_certificate: Any = None  # Output[str]: their certificate chain (monitoring.tls)
    monitoring_tls_private_key: Any = None  # Output[str]: its key


def plain_text_secrets(raw: Mapping[str, Any], marked_secret) -> list[str]:
    """Secret fields whose top-level key the engine did not mark secret: written in plain text in
    the stack file, so committed. `marked_secret(key)` answers for a top-level key."""
    errors = []
    for path in SECRET_PATHS:
        key, inner = path
        value = _dig(raw, key, inner)
        if value in (None, [], "") or marked_secret(key):
            continue
        errors.append(
            f"{key}.{'.'.join(inner)} is in plain text in the stack file: set it with "
            f"`{set_command(path)} ...` (the value is not shown)"
        )
    return errors


def read_secrets(raw: Mapping[str, Any]) -> EndpointSecrets:
    """The secret values of a raw config whose secrets are plain text (from the engine), each
    wrapped in Output.secret before anything else sees it."""
    import pulumi

    def wrap(value: Any) -> Any:
        return None if value in (None, [], "") else pulumi.Output.secret(value)

    keys = _dig(raw, *API_KEYS_PATH)
    return EndpointSecrets(
        api_keys=wrap(list(keys) if isinstance(keys, list) else keys),
        tls_certificate=wrap(_dig(raw, *TLS_CERTIFICATE_PATH)),
        tls_private_key=wrap(_dig(raw, *TLS_PRIVATE_KEY_PATH)),
        monitoring_password=wrap(_dig(raw, *MONITORING_PASSWORD_PATH)),
        monitoring_tls_certificate=wrap(_dig(raw, *MONITORING_TLS_CERTIFICATE_PATH)),
        monitoring_tls_private_key=wrap(_dig(raw, *MONITORING_TLS_PRIVATE_KEY_PATH)),
    )


def with_values(raw: Mapping[str, Any], path: tuple[str, tuple[str, ...]], value: Any) -> dict[str, Any]:
    """`raw` with the secret at `path` set to `value` (the offline tools and the lab)."""
    key, inner = path
    result = dict(raw)
    section = dict(result.get(key) or {})
    result[key] = section
    for part in inner[:-1]:
        section[part] = dict(section.get(part) or {})
        section = section[part]
    section[inner[-1]] = value
    return result
