"""Shared fixtures: valid raw configs per target (tests/helpers/configs.py), one copy per test."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers.configs import BASE_AWS, BASE_BARE_METAL  # noqa: E402


@pytest.fixture
def aws_raw() -> dict:
    return copy.deepcopy(BASE_AWS)


@pytest.fixture
def bare_metal_raw() -> dict:
    return copy.deepcopy(BASE_BARE_METAL)


# Modules whose tests build network namespaces (the lab, or a pair of their own). Labs share this
# machine's lab users, /etc/sudoers.d and /run/qwen-cluster-lab, so under pytest-xdist (`make
# test` runs two workers with --dist loadgroup) they all run on one worker, one after another.
# The real vLLM on loopback (minutes of CPU, one cached environment) runs as a group of its own,
# beside the rest of the suite (renders, policies, configs) on the other worker.
SERIAL_GROUPS = {
    "namespaces": (
        "test_lab_",
        "test_monitoring_netns",
        "test_render_firewall",
        "test_render_scripts",
        "test_render_sysctl",
    ),
    "real-vllm": ("test_real_vllm", "test_realvllm_setup"),
}


def serial_group(stem: str) -> str | None:
    return next((group for group, prefixes in SERIAL_GROUPS.items() if stem.startswith(prefixes)), None)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        group = serial_group(item.path.stem)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
