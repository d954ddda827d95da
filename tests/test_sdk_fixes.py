"""The SDK workaround (qwen_cluster/sdk_fixes.py) answers exactly as the SDK's own search."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pulumi.runtime import resource_cycle_breaker

from qwen_cluster import sdk_fixes
from tooling import offline


class Node:
    """Stands in for a Resource: the cycle breaker only reads `_direct_computed_dependencies`."""

    def __init__(self, index: int):
        self.index = index


def graph(edges: list[tuple[int, int]], size: int) -> list[Node]:
    nodes = [Node(index) for index in range(size)]
    for source, target in edges:
        resource_cycle_breaker._add_dep(nodes[source], nodes[target])
    return nodes


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=12).flatmap(
        lambda size: st.tuples(
            st.just(size),
            st.lists(st.tuples(st.integers(0, size - 1), st.integers(0, size - 1)), max_size=40),
        )
    )
)
def test_reachable_answers_as_the_sdk_on_any_graph_cycles_included(case):
    size, edges = case
    nodes = graph(edges, size)
    for source in nodes:
        for target in nodes:
            assert sdk_fixes.reachable(source, target) == sdk_fixes._SDK_REACHABLE(source, target)


def test_a_long_chain_is_searched_without_recursion():
    chain = graph([(index + 1, index) for index in range(5000)], 5001)
    assert sdk_fixes.reachable(chain[-1], chain[0])
    assert not sdk_fixes.reachable(chain[0], chain[-1])
    # The SDK's nested generators run out of stack on it: a rollout chain of a few thousand
    # resources would stop the program. When this no longer raises, drop the workaround.
    with pytest.raises(RecursionError):
        sdk_fixes._SDK_REACHABLE(chain[-1], chain[0])


def test_the_program_applies_it():
    original = resource_cycle_breaker._reachable
    try:
        resource_cycle_breaker._reachable = sdk_fixes._SDK_REACHABLE
        render = offline.render_stack("dev")
        assert render.error is None
        assert resource_cycle_breaker._reachable is sdk_fixes.reachable
    finally:
        resource_cycle_breaker._reachable = original
