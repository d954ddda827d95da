"""Where a secret would show in plain text: every registered input, outside Pulumi's secret
wrapper (which the state encrypts and the plan shows as [secret])."""

from __future__ import annotations

from typing import Any

from tooling.offline import Render

SECRET_SIG = "4dabf18193072939515e22adb298388d"


def _plain_strings(value: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        if SECRET_SIG in value:
            return []  # a secret: never shown
        found = []
        for key, item in value.items():
            found += _plain_strings(item, f"{path}.{key}")
        return found
    if isinstance(value, list):
        found = []
        for index, item in enumerate(value):
            found += _plain_strings(item, f"{path}[{index}]")
        return found
    return [(path, value)] if isinstance(value, str) else []


def in_plain_text(result: Render, secret: str) -> list[str]:
    """The inputs (`resource.key.path`) holding `secret` outside a secret wrapper."""
    return [
        path
        for resource in result.resources
        for path, text in _plain_strings(resource.inputs, resource.name)
        if secret in text
    ]
