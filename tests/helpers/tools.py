"""The machine's tools a test runs for real (shellcheck, nginx, promtool, the exporters, ...): a
test whose tool is missing skips and names it, where it comes from; it never crashes on a
FileNotFoundError, and never passes without having run the tool. Debian packages come from
`make system` (scripts/setup-system.sh)."""

from __future__ import annotations

import shutil

import pytest

# /usr/sbin and /sbin: where Debian puts some of them (sshd, nft), off a user's PATH.
_SEARCH = "/usr/sbin:/sbin"


def missing(*tools: str) -> list[str]:
    """The tools of `tools` this machine does not have."""
    return [tool for tool in tools if shutil.which(tool) is None and shutil.which(tool, path=_SEARCH) is None]


def reason(tools: list[str]) -> str:
    return f"{', '.join(tools)} not installed (make system installs {'them' if len(tools) > 1 else 'it'})"


def require(*tools: str) -> None:
    """Skip the running test, naming what is missing, unless every tool is installed."""
    if absent := missing(*tools):
        pytest.skip(reason(absent))


def needs(*tools: str) -> pytest.MarkDecorator:
    """A mark: the test (or module, as `pytestmark`) skips, naming what is missing."""
    absent = missing(*tools)
    return pytest.mark.skipif(bool(absent), reason=reason(absent) if absent else "every tool is installed")
