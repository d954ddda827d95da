"""node-count: the cluster has at least the configured number of GPU nodes (instances, autoscaling
capacity, bare-metal hosts).
"""

from __future__ import annotations

from pulumi_policy import ReportViolation, Severity, StackValidationArgs

from policies import normalized as net
from policies.declaration import MANDATORY, Settings, stack_policy
from policies.stack import Stack

# The default floor: the guide asks for at least 2 GPU nodes (4 or more recommended).
MIN_NODES = 2


@stack_policy(
    name="node-count",
    description=f"The cluster has at least minNodes GPU nodes (default {MIN_NODES}).",
    enforcement_level=MANDATORY,
    severity=Severity.MEDIUM,
    remediation_steps="List at least two nodes in qwen-cluster:nodes (four or more recommended).",
    config_schema={
        "minNodes": {"type": "integer", "minimum": 1, "default": MIN_NODES, "description": "Least GPU nodes"}
    },
)
def node_count(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    stack = Stack(args.resources)
    counted = [(n.name, net.node_count(n.resource_type, n.props)) for n in stack.gpu_nodes()]
    counted += [(doc.host, 1) for _, doc in stack.host_firewalls() if doc.role == net.GPU_NODE]
    total = sum(count for _, count in counted)
    if total < settings["minNodes"]:
        listed = ", ".join(name for name, count in counted if count) or "none"
        report(
            f"{total} GPU node(s) ({listed}); the cluster needs at least {settings['minNodes']} "
            "(4 or more recommended)"
        )
