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
# test` runs two workers with --dist loadgroup) they all run on one worker, one after another,
# while the rest of the suite (renders, policies, configs: CPU, no namespaces) runs on the other.
SERIAL_GROUP = "namespaces"
SERIAL_MODULES = (
    "test_lab_",
    "test_monitoring_netns",
    "test_real_vllm",
    "test_realvllm_setup",
    "test_render_firewall",
    "test_render_scripts",
    "test_render_sysctl",
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.stem.startswith(SERIAL_MODULES):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
