"""SecurityGroups: the node, monitoring-node, load-balancer and bastion groups and their rules, from
the port table."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from qwen_cluster.render.sg_rules import Direction, Group, RuleSpec
from qwen_cluster.tags import BASTION_SG, LB_SG, MONITORING_SG, NODE_SG, ROLE_TAG

_PURPOSE = {
    Group.NODES: "GPU nodes: all traffic between members, the model port from the NLB only",
    Group.LOAD_BALANCER: "model NLB: the listener from clientCidrs only",
    Group.BASTION: "SSH jump host: SSH from adminCidrs only",
    Group.MONITORING_NODE: "monitoring node only: Prometheus and Alertmanager from monitoringCidrs",
}
# The policy pack tells the groups apart by these tags (who may reach the model port, SSH).
_ROLE = {
    Group.NODES: NODE_SG,
    Group.LOAD_BALANCER: LB_SG,
    Group.BASTION: BASTION_SG,
    Group.MONITORING_NODE: MONITORING_SG,
}


@dataclass
class SecurityGroupsArgs:
    vpc_id: pulumi.Input[str]
    rules: list[RuleSpec]
    tags: dict[str, str]

    def validate(self) -> None:
        if not any(rule.group is Group.NODES for rule in self.rules):
            raise ValueError("no rule for the node security group")


class SecurityGroups(pulumi.ComponentResource):
    """One SG per group the rules name; rules as standalone resources, one CIDR or group each.

    Standalone rules (not inline) so a rule change never rewrites the whole group, and the
    provider's note: inline rules and aws.vpc.SecurityGroup*Rule must not be mixed. A new SG
    starts without AWS's default allow-all egress (the provider removes it), so egress is
    exactly the rules listed.
    """

    group_ids: dict[Group, pulumi.Output[str]]

    def __init__(self, name: str, args: SecurityGroupsArgs, opts: pulumi.ResourceOptions | None = None):
        args.validate()
        super().__init__("qwen-cluster:aws:SecurityGroups", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        used = [
            group for group in Group if any(group in (rule.group, rule.peer_group) for rule in args.rules)
        ]
        groups = {
            group: aws.ec2.SecurityGroup(
                f"{name}-{group}",
                vpc_id=args.vpc_id,
                description=_PURPOSE[group],
                tags={**args.tags, "Name": f"{name}-{group}", ROLE_TAG: _ROLE[group]},
                opts=child,
            )
            for group in used
        }
        for rule in args.rules:
            common = {
                "security_group_id": groups[rule.group].id,
                "ip_protocol": rule.protocol,
                "from_port": rule.from_port,
                "to_port": rule.to_port,
                "description": rule.description,
                "cidr_ipv4": rule.cidr_ipv4,
                "cidr_ipv6": rule.cidr_ipv6,
                "referenced_security_group_id": groups[rule.peer_group].id if rule.peer_group else None,
                "tags": {**args.tags, "Name": f"{name}-{rule.key}"},
            }
            kind = (
                aws.vpc.SecurityGroupIngressRule
                if rule.direction is Direction.INGRESS
                else aws.vpc.SecurityGroupEgressRule
            )
            kind(f"{name}-{rule.key}", **common, opts=child)
        self.group_ids = {group: sg.id for group, sg in groups.items()}
        self.register_outputs({str(group): sg_id for group, sg_id in self.group_ids.items()})
