"""Security-group rules rendered from the port table's exposures (AWS), as plain specs.

One spec is one `aws.vpc.SecurityGroupIngressRule`/`EgressRule` (one CIDR or one referenced
group each, as those resources take). The count depends on the table and the CIDR lists,
never on the number of nodes: members are named by the node SG, not by address.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from qwen_cluster.ports import Exposure, Peer, PortRange, Target

HTTPS_PORT = 443
ANYWHERE_IPV4 = "0.0.0.0/0"
# What EC2 accepts in a rule description (AuthorizeSecurityGroupIngress, IpRange.Description):
# up to 255 characters of a-zA-Z0-9, spaces and ._-:/()#,@[]+=&;{}!$*
DESCRIPTION = re.compile(r"^[a-zA-Z0-9 ._\-:/()#,@\[\]+=&;{}!$*]{1,255}$")


class Group(StrEnum):
    """The security groups of the AWS target."""

    NODES = "nodes"
    LOAD_BALANCER = "load-balancer"
    BASTION = "bastion"
    # On `monitoring.node`'s primary interface only, next to NODES: the rows of a service that
    # runs on that one node (Prometheus, Alertmanager). NODES is on every node's interfaces, so a
    # rule there would admit monitoringCidrs to 9090/9093 on every worker too.
    MONITORING_NODE = "monitoring-node"


class Direction(StrEnum):
    INGRESS = "ingress"
    EGRESS = "egress"


@dataclass(frozen=True)
class RuleSpec:
    key: str  # unique among the specs; becomes the resource name's suffix
    group: Group  # the SG the rule belongs to
    direction: Direction
    protocol: str  # "-1" (all) or "tcp", as the EC2 API spells it
    from_port: int | None  # None with protocol "-1"
    to_port: int | None
    description: str
    cidr_ipv4: str | None = None
    cidr_ipv6: str | None = None
    peer_group: Group | None = None  # referenced security group

    @property
    def peer(self) -> str:
        return self.peer_group.value if self.peer_group else (self.cidr_ipv4 or self.cidr_ipv6 or "")


_TARGET_GROUP = {
    Target.NODES: Group.NODES,
    Target.LOAD_BALANCER: Group.LOAD_BALANCER,
    Target.BASTION: Group.BASTION,
}
_PEER_GROUP = {Peer.NODES: Group.NODES, Peer.LOAD_BALANCER: Group.LOAD_BALANCER, Peer.BASTION: Group.BASTION}


def _ports(span: PortRange | None, protocol: str) -> tuple[str, int | None, int | None]:
    if protocol == "all" or span is None:
        return "-1", None, None
    return protocol, span.low, span.high


def rules(exposures: Iterable[Exposure]) -> list[RuleSpec]:
    """Ingress from the exposures, then the egress they imply, then the nodes' way out.

    Egress is default-deny too (the provider removes the default allow-all egress rule of a
    new SG), so every ingress that names another of our groups gets its mirror egress on
    that group: the nodes' self rule in both directions (EFA requires an all-traffic rule
    in AND out, https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html#efa-start-security),
    the NLB to the model port (forwarding and health checks), the bastion to SSH.

    serving.mode disaggregated adds no rule: NIXL's side channel (the `kv-side-channel` row,
    scope cluster) and LIBFABRIC's traffic over EFA are node to node, inside that self rule (EFA's
    own requirement, the page above: "allows all inbound and outbound traffic to and from the
    security group itself"), so the other pool reaches them and nothing outside the group does.
    Nor can a rule keep the node's own pool off them, as the bare-metal host firewall does
    (render/firewall.py, ports.POOL_FENCED_ROWS): a security group has allow rules only ("You can
    specify allow rules, but not deny rules",
    https://docs.aws.amazon.com/vpc/latest/userguide/security-group-rules.html), and that self rule
    admits every member to every port. Both pools share the node group, as EFA's self rule needs
    (one group per pool would leave EFA between the pools to rules between two groups, which the
    EFA page does not describe), so on AWS the same pool reaches NIXL's ports too
    (ClusterConfig.fenced_pool is None there; docs/disaggregation.md).
    """
    specs: list[RuleSpec] = []
    for exposure in exposures:
        group = Group.MONITORING_NODE if exposure.node is not None else _TARGET_GROUP[exposure.target]
        protocol, low, high = _ports(exposure.ports, exposure.protocol)
        if exposure.peer is Peer.CIDRS:
            for index, cidr in enumerate(exposure.cidrs):
                family = ipaddress.ip_network(cidr).version
                specs.append(
                    RuleSpec(
                        key=f"{group}-in-{exposure.name}-{index}",
                        group=group,
                        direction=Direction.INGRESS,
                        protocol=protocol,
                        from_port=low,
                        to_port=high,
                        description=f"{exposure.description} ({cidr})",
                        cidr_ipv4=cidr if family == 4 else None,
                        cidr_ipv6=cidr if family == 6 else None,
                    )
                )
            continue
        peer = _PEER_GROUP[exposure.peer]
        specs.append(
            RuleSpec(
                key=f"{group}-in-{exposure.name}",
                group=group,
                direction=Direction.INGRESS,
                protocol=protocol,
                from_port=low,
                to_port=high,
                description=exposure.description,
                peer_group=peer,
            )
        )
        specs.append(
            RuleSpec(
                key=f"{peer}-out-{exposure.name}",
                group=peer,
                direction=Direction.EGRESS,
                protocol=protocol,
                from_port=low,
                to_port=high,
                description=f"mirror of {group} ingress: {exposure.description}",
                peer_group=group,
            )
        )
    # The nodes pull the model server image and the weights over HTTPS (registry, Hugging
    # Face, S3 through the gateway endpoint). DNS and NTP need no rule: SGs do not filter
    # traffic to the Amazon DNS server or the Time Sync Service
    # (https://docs.aws.amazon.com/vpc/latest/userguide/vpc-security-groups.html).
    specs.append(
        RuleSpec(
            key=f"{Group.NODES}-out-https",
            group=Group.NODES,
            direction=Direction.EGRESS,
            protocol="tcp",
            from_port=HTTPS_PORT,
            to_port=HTTPS_PORT,
            description="HTTPS 443/tcp out: model server image and weights",
            cidr_ipv4=ANYWHERE_IPV4,
        )
    )
    bad = [spec.description for spec in specs if not DESCRIPTION.match(spec.description)]
    if bad:
        raise ValueError(f"security-group rule descriptions EC2 would refuse: {bad}")
    keys = [spec.key for spec in specs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise ValueError(f"security-group rules collide on names {duplicates}")
    return specs


def groups(specs: Iterable[RuleSpec]) -> list[Group]:
    """The groups the rules need, in a stable order."""
    used = {spec.group for spec in specs} | {spec.peer_group for spec in specs if spec.peer_group}
    return [group for group in Group if group in used]
