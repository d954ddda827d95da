"""`--change KEY=VALUE`: a stack file's `config:` map with changes applied, as scripts/plan.py
and the lab's upgrade take them."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

from qwen_cluster.config import NAMESPACE


class ChangeSyntaxError(ValueError):
    pass


def parse_change(text: str) -> tuple[list[str], Any]:
    """`model.image=vllm/vllm-openai:v0.33.1` -> (["model", "image"], "vllm/..."). VALUE is JSON
    where it parses as JSON, else the plain string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ChangeSyntaxError(
            f"--change {text!r} is not KEY=VALUE (e.g. model.image=vllm/vllm-openai:v0.33.1)"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    path = key.split(".")
    if any(not part for part in path):
        raise ChangeSyntaxError(f"--change {text!r}: the key {key!r} has an empty part")
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
            raise ChangeSyntaxError(f"--change {text!r}: {path[0]} is not a section (it holds {target!r})")
        for part in path[1:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ChangeSyntaxError(f"--change {text!r}: {part} is not a section")
        target[path[-1]] = value
    return result
