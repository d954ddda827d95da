"""The render grows linearly with the node count: every added node adds the same number of
resources and of dependency edges, on both targets (structural; the timings are `make bench`'s).

A dependency on every host from every node (N x N edges, each checked by the SDK for a cycle)
shows up here as edges per node that grow with the cluster."""

from __future__ import annotations

import pytest

from tooling import bench, offline

SIZES = (4, 8, 16)


def _shape(stack: str, count: int) -> tuple[int, int]:
    rendered = offline.render(bench.scaled_stack(stack, count), stack)
    assert rendered.error is None, rendered.error
    edges = sum(len(waits_for) for waits_for in rendered.dependencies().values())
    return len(rendered.resources), edges


@pytest.fixture(scope="module", params=["onprem", "prod"])
def shapes(request) -> dict[int, tuple[int, int]]:
    return {count: _shape(request.param, count) for count in SIZES}


def _per_node(shapes: dict[int, tuple[int, int]], index: int) -> list[float]:
    """What each added node adds, between consecutive sizes."""
    return [
        (shapes[large][index] - shapes[small][index]) / (large - small)
        for small, large in zip(SIZES, SIZES[1:], strict=False)
    ]


def test_each_added_node_adds_the_same_number_of_resources(shapes):
    first, second = _per_node(shapes, 0)
    assert first == second and first > 0


def test_each_added_node_adds_the_same_number_of_dependency_edges(shapes):
    first, second = _per_node(shapes, 1)
    assert first == second and first > 0
