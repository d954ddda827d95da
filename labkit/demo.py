"""The main job (`make demo`, scripts/demo.py): every stack's offline preview (tooling/demo.py),
then the lab rehearsal of onprem where this machine allows it."""

from __future__ import annotations

import os
import sys

from rich.console import Console

from labkit import cli as lab_cli
from labkit.hosts import netns
from tooling import demo as offline_demo

LAB_STACK = "onprem"


def main() -> int:
    console = Console(width=None if sys.stdout.isatty() else 160)
    status, previewed = offline_demo.preview_stacks(console)
    console.rule(f"lab rehearsal of {LAB_STACK}")
    why_not = lab_unavailable()
    if why_not:
        console.print(
            f"[yellow]lab skipped:[/] {why_not}. On a Linux machine as root: make lab STACK={LAB_STACK}"
        )
        lab_status = None
    else:
        lab_status = lab_cli.main(["run", LAB_STACK])
    console.rule("demo")
    lab_word = "skipped" if lab_status is None else ("green" if lab_status == 0 else "FAILED")
    console.print(f"offline preview: {previewed}; lab rehearsal of {LAB_STACK}: {lab_word}")
    return status or (lab_status or 0)


def lab_unavailable() -> str | None:
    """Why the lab cannot run here, or None: it needs Linux, root and network namespaces."""
    if sys.platform != "linux":
        return f"the lab needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the lab needs root (it creates network namespaces)"
    missing = netns.missing_requirements()
    return "; ".join(missing) if missing else None
