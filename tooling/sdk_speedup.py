"""A speed-up for the offline render: a cost in the Pulumi Python SDK that grows with the
dependency graph, asked more cheaply. Offline tooling only: the deployed program (`__main__.py`,
components/, qwen_cluster/) uses Pulumi's public API alone and runs with the SDK as it ships.

Before the SDK records that a resource depends on another, it checks that the dependency does
not already reach the resource (pulumi/runtime/resource_cycle_breaker.py `declare_dependency`,
called for every dependency of every registration by pulumi/runtime/rpc.py `_add_dependency`),
with a recursive generator over everything the dependency reaches. Along a chain (the rollout,
each link depending on the previous one) or through a barrier that waits for every host, that is
most of the graph for each edge: the cost grows with the square of the cluster, and a chain
about 1,000 links deep exceeds Python's recursion limit.

`applied()` swaps in the same question asked from both ends at once, for one offline render
(tooling/offline.py), and puts the SDK's own functions back afterwards. The SDK records only each
resource's dependencies; `add_dependency` also records the reverse edge (who depends on it), and
`reachable` walks forward from the dependency and backward from the resource in turns, one
resource each, and stops when either side has nothing left. A resource being registered has few
dependents if any (only resources the program created after it can name it), so the backward
side runs out at once and the check costs a step or two, however long the chain behind the
dependency. Same answer for every graph, cycles included (tests/test_sdk_speedup.py checks it
against the SDK's own function), same errors on a real cycle; nothing registered changes. The
two functions go in together, before the program registers anything: the backward walk is exact
only if every edge went through `add_dependency`.

It replaces private functions, so it applies only on the SDK release it was checked against
(WRITTEN_FOR, the version requirements.txt pins); on any other the render runs with the SDK's
own search (slower on long chains), and `apply` says so once. After an SDK upgrade: if the SDK's
check no longer walks the graph per edge, drop this module; otherwise check that
`declare_dependency`, `_reachable`, `_add_dep` and `_deps` still mean what they meant, and move
WRITTEN_FOR.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import warnings
from collections.abc import Iterator

WRITTEN_FOR = "3.272.0"

_warned = False
# The SDK's own (_add_dep, _reachable), kept by the first `apply` for `restore`.
_SDK_FUNCTIONS: list = []


class SdkVersionWarning(UserWarning):
    """The installed Pulumi SDK is not the one the workaround was written for; it stands aside."""


def installed_sdk_version() -> str:
    return importlib.metadata.version("pulumi")


# What add_dependency keeps on each resource, next to the SDK's own attribute
# (resource_cycle_breaker._DEPENDENCIES_PROPERTY): the reverse edges, and a place in an order in
# which every resource comes after what it depends on.
_DEPENDENTS_PROPERTY = "_qwen_cluster_dependents"
_ORDER_PROPERTY = "_qwen_cluster_order"
_NONE: frozenset = frozenset()
_places = itertools.count()
# False once an edge closed a cycle (only a direct call can add one: declare_dependency refuses
# them); from then on the order means nothing and the searches are not bounded by it.
_ordered = True


def reset_order() -> None:
    """Order the searches again from here on: for a graph that shares no resource with the
    graphs before it (a new program run; `apply` calls it)."""
    global _ordered
    _ordered = True


def _dependents(resource) -> set:
    return getattr(resource, _DEPENDENTS_PROPERTY, _NONE)


def _place(resource) -> int:
    found = getattr(resource, _ORDER_PROPERTY, None)
    if found is None:
        found = next(_places)
        setattr(resource, _ORDER_PROPERTY, found)
    return found


def add_dependency(from_resource, to_resource) -> None:
    """What the SDK's `_add_dep` records (`from_resource` depends on `to_resource`), in place
    rather than as a new set per edge, the reverse edge, and the order kept: a resource first
    seen is placed last, what it depends on before it; an edge against the order moves the
    resources between its ends that it concerns (Pearce and Kelly, "A dynamic topological sort
    algorithm for directed acyclic graphs", JEA 2006), usually none."""
    from pulumi.runtime import resource_cycle_breaker

    for resource, other, name in (
        (from_resource, to_resource, resource_cycle_breaker._DEPENDENCIES_PROPERTY),
        (to_resource, from_resource, _DEPENDENTS_PROPERTY),
    ):
        found = getattr(resource, name, None)
        if found is None:
            setattr(resource, name, {other})
        else:
            found.add(other)
    if _ordered and _place(to_resource) > _place(from_resource):
        _reorder(from_resource, to_resource)


def _region(start, neighbours, keep) -> list:
    """`start` and what `neighbours` lead to from it through resources whose place `keep`s."""
    seen, stack = {start}, [start]
    while stack:
        for found in neighbours(stack.pop()):
            if found not in seen and keep(getattr(found, _ORDER_PROPERTY)):
                seen.add(found)
                stack.append(found)
    return list(seen)


def _reorder(dependent, dependency) -> None:
    """`dependent` now depends on `dependency`, which is placed after it: what depends on
    `dependent` up to `dependency`'s place, and what `dependency` depends on down to
    `dependent`'s, swap places, keeping their order among themselves."""
    from pulumi.runtime import resource_cycle_breaker

    global _ordered
    low, high = _place(dependent), _place(dependency)
    after = _region(dependent, _dependents, lambda place: place <= high)
    if dependency in after:  # a cycle
        _ordered = False
        return
    before = _region(dependency, resource_cycle_breaker._deps, lambda place: place >= low)
    moved = sorted(before, key=_place) + sorted(after, key=_place)
    for resource, place in zip(moved, sorted(_place(r) for r in moved), strict=True):
        setattr(resource, _ORDER_PROPERTY, place)


def reachable(from_resource, to_resource) -> bool:
    """Whether `to_resource` is `from_resource` or one of its recorded dependencies, at any depth.

    In the order add_dependency keeps, what a resource depends on comes before it: if
    `to_resource` comes after `from_resource`, the answer is no at once (what the SDK asks is
    almost always that: does the dependency reach the resource registered after it). Otherwise
    forward from one and backward from the other in turns, each within the places between
    them, until they meet (yes) or either side runs out (no: it has seen everything on its side,
    and the other end was not there)."""
    from pulumi.runtime import resource_cycle_breaker

    if from_resource == to_resource:
        return True
    top = bottom = None
    if _ordered:
        # Without a place a resource has no recorded edge: it reaches, and is reached by, nothing.
        top = getattr(from_resource, _ORDER_PROPERTY, None)
        bottom = getattr(to_resource, _ORDER_PROPERTY, None)
        if top is None or bottom is None or bottom > top:
            return False
    dependencies = resource_cycle_breaker._deps
    ahead, behind = {from_resource}, {to_resource}
    forward, backward = [from_resource], [to_resource]
    while forward and backward:
        for found in dependencies(forward.pop()):
            if found in behind:
                return True
            if found not in ahead and (bottom is None or getattr(found, _ORDER_PROPERTY) >= bottom):
                ahead.add(found)
                forward.append(found)
        for found in _dependents(backward.pop()):
            if found in ahead:
                return True
            if found not in behind and (top is None or getattr(found, _ORDER_PROPERTY) <= top):
                behind.add(found)
                backward.append(found)
    return False


def apply() -> bool:
    """Swap in `reachable` on the SDK release it was written for; on another, warn (once per
    process) and change nothing. Returns whether the speed-up is in place (`restore` undoes it)."""
    global _warned
    found = installed_sdk_version()
    if found != WRITTEN_FOR:
        if not _warned:
            _warned = True
            warnings.warn(
                f"tooling.sdk_speedup was written for pulumi {WRITTEN_FOR} and found pulumi "
                f"{found}: the offline render uses the SDK's dependency search as it is (slower on "
                "long dependency chains); check the SDK's resource_cycle_breaker and update or drop "
                "the speed-up",
                SdkVersionWarning,
                stacklevel=2,
            )
        return False
    # Imported only here: on another release the private module may not even exist.
    from pulumi.runtime import resource_cycle_breaker

    found_functions = (resource_cycle_breaker._add_dep, resource_cycle_breaker._reachable)
    if found_functions != (add_dependency, reachable):
        _SDK_FUNCTIONS[:] = found_functions

    # Both or neither: the searches need every edge recorded with its reverse and its order.
    reset_order()  # a new program: nothing it registers is connected to an earlier graph
    resource_cycle_breaker._add_dep = add_dependency
    resource_cycle_breaker._reachable = reachable
    return True


def restore() -> None:
    """Put the SDK's own functions back (as `apply` found them)."""
    from pulumi.runtime import resource_cycle_breaker

    if _SDK_FUNCTIONS:
        resource_cycle_breaker._add_dep, resource_cycle_breaker._reachable = _SDK_FUNCTIONS


@contextlib.contextmanager
def applied(enabled: bool = True) -> Iterator[bool]:
    """The speed-up in place for the block (when `enabled` and the SDK is the one it was
    written for), the SDK's own functions afterwards; yields whether it is in place."""
    active = enabled and apply()
    try:
        yield active
    finally:
        if active:
            restore()
