"""The sysctl drop-in from `tuning.sysctl` (one file, never appended to /etc/sysctl.conf)."""

from __future__ import annotations

from collections.abc import Mapping

DROPIN_PATH = "/etc/sysctl.d/90-qwen-cluster.conf"


def dropin(values: Mapping[str, int | str]) -> str:
    """The drop-in's text: sorted, so the same config always yields the same bytes."""
    lines = ["# Managed by qwen-cluster (tuning.sysctl). Changes here are overwritten."]
    lines += [f"{key} = {values[key]}" for key in sorted(values)]
    return "\n".join(lines) + "\n"
