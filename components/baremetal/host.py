"""Per-host setup over SSH: preflight -> sysctl -> rdma -> firewall -> selinux."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi_command import remote

from components.config import ClusterConfig, Node
from components.render import firewall, preflight, rdma, selinux, sysctl
from components.render.shell import sha256

STEPS = ("preflight", "sysctl", "rdma", "firewall", "selinux")


@dataclass(frozen=True)
class Step:
    name: str
    create: str
    delete: str | None
    data: list[dict[str, Any]] | None = None  # structured payload carried in the triggers


def steps_for(cluster: ClusterConfig, node: Node) -> list[Step]:
    """The rendered scripts of one host, in order (pure: no resources)."""
    flavour = cluster.bare_metal.firewall
    rules = firewall.host_rules(cluster, node.name)
    return [
        Step("preflight", preflight.for_node(cluster, node.name), None),
        Step("sysctl", sysctl.apply_script(cluster.tuning.sysctl), sysctl.revert_script()),
        Step("rdma", rdma.apply_script(required=cluster.tuning.rdma), rdma.revert_script()),
        Step(
            "firewall",
            firewall.apply_script(rules, flavour, node_ip=str(node.ip)),
            firewall.revert_script(flavour),
            [
                {"flavour": flavour, "node": node.name, "nodeIp": str(node.ip), **rule.as_dict()}
                for rule in rules
            ],
        ),
        Step(
            "selinux",
            selinux.apply_script(selinux.service_ports(cluster, node.name)),
            selinux.revert_script(),
        ),
    ]


@dataclass(frozen=True)
class HostSetupArgs:
    cluster: ClusterConfig
    node: Node
    connection: remote.ConnectionArgs


class HostSetup(pulumi.ComponentResource):
    """One host's chain of remote commands. A script's hash is its trigger, so a change re-runs
    that step only; the old step's `delete` (its revert) runs before the new one is created."""

    def __init__(self, name: str, args: HostSetupArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:HostSetup", name, None, opts)
        self.commands: dict[str, remote.Command] = {}
        previous: remote.Command | None = None
        for step in steps_for(args.cluster, args.node):
            triggers: list[Any] = [sha256(step.create)]
            if step.data is not None:
                triggers.append(step.data)
            command = remote.Command(
                f"{name}-{step.name}",
                connection=args.connection,
                create=step.create,
                delete=step.delete,
                triggers=triggers,
                opts=pulumi.ResourceOptions(
                    parent=self,
                    depends_on=[previous] if previous is not None else None,
                    delete_before_replace=True,
                ),
            )
            self.commands[step.name] = command
            previous = command
        self.last = previous
        self.register_outputs({"host": str(args.node.ip), "steps": list(self.commands)})
