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


# How `make test` shares this machine's two cores (pytest-xdist, `-n 2 --dist loadgroup`):
# - A module is never split between workers: a lab module's module-scoped fixture is a lab up
#   (30 s to minutes); split, each worker brought up its own.
# - SERIAL_GROUPS: modules that run together on one worker, one after another. Every module that
#   runs the real vLLM (minutes of CPU each, one cached environment), on loopback or in its lab,
#   is one group: in a clean-clone run the lab's image bump overlapped the loopback modules' real
#   servers loading, and a serving replica's /health went unanswered past the program's 5 s
#   probe (counted down: two replicas down in a bump that takes one out at a time).
# - Labs on the two workers may run at once: each has its own label, namespaces, engines and
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
# Seconds per module in a clean-clone run (`PYTEST_ADDOPTS=--durations=0 .ci/run`, summed per
# module, one lab up each); a module that becomes long belongs here.
LONG_MODULES = (
    "test_lab_real_vllm",  # 346 s
    "test_lab_upgrade",  # 238 s
    "test_lab_namespaces",  # 218 s
    "test_real_pd",  # 96-189 s alone, load average 17-50 (two real servers with NIXL, the router)
    "test_lab_aws",  # 135 s
    "test_lab_doctor",  # 92 s
    "test_real_vllm",  # 80 s; its group (with test_real_vllm_multinode) 133 s
    "test_lab_ssh",  # 66 s
    "test_lab_monitoring",  # 47 s
    "test_lab_lockout",  # 39 s
    "test_lab_openai",  # 38 s
    "test_real_router",  # 27-38 s alone (two real servers on loopback)
    "test_lab_endpoint",  # 28 s
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
