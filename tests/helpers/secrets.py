"""Secrets as the mocks record them: a wrapper object with the engine's secret signature."""

from __future__ import annotations

import json
from typing import Any

SECRET_SIG = "4dabf18193072939515e22adb298388d"


def in_clear(value: Any) -> Any:
    """The value with every secret wrapper replaced by "[secret]" (what a plan shows)."""
    if isinstance(value, dict):
        if SECRET_SIG in value:
            return "[secret]"
        return {key: in_clear(item) for key, item in value.items()}
    if isinstance(value, list):
        return [in_clear(item) for item in value]
    return value


def plain(value: Any) -> Any:
    """The value inside a secret wrapper (a render's input that carries a secret), else the value."""
    return value["value"] if isinstance(value, dict) and SECRET_SIG in value else value


def shown_in_clear(resources, text: str) -> list[str]:
    """Names of the resources whose inputs show `text` outside a secret."""
    return [r.name for r in resources if text in json.dumps(in_clear(r.inputs))]
