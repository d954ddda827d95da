"""Helpers for the bare-metal tests: shellcheck, and network namespaces the test owns."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import tools
from tooling import stackfile

ONPREM = stackfile.load("onprem")


def cache_aware_stack(stack: str = "onprem") -> dict:
    """A stack file's `config:` map with loadBalancer.routing cache-aware."""
    stack_config = stackfile.read(stack)
    key = "qwen-cluster:loadBalancer"
    return {**stack_config, key: {**(stack_config.get(key) or {}), "routing": "cache-aware"}}


ONPREM_CACHE_AWARE = stackfile.validate(cache_aware_stack())


def shellcheck(text: str, tmp_path: Path) -> None:
    """shellcheck the script; the test skips, naming shellcheck, where it is not installed."""
    tools.require("shellcheck")
    path = tmp_path / f"script-{uuid.uuid4().hex[:8]}.sh"
    path.write_text(text)
    result = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


needs_netns = pytest.mark.skipif(
    not can_make_namespaces(), reason="creating network namespaces needs root and iproute2"
)


@contextlib.contextmanager
def netns_pair(a_ip: str = "10.231.0.1", b_ip: str = "10.231.0.2") -> Iterator[tuple[str, str]]:
    """Two fresh namespaces joined by a veth pair; removed afterwards. Nothing leaves them."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"qt-a-{tag}", f"qt-b-{tag}"
    steps = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}", "netns", b],
        ["ip", "-n", a, "addr", "add", f"{a_ip}/24", "dev", f"va{tag}"],
        ["ip", "-n", b, "addr", "add", f"{b_ip}/24", "dev", f"vb{tag}"],
        ["ip", "-n", a, "link", "set", f"va{tag}", "up"],
        ["ip", "-n", b, "link", "set", f"vb{tag}", "up"],
        ["ip", "-n", a, "link", "set", "lo", "up"],
        ["ip", "-n", b, "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_in(ns: str, text: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"run-{uuid.uuid4().hex[:8]}.sh"
    path.write_text(text)
    return subprocess.run(
        ["ip", "netns", "exec", ns, "bash", str(path), *args], capture_output=True, text=True, timeout=120
    )


def disaggregated_stack(stack: str = "onprem") -> dict:
    """A stack file's `config:` map with serving.mode disaggregated (master and worker-1 prefill,
    worker-2 and worker-3 decode) on the NICs the link floor asks of Qwen3-32B on H100s (8 x 400
    Gbit/s RoCE: bareMetal.nicSpeedGbps 3200)."""
    stack_config = stackfile.read(stack)
    bare_metal = {**stack_config["qwen-cluster:bareMetal"], "nicSpeedGbps": 3200, "gpuModel": "H100"}
    return {
        **stack_config,
        "qwen-cluster:bareMetal": bare_metal,
        "qwen-cluster:serving": {
            "mode": "disaggregated",
            "prefill": {"nodes": ["master", "worker-1"]},
            "decode": {"nodes": ["worker-2", "worker-3"]},
        },
    }


ONPREM_DISAGGREGATED = stackfile.validate(disaggregated_stack())
