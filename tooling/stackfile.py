"""Stack files (`Pulumi.<stack>.yaml`) read without the Pulumi CLI, for the offline tools and tests."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from qwen_cluster import config

PROJECT_ROOT = Path(__file__).resolve().parent.parent
STACKS = ("dev", "prod", "onprem")
# The committed stacks hold no API key and no monitoring password (a real one is set with
# `pulumi config set --secret`, and a stack without one is refused). Offline, where nothing is
# served, they get these throwaway ones.
OFFLINE_API_KEY = "offline-throwaway-key-never-served-anywhere-0000"
OFFLINE_MONITORING_PASSWORD = "offline-throwaway-monitoring-password-0000"
# The TLS pair offline renders stand in for a stack's: a real self-signed EC P-256 certificate
# (CN and subjectAltName `offline.invalid`, a name RFC 2606 reserves, valid until 9999-12-31, the
# "no well-defined expiration" date of RFC 5280 section 4.1.2.5) and its key, so that the program's
# parse of the pair (qwen_cluster/config/x509check.py) passes as a good stack's would. Published
# here, so never served anywhere.
OFFLINE_TLS_CERTIFICATE = """-----BEGIN CERTIFICATE-----
MIIBcjCCARmgAwIBAgIBATAKBggqhkjOPQQDAjArMSkwJwYDVQQDDCBxd2VuLWNs
dXN0ZXIgb2ZmbGluZSBwbGFjZWhvbGRlcjAgFw0yNjAxMDEwMDAwMDBaGA85OTk5
MTIzMTIzNTk1OVowKzEpMCcGA1UEAwwgcXdlbi1jbHVzdGVyIG9mZmxpbmUgcGxh
Y2Vob2xkZXIwWTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAAQrptkKU2IPav4EQRU8
Y1b9m4Bshy0exseuJzFCk6MaYxHZZp0CVTprTA6/LA2gqkgRsIMocZUvdPfaVpZF
Jr+QoywwKjAaBgNVHREEEzARgg9vZmZsaW5lLmludmFsaWQwDAYDVR0TAQH/BAIw
ADAKBggqhkjOPQQDAgNHADBEAiAQ/ne8NWajt3jfwvRsk2Eo8/Et63YsjQ3hS0uf
RlYwKgIgWevCHDavQ7qOW6FYqngdVs15bM0qZb+I+eoe/Wp4VlA=
-----END CERTIFICATE-----
"""
OFFLINE_TLS_PRIVATE_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgV3drH5ZJ2O2b/OR5
YWVYDWrH00v5I6v6YjJKU4GHBN+hRANCAAQrptkKU2IPav4EQRU8Y1b9m4Bshy0e
xseuJzFCk6MaYxHZZp0CVTprTA6/LA2gqkgRsIMocZUvdPfaVpZFJr+Q
-----END PRIVATE KEY-----
"""
# monitoring.tls offline: the same pair; its certificate, self-signed, is its own CA. It names
# only `offline.invalid`, which the monitoring name check passes over (config/rules.py).
OFFLINE_MONITORING_TLS = {
    "certificate": {"secure": OFFLINE_TLS_CERTIFICATE},
    "privateKey": {"secure": OFFLINE_TLS_PRIVATE_KEY},
    "caCertificate": OFFLINE_TLS_CERTIFICATE,
}
# What the program gets offline for a nested `secure:` value (nothing here can decrypt a real
# stack's ciphertext): a placeholder of the right shape, by where the value sits.
OFFLINE_SECRETS: dict[tuple[str, ...], str] = {
    (f"{config.NAMESPACE}:access", "apiKeys"): OFFLINE_API_KEY,
    (f"{config.NAMESPACE}:loadBalancer", "tls", "certificate"): OFFLINE_TLS_CERTIFICATE,
    (f"{config.NAMESPACE}:loadBalancer", "tls", "privateKey"): OFFLINE_TLS_PRIVATE_KEY,
    (f"{config.NAMESPACE}:monitoring", "password"): OFFLINE_MONITORING_PASSWORD,
    (f"{config.NAMESPACE}:monitoring", "tls", "certificate"): OFFLINE_TLS_CERTIFICATE,
    (f"{config.NAMESPACE}:monitoring", "tls", "privateKey"): OFFLINE_TLS_PRIVATE_KEY,
}


def stack_path(stack: str, root: Path = PROJECT_ROOT) -> Path:
    return root / f"Pulumi.{stack}.yaml"


def read(stack: str, root: Path = PROJECT_ROOT, *, offline_keys: bool = True) -> dict[str, Any]:
    """The stack file's `config:` map, keys as written (`qwen-cluster:nodes`, `aws:region`);
    with `offline_keys`, a stack without API keys (and not explicitly open) gets the throwaway
    OFFLINE_API_KEY, and one that runs Prometheus without a password (and not explicitly open)
    OFFLINE_MONITORING_PASSWORD, each as a secret, so that it renders offline (with_offline_keys;
    offline_placeholders says which it got)."""
    path = stack_path(stack, root)
    if not path.exists():
        known = ", ".join(sorted(p.name[7:-5] for p in root.glob("Pulumi.*.yaml")))
        raise FileNotFoundError(f"no stack file {path.name} (stacks here: {known})")
    document = yaml.safe_load(path.read_text()) or {}
    stack_config = dict(document.get("config") or {})
    return with_offline_keys(stack_config) if offline_keys else stack_config


def with_offline_keys(stack_config: dict[str, Any]) -> dict[str, Any]:
    """The stack config with OFFLINE_API_KEY when it has no `access.apiKeys` and does not say
    `access.openEndpoint`, and with OFFLINE_MONITORING_PASSWORD when it runs Prometheus without
    `monitoring.password` and does not say `monitoring.openToMonitoringCidrs` (and the offline TLS
    pair as its `monitoring.tls` when it has none), each written as a stack file holds a secret
    (`{secure: ...}`)."""
    result = dict(stack_config)
    key = f"{config.NAMESPACE}:access"
    access = stack_config.get(key)
    if isinstance(access, dict) and not access.get("apiKeys") and not access.get("openEndpoint"):
        result[key] = {**access, "apiKeys": [{"secure": OFFLINE_API_KEY}]}
    key = f"{config.NAMESPACE}:monitoring"
    monitoring = stack_config.get(key)
    monitoring = monitoring if isinstance(monitoring, dict) else {} if monitoring is None else None
    if (
        monitoring is not None
        and monitoring.get("prometheus", True)
        and not monitoring.get("password")
        and not monitoring.get("openToMonitoringCidrs")
    ):
        result[key] = {
            **monitoring,
            "password": {"secure": OFFLINE_MONITORING_PASSWORD},
            # A password is never sent in clear (config/rules.py): the offline pair with it, its
            # self-signed certificate standing for the CA too.
            **({} if monitoring.get("tls") else {"tls": OFFLINE_MONITORING_TLS}),
        }
    return result


def offline_placeholders(stack_config: dict[str, Any]) -> list[str]:
    """The secrets of `stack_config` that are the offline tools' throwaway placeholders (set by
    with_offline_keys, or what a stack file's ciphertext becomes offline), by key."""
    values, _ = as_pulumi_config(stack_config)
    ns = config.NAMESPACE
    found = []
    for (key, *inner), placeholder in OFFLINE_SECRETS.items():
        text = values.get(key)
        if text and json.dumps(placeholder)[1:-1] in text:
            found.append(f"{key.removeprefix(ns + ':')}.{'.'.join(inner)}")
    return found


def cluster_keys(stack_config: dict[str, Any]) -> dict[str, Any]:
    """The `qwen-cluster:` keys without their namespace; secrets left out."""
    prefix = f"{config.NAMESPACE}:"
    return {
        key[len(prefix) :]: value
        for key, value in stack_config.items()
        if key.startswith(prefix) and key[len(prefix) :] not in config.SECRET_KEYS
    }


def validate(stack_config: dict[str, Any]) -> config.ClusterConfig:
    """A stack file's `config:` map validated as the program validates it (config.from_pulumi):
    with the provider's `aws:region`, which the AWS target's zone must lie in."""
    return config.validate(cluster_keys(stack_config), aws_region=stack_config.get("aws:region"))


def validate_as_handed(stack_config: dict[str, Any]) -> config.ClusterConfig:
    """`validate` of the values as the engine hands them to the program and the pack: every
    `secure:` value decrypted (offline, a real stack's ciphertext becomes its OFFLINE_SECRETS
    placeholder, as in as_pulumi_config). So a TLS pair given in plain text is parsed here as the
    program parses it, and what it warrants saying (an expiry close at hand) reaches the pack,
    which `validate` alone, reading the wrapped values as unjudged ciphertext, would drop."""
    return validate({key: _decrypted(value, (key,))[0] for key, value in stack_config.items()})


def load(stack: str, root: Path = PROJECT_ROOT) -> config.ClusterConfig:
    return validate(read(stack, root))


def as_pulumi_config(stack_config: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The stack config as the Pulumi engine hands it to a program: every value a string (objects as
    JSON), secure values decrypted, and the list of secret keys: a key whose value, or any value
    inside it, is `secure:` (pulumi/pulumi sdk/go/common/resource/config/value.go: an object
    holding a secure value is a secure object value, and map.go SecureKeys lists its key).
    Offline nothing can decrypt a real stack's ciphertext, so a nested one becomes its
    OFFLINE_SECRETS placeholder."""
    values: dict[str, str] = {}
    secret_keys: list[str] = []
    for key, value in stack_config.items():
        plain, secure = _decrypted(value, (key,))
        if secure:
            secret_keys.append(key)
        values[key] = plain if isinstance(plain, str) else json.dumps(plain)
    return values, secret_keys


def _decrypted(value: Any, path: tuple[str, ...]) -> tuple[Any, bool]:
    """`value` with every `{secure: x}` inside replaced, and whether there was one."""
    if isinstance(value, dict) and set(value) == {"secure"}:
        text = value["secure"]
        placeholder = OFFLINE_SECRETS.get(path)
        # Pulumi's ciphertext starts `v1:`; anything else was handed over in plain text (the
        # offline key, the lab's own secrets).
        return (placeholder if placeholder and text.startswith("v1:") else text), True
    if isinstance(value, dict):
        pairs = {key: _decrypted(item, (*path, key)) for key, item in value.items()}
        return {key: plain for key, (plain, _) in pairs.items()}, any(s for _, s in pairs.values())
    if isinstance(value, list):
        items = [_decrypted(item, path) for item in value]
        return [plain for plain, _ in items], any(secure for _, secure in items)
    return value, False


def placeholder_host_key(name: str) -> str:
    """A well-formed `ssh-ed25519` public key that no host holds (derived from `name`), for
    offline renders of stacks whose nodes do not exist: a real host's key never matches it."""
    kind = b"ssh-ed25519"
    blob = (
        len(kind).to_bytes(4, "big") + kind + (32).to_bytes(4, "big") + hashlib.sha256(name.encode()).digest()
    )
    return f"ssh-ed25519 {base64.b64encode(blob).decode()}"


def with_nodes(stack_config: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The stack config with `nodes`; on bare metal `bareMetal.hostKeys` follows them: kept for a
    node that stays, a placeholder for a new one (see placeholder_host_key), gone with one that
    leaves."""
    result = {**stack_config, f"{config.NAMESPACE}:nodes": nodes}
    bare_metal = stack_config.get(f"{config.NAMESPACE}:bareMetal")
    if isinstance(bare_metal, dict):
        pinned = bare_metal.get("hostKeys") or {}
        keys = {
            node["name"]: pinned.get(node["name"]) or placeholder_host_key(node["name"]) for node in nodes
        }
        result[f"{config.NAMESPACE}:bareMetal"] = {**bare_metal, "hostKeys": keys}
    return result


# --- the secrets a deploy needs, as CI gets them (docs/ci.md) -----------------------------------


def _secure(value: Any) -> bool:
    """A value the stack's secrets provider encrypted (`pulumi config set --secret`)."""
    return isinstance(value, dict) and set(value) == {"secure"} and str(value["secure"]).startswith("v1:")


def missing_secrets(stack: str, root: Path = PROJECT_ROOT) -> list[str]:
    """What `pulumi up` of `stack` needs from the stack file's encrypted values and does not find
    there, each with the command that sets it: the API keys (unless access.openEndpoint), the
    monitoring password (with Prometheus, unless monitoring.openToMonitoringCidrs), the TLS pair
    when one half is set, Ray's token with pipelineParallel > 1. A stack that imports a
    Pulumi ESC environment (`environment:`) gets its values from there: nothing is listed."""
    path = stack_path(stack, root)
    document = yaml.safe_load(path.read_text()) or {}
    if document.get("environment"):
        return []
    stack_config = dict(document.get("config") or {})
    ns = config.NAMESPACE
    access = stack_config.get(f"{ns}:access") or {}
    missing: list[str] = []
    keys = access.get("apiKeys") or []
    if not access.get("openEndpoint") and (not keys or not all(_secure(key) for key in keys)):
        missing.append(
            f"{ns}:access.apiKeys: pulumi config set --stack {stack} --secret --path "
            f"'{ns}:access.apiKeys[0]' \"$(openssl rand -hex 32)\""
        )
    tls = (stack_config.get(f"{ns}:loadBalancer") or {}).get("tls") or {}
    for half, source in (("certificate", "chain.pem"), ("privateKey", "key.pem")):
        if tls and not _secure(tls.get(half)):
            missing.append(
                f"{ns}:loadBalancer.tls.{half}: pulumi config set --stack {stack} --secret --path "
                f"'{ns}:loadBalancer.tls.{half}' < {source}"
            )
    monitoring = stack_config.get(f"{ns}:monitoring") or {}
    open_monitoring = monitoring.get("openToMonitoringCidrs")
    if monitoring.get("prometheus", True) and not open_monitoring and not _secure(monitoring.get("password")):
        missing.append(
            f"{ns}:monitoring.password: pulumi config set --stack {stack} --secret --path "
            f"'{ns}:monitoring.password' \"$(openssl rand -hex 24)\""
        )
    monitoring_tls = monitoring.get("tls") or {}
    if monitoring.get("prometheus", True) and not open_monitoring:
        for half, source in (("certificate", "chain.pem"), ("privateKey", "key.pem")):
            if not _secure(monitoring_tls.get(half)):
                missing.append(
                    f"{ns}:monitoring.tls.{half}: pulumi config set --stack {stack} --secret --path "
                    f"'{ns}:monitoring.tls.{half}' < {source}"
                )
        if not monitoring_tls.get("caCertificate"):
            missing.append(
                f"{ns}:monitoring.tls.caCertificate: pulumi config set --stack {stack} --path "
                f"'{ns}:monitoring.tls.caCertificate' < ca.pem"
            )
    model = stack_config.get(f"{ns}:model") or {}
    runs_ray = int(model.get("pipelineParallel") or 1) > 1 and model.get("distributedBackend") == "ray"
    if runs_ray and not _secure(stack_config.get(f"{ns}:rayAuthToken")):
        missing.append(
            f"{ns}:rayAuthToken: pulumi config set --stack {stack} --secret rayAuthToken "
            "$(openssl rand -hex 32)"
        )
    return missing


def main(argv: list[str] | None = None) -> int:
    """`python -m tooling.stackfile --check-secrets STACK`: exit 1, saying how to set each, when
    the stack file lacks an encrypted secret that `pulumi up` needs (CI's up.yml runs it first)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--check-secrets", metavar="STACK", required=True)
    args = parser.parse_args(argv)
    missing = missing_secrets(args.check_secrets)
    for line in missing:
        print(f"missing secret {line}")
    if missing:
        print(
            f"Pulumi.{args.check_secrets}.yaml lacks the encrypted values above: set them with the stack's "
            "secrets provider and commit the file (docs/ci.md#where-ci-gets-the-stacks-secrets)"
        )
        return 1
    print(f"Pulumi.{args.check_secrets}.yaml holds every secret `pulumi up` needs, encrypted")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
