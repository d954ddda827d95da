"""ConfigError, and pydantic's errors turned into messages that name the stack key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A stack config that cannot be deployed; `errors` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {error}" for error in self.errors)
        super().__init__(f"invalid stack config ({len(self.errors)} problems):\n{lines}")


def format_error(prefix: str, error: Mapping[str, Any]) -> str:
    """One pydantic error of the section `prefix` as `<key path> <value>: <why>`."""
    path = prefix
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after", "function-before", "int", "str"):
            continue
        else:
            path += f".{part}" if path else str(part)
    kind = error["type"]
    message = str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    if kind == "extra_forbidden":
        return f"{path} is not a known key"
    if kind == "missing":
        return f"{path} is required"
    if kind == "value_error":
        return f"{path} {message}"
    return f"{path} {value!r}: {message}"
