"""`--change KEY=VALUE`: a stack file's `config:` map with changes applied, as scripts/plan.py
and the lab's upgrade take them."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

from qwen_cluster.config import NAMESPACE, SECRET_KEYS
from qwen_cluster.config.secrets import SECRET_PATHS


class ChangeSyntaxError(ValueError):
    pass


# The dotted keys of the stack's secrets, as a change names them (`loadBalancer.tls.privateKey`).
SECRET_CHANGE_KEYS: tuple[tuple[str, ...], ...] = (
    *((section, *path) for section, path in SECRET_PATHS),
    *((key,) for key in SECRET_KEYS),
)


def shown(text: str) -> str:
    """`text` as it may be printed or stored in a report: a change whose key is a secret, holds one
    (`loadBalancer.tls`) or lies inside one has its value replaced by `<secret>`."""
    key, sep, _ = text.partition("=")
    parts = tuple(key.strip().split("."))
    touches = any(
        secret[: len(parts)] == parts or parts[: len(secret)] == secret for secret in SECRET_CHANGE_KEYS
    )
    return f"{key}{sep}<secret>" if sep and touches else text


def parse_change(text: str) -> tuple[list[str], Any]:
    """`model.image=vllm/vllm-openai:v0.33.1` -> (["model", "image"], "vllm/..."). VALUE is JSON
    where it parses as JSON, else the plain string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ChangeSyntaxError(
            f"--change {shown(text)!r} is not KEY=VALUE (e.g. model.image=vllm/vllm-openai:v0.33.1)"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    path = key.split(".")
    if any(not part for part in path):
        raise ChangeSyntaxError(f"--change {shown(text)!r}: the key {key!r} has an empty part")
    return path, value


def apply_changes(stack_config: Mapping[str, Any], changes: Iterable[str]) -> dict[str, Any]:
    """A copy of a stack file's `config:` map with each `KEY=VALUE` applied. KEY is the dotted
    path as in the stack file without the project namespace (`model.image`, `aws.amiId`,
    `access.clientCidrs`, `nodes`); a first part holding a colon is a full key (`aws:region`)."""
    result = copy.deepcopy(dict(stack_config))
    for text in changes:
        path, value = parse_change(text)
        head = path[0] if ":" in path[0] else f"{NAMESPACE}:{path[0]}"
        if len(path) == 1:
            result[head] = value
            continue
        target = result.setdefault(head, {})
        if not isinstance(target, dict):
            raise ChangeSyntaxError(f"--change {shown(text)!r}: {path[0]} is not a section")
        for part in path[1:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ChangeSyntaxError(f"--change {shown(text)!r}: {part} is not a section")
        target[path[-1]] = value
    return result
