"""Shared fixtures: valid raw configs per target (tests/helpers/configs.py), one copy per test."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# No time limit per example: Hypothesis's default 200 ms deadline is a timed test, and on this
# shared 2-core machine a pure function's example took 508 ms once under load (then 0.1 ms).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

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


# How `make test` shares this machine's two cores (pytest-xdist, `-n 3 --dist loadgroup`):
# - Three workers on two cores: the labs wait between bursts of CPU (health gates, drains, SSH), and
#   a third worker fills the waits. Clean-clone runs: -n 2, 1172 s with the real-vLLM image bump
#   (200 s of one worker, since moved to `make bench`); -n 3 without it, 902 s, the CPU (sampled
#   every 20 s) idle 0-4 % most of the run and 12-57 % in a few stretches, most near the end.
# - A module is never split between workers: a lab module's module-scoped fixture is a lab up
#   (30 s to minutes); split, each worker brought up its own.
# - SERIAL_GROUPS: modules that run together on one worker, one after another. Every module that
#   runs the real vLLM (minutes of CPU each, one cached environment), on loopback or in its lab,
#   is one group: in a clean-clone run the lab's image bump overlapped the loopback modules' real
#   servers loading, and a serving replica's /health went unanswered past the program's 5 s
#   probe (counted down: two replicas down in a bump that takes one out at a time).
# - Labs on different workers may run at once: each has its own label, namespaces, engines and
#   registry, and what they share (users, sudoers, /etc/netns) is joined and left under
#   lifecycle.shared_lock().
# - LONG_MODULES go first, longest first, so that the short ones fill in at the end.
# pytest-xdist 3.8's own loadgroup scheduler does not group under pytest 9.2 (it renames
# item._nodeid, which pytest 9.2 no longer reads:
# https://github.com/pytest-dev/pytest-xdist/issues/1386), so the suite brings its scheduler
# through xdist's pytest_xdist_make_scheduler hook.
SERIAL_GROUPS = {
    "real-vllm": (
        "test_lab_real_vllm",
        "test_real_vllm",
        "test_realvllm_setup",
        "test_real_router",
        "test_real_pd",
    ),
}
# Seconds per module in a clean-clone run with -n 3 (`PYTEST_ADDOPTS=--junitxml=j.xml .ci/run`, each
# test case's time summed per module, one lab up each); a module that becomes long belongs here.
LONG_MODULES = (
    "test_lab_real_vllm",  # 311 s; its group 637 s: the longest chain, so it starts first
    "test_lab_upgrade",  # 468 s
    "test_lab_namespaces",  # 327 s
    "test_lab_aws",  # 294 s
    "test_lab_doctor",  # 128 s
    "test_real_pd",  # 100 s (two real servers with NIXL, the router)
    "test_real_vllm",  # 76 s; with test_real_vllm_multinode 162 s
    "test_lab_ssh",  # 84 s
    "test_lab_monitoring",  # 67 s
    "test_real_router",  # 65 s (two real servers on loopback)
    "test_render_rollout",  # 52 s
    "test_policy_grpc",  # 48 s
    "test_lab_endpoint",  # 39 s
    "test_lab_openai",  # 32 s
    "test_lab_lockout",  # 31 s
)


def serial_group(stem: str) -> str | None:
    return next((group for group, prefixes in SERIAL_GROUPS.items() if stem.startswith(prefixes)), None)


def schedule_scope(nodeid: str) -> str:
    """The unit a worker runs whole: the module's group, or the module."""
    module = nodeid.split("::", 1)[0]
    return serial_group(Path(module).stem) or module


def pytest_collection_modifyitems(config, items) -> None:
    rank = {stem: place for place, stem in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's order kept


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleAndGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return schedule_scope(nodeid)

    config.option.loadscopereorder = False  # the collection's order (LONG_MODULES first)
    return ModuleAndGroupScheduling(config, log)
