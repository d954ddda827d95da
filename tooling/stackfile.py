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


def stack_path(stack: str, root: Path = PROJECT_ROOT) -> Path:
    return root / f"Pulumi.{stack}.yaml"


def read(stack: str, root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """The stack file's `config:` map, keys as written (`qwen-cluster:nodes`, `aws:region`)."""
    path = stack_path(stack, root)
    if not path.exists():
        known = ", ".join(sorted(p.name[7:-5] for p in root.glob("Pulumi.*.yaml")))
        raise FileNotFoundError(f"no stack file {path.name} (stacks here: {known})")
    document = yaml.safe_load(path.read_text()) or {}
    return dict(document.get("config") or {})


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


def load(stack: str, root: Path = PROJECT_ROOT) -> config.ClusterConfig:
    return validate(read(stack, root))


def as_pulumi_config(stack_config: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The stack config as the Pulumi engine hands it to a program: every value a string
    (objects as JSON), and the list of secret keys (`secure:` values)."""
    values: dict[str, str] = {}
    secrets: list[str] = []
    for key, value in stack_config.items():
        if isinstance(value, dict) and set(value) == {"secure"}:
            secrets.append(key)
            value = value["secure"]
        values[key] = value if isinstance(value, str) else json.dumps(value)
    return values, secrets


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
