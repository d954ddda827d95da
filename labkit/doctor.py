"""doctor against the lab: tooling/doctor.py, asking the lab's Prometheus from inside the lab
(its namespaces have no route to the host). scripts/doctor.py runs `main`."""

from __future__ import annotations

from labkit import blueprint, netns
from tooling import doctor


def lab_fetch(stack: str, label: str | None) -> tuple[doctor.Fetch, str]:
    """A fetch that asks the lab's Prometheus from inside its node's namespace, and its URL."""
    lab_plan = blueprint.load(stack, label=label)
    cluster = lab_plan.cluster
    if cluster.monitoring_node is None:
        raise doctor.Unreachable(f"stack {stack} has monitoring.prometheus off: no Prometheus in its lab")
    member = lab_plan.node(cluster.monitoring_node.name)
    if not netns.exists(member.namespace):
        raise doctor.Unreachable(f"lab {lab_plan.label} is not up (no namespace {member.namespace})")
    url = doctor.configured_url(cluster)
    inner = doctor.http_fetch(url)
    return (lambda path: netns.call_in(member.namespace, inner, path)), f"{url} (lab {lab_plan.label})"


def main(argv: list[str] | None = None) -> int:
    return doctor.main(argv, lab_fetch=lab_fetch)
