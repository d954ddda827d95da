"""A workaround for a cost in the Pulumi Python SDK that grows with the rollout chain.

Before the SDK records that a resource depends on another, it checks that the dependency does
not already reach the resource (pulumi/runtime/resource_cycle_breaker.py `_reachable`), with a
recursive generator over every resource the dependency reaches. The rollout chain (each
replica's instance and association depend on the previous replica's health gate,
qwen_cluster/aws/nodes.py) makes that set the whole chain, so every registration walks it
through nested `yield from` frames, one per link: at 256 nodes this was most of the time the
program spends registering (`make bench`). `apply()` swaps in the same search without
recursion. Same answer for every graph (tests/test_sdk_fixes.py checks it against the SDK's
own function), same errors on a real cycle; nothing registered changes.
Drop it when the SDK's search stops recursing.
"""

from __future__ import annotations

from pulumi.runtime import resource_cycle_breaker

_SDK_REACHABLE = resource_cycle_breaker._reachable


def reachable(from_resource, to_resource) -> bool:
    """Whether `to_resource` is `from_resource` or one of its recorded dependencies, at any depth."""
    seen: set = set()
    stack = [from_resource]
    while stack:
        resource = stack.pop()
        if resource == to_resource:
            return True
        if resource in seen:
            continue
        seen.add(resource)
        stack.extend(resource_cycle_breaker._deps(resource))
    return False


def apply() -> None:
    resource_cycle_breaker._reachable = reachable
