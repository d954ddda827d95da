"""The offline render's SDK speed-up (tooling/sdk_speedup.py) answers exactly as the SDK's own
search, replaces it only on the SDK release it was written for and only for an offline render,
and the deployed program uses none of it."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pulumi.runtime import resource_cycle_breaker

from tooling import offline, sdk_speedup

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements.txt"


def _pristine_sdk_module():
    """A fresh copy of the SDK's module, as shipped: the one in sys.modules is patched as soon
    as any test has run the program."""
    spec = importlib.util.spec_from_file_location("pristine_cycle_breaker", resource_cycle_breaker.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SDK = _pristine_sdk_module()


@pytest.fixture
def sdk_search(monkeypatch):
    """The SDK's own search and records in place (put back as they were afterwards), no
    warning given yet."""
    monkeypatch.setattr(resource_cycle_breaker, "_reachable", SDK._reachable)
    monkeypatch.setattr(resource_cycle_breaker, "_add_dep", SDK._add_dep)
    monkeypatch.setattr(sdk_speedup, "_warned", False)


class Node:
    """Stands in for a Resource: the cycle breaker only reads `_direct_computed_dependencies`."""

    def __init__(self, index: int):
        self.index = index


def graph(edges: list[tuple[int, int]], size: int, add=sdk_speedup.add_dependency) -> list[Node]:
    sdk_speedup.reset_order()
    nodes = [Node(index) for index in range(size)]
    for source, target in edges:
        add(nodes[source], nodes[target])
    return nodes


EDGES = st.integers(min_value=1, max_value=12).flatmap(
    lambda size: st.tuples(
        st.just(size),
        st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)), max_size=40),
    )
)


@settings(max_examples=200, deadline=None)
@given(EDGES)
def test_reachable_answers_as_the_sdk_on_any_graph_cycles_included(case):
    size, edges = case
    nodes = graph(edges, size)
    for source in nodes:
        for target in nodes:
            assert sdk_speedup.reachable(source, target) == SDK._reachable(source, target)


@settings(max_examples=200, deadline=None)
@given(EDGES)
def test_dependencies_are_recorded_as_the_sdk_records_them(case):
    size, edges = case
    ours, theirs = graph(edges, size), graph(edges, size, add=SDK._add_dep)
    for mine, sdks in zip(ours, theirs, strict=True):
        assert {n.index for n in SDK._deps(mine)} == {n.index for n in SDK._deps(sdks)}


@settings(max_examples=100, deadline=None)
@given(EDGES)
def test_edges_declared_one_by_one_are_refused_exactly_where_the_sdk_refuses_them(case):
    """declare_dependency as the program calls it, edge after edge, with the SDK's functions
    and with ours: the same edges are kept and the same ones refused as cycles."""
    size, edges = case

    def declared(add, search) -> tuple[list[bool], list[list[bool]]]:
        nodes = [Node(index) for index in range(size)]
        kept = []
        for source, target in edges:
            kept.append(not search(nodes[target], nodes[source]))
            if kept[-1]:
                add(nodes[source], nodes[target])
        return kept, [[search(a, b) for b in nodes] for a in nodes]

    sdk_speedup.reset_order()
    ours = declared(sdk_speedup.add_dependency, sdk_speedup.reachable)
    assert ours == declared(SDK._add_dep, SDK._reachable)


@settings(max_examples=100, deadline=None)
@given(EDGES)
def test_the_order_kept_puts_every_resource_after_what_it_depends_on(case):
    size, edges = case
    sdk_speedup.reset_order()
    nodes = [Node(index) for index in range(size)]
    for source, target in edges:
        if not sdk_speedup.reachable(nodes[target], nodes[source]):
            sdk_speedup.add_dependency(nodes[source], nodes[target])
    place = {node: getattr(node, "_qwen_cluster_order", None) for node in nodes}
    for node in nodes:
        for dependency in SDK._deps(node):
            assert place[dependency] < place[node]


def test_a_new_resource_behind_a_long_chain_is_checked_without_a_walk():
    """It is placed after the chain, so the chain cannot reach it: answered from the places,
    without reading a dependency."""
    chain = graph([(index + 1, index) for index in range(5000)], 5001)
    new = Node(-1)
    sdk_speedup.add_dependency(new, chain[-1])  # its first dependency; is a second one a cycle?
    read: list[Node] = []
    deps = resource_cycle_breaker._deps

    def counting(resource):
        read.append(resource)
        return deps(resource)

    original = resource_cycle_breaker._deps
    resource_cycle_breaker._deps = counting
    try:
        assert not sdk_speedup.reachable(chain[2500], new)
    finally:
        resource_cycle_breaker._deps = original
    assert read == []


def test_a_long_chain_is_searched_without_recursion():
    chain = graph([(index + 1, index) for index in range(5000)], 5001)
    assert sdk_speedup.reachable(chain[-1], chain[0])
    assert not sdk_speedup.reachable(chain[0], chain[-1])
    # The SDK's nested generators run out of stack on it: a rollout chain of a few thousand
    # resources would stop the program. When this no longer raises, drop the workaround.
    with pytest.raises(RecursionError):
        SDK._reachable(chain[-1], chain[0])


def test_it_was_written_for_the_sdk_release_requirements_pin():
    pinned = re.search(r"^pulumi==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE)
    assert pinned and pinned.group(1) == sdk_speedup.WRITTEN_FOR


def test_on_the_release_it_was_written_for_it_replaces_the_sdks_search(sdk_search):
    assert sdk_speedup.installed_sdk_version() == sdk_speedup.WRITTEN_FOR
    with warnings.catch_warnings():
        warnings.simplefilter("error", sdk_speedup.SdkVersionWarning)
        assert sdk_speedup.apply() is True
    assert resource_cycle_breaker._reachable is sdk_speedup.reachable
    assert resource_cycle_breaker._add_dep is sdk_speedup.add_dependency


def test_on_another_release_it_warns_once_and_leaves_the_sdk_alone(sdk_search, monkeypatch):
    monkeypatch.setattr(sdk_speedup, "installed_sdk_version", lambda: "3.999.0")
    message = r"written for pulumi 3\.272\.0 and found pulumi 3\.999\.0"
    with pytest.warns(sdk_speedup.SdkVersionWarning, match=message):
        assert sdk_speedup.apply() is False
    assert resource_cycle_breaker._reachable is SDK._reachable
    assert resource_cycle_breaker._add_dep is SDK._add_dep
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert sdk_speedup.apply() is False
    assert not [w for w in again if issubclass(w.category, sdk_speedup.SdkVersionWarning)]
    assert resource_cycle_breaker._reachable is SDK._reachable


def test_an_offline_render_applies_it_and_puts_the_sdk_back(sdk_search):
    seen = []
    original = offline.runpy.run_path

    def run(*args, **kwargs):
        seen.append(resource_cycle_breaker._reachable)
        return original(*args, **kwargs)

    offline.runpy.run_path = run
    try:
        render = offline.render_stack("dev")
    finally:
        offline.runpy.run_path = original
    assert render.error is None
    assert seen == [sdk_speedup.reachable]
    assert resource_cycle_breaker._reachable is SDK._reachable
    assert resource_cycle_breaker._add_dep is SDK._add_dep


def test_the_render_without_it_registers_the_same(sdk_search):
    quick, plain = offline.render_stack("onprem"), offline.render_stack("onprem", speedup=False)
    assert quick.error is None and plain.error is None
    registered = [sorted((r.type, r.name, repr(r.inputs)) for r in run.resources) for run in (quick, plain)]
    assert registered[0] == registered[1]  # the same, in the order the threads answered
    assert quick.dependencies() == plain.dependencies()


def test_on_another_release_the_render_runs_with_the_sdks_search(sdk_search, monkeypatch):
    monkeypatch.setattr(sdk_speedup, "installed_sdk_version", lambda: "3.999.0")
    with pytest.warns(sdk_speedup.SdkVersionWarning):
        render = offline.render_stack("dev")
    assert render.error is None and render.custom_resources
    assert resource_cycle_breaker._reachable is SDK._reachable


def test_the_deployed_program_uses_no_private_sdk_state():
    """What `pulumi up` runs: __main__.py, components/ and qwen_cluster/."""
    files = [ROOT / "__main__.py", *ROOT.joinpath("components").rglob("*.py")]
    files += ROOT.joinpath("qwen_cluster").rglob("*.py")
    for path in files:
        text = path.read_text()
        for private in ("sdk_speedup", "sdk_fixes", "resource_cycle_breaker", "pulumi.runtime.config.CONFIG"):
            assert private not in text, f"{path.relative_to(ROOT)} uses {private}"
