"""A workaround for a cost in the Pulumi Python SDK that grows with the rollout chain.

Before the SDK records that a resource depends on another, it checks that the dependency does
not already reach the resource (pulumi/runtime/resource_cycle_breaker.py `_reachable`), with a
recursive generator over every resource the dependency reaches. The rollout chain (each
replica's instance and association depend on the previous replica's health gate,
qwen_cluster/aws/nodes.py) makes that set the whole chain, so every registration walks it
through nested `yield from` frames, one per link: the cost grows with the square of the chain
(the offline prod render spends no measurable CPU on it at 64 nodes, about a quarter of its CPU
at 256 and a third at 512), and a chain about 1,000 links deep exceeds Python's recursion
limit, which stops the program. `apply()` swaps in the same search without recursion. Same
answer for every graph (tests/test_sdk_fixes.py checks it against the SDK's own function), same
errors on a real cycle; nothing registered changes.

It replaces a private function, so it applies only on the SDK release it was checked against
(WRITTEN_FOR, the version requirements.txt pins); on any other it warns once and leaves the SDK
as it is. After an SDK upgrade: if the SDK's search no longer recurses, drop this module;
otherwise check that `_reachable` and `_deps` still mean what they meant, and move WRITTEN_FOR.
"""

from __future__ import annotations

import importlib.metadata
import warnings

WRITTEN_FOR = "3.272.0"

_warned = False


class SdkVersionWarning(UserWarning):
    """The installed Pulumi SDK is not the one the workaround was written for; it stands aside."""


def installed_sdk_version() -> str:
    return importlib.metadata.version("pulumi")


def reachable(from_resource, to_resource) -> bool:
    """Whether `to_resource` is `from_resource` or one of its recorded dependencies, at any depth."""
    from pulumi.runtime import resource_cycle_breaker

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


def apply() -> bool:
    """Swap in `reachable` on the SDK release it was written for; on another, warn (once per
    process) and change nothing. Returns whether the workaround is in place."""
    global _warned
    found = installed_sdk_version()
    if found != WRITTEN_FOR:
        if not _warned:
            _warned = True
            warnings.warn(
                f"qwen_cluster.sdk_fixes was written for pulumi {WRITTEN_FOR} and found pulumi "
                f"{found}: it leaves the SDK's dependency search as it is (slower on long rollout "
                "chains); check the SDK's resource_cycle_breaker and update or drop the workaround",
                SdkVersionWarning,
                stacklevel=2,
            )
        return False
    # Imported only here: on another release the private module may not even exist.
    from pulumi.runtime import resource_cycle_breaker

    resource_cycle_breaker._reachable = reachable
    return True
