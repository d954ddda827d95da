"""The VPC's address plan, derived from `network.cidr` (the node subnet): no extra config keys.

The VPC is the node subnet's supernet two bits shorter (at most a /16, AWS's largest VPC),
so the node subnet keeps its exact CIDR and the public subnets fit beside it.
https://docs.aws.amazon.com/vpc/latest/userguide/vpc-cidr-blocks.html (a VPC is /16 to /28)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

LARGEST_VPC_PREFIX = 16
# Public subnets hold the NAT gateway, the bastion and the internet-facing NLB's nodes. An NLB
# needs at least 8 free addresses in each of its subnets; AWS reserves 5 per subnet. A /26
# leaves 59; a node subnet smaller than that makes its public siblings as small (/28: 11 free).
# https://docs.aws.amazon.com/elasticloadbalancing/latest/network/network-load-balancers.html
PUBLIC_SUBNET_PREFIX = 26


@dataclass(frozen=True)
class VpcPlan:
    vpc_cidr: ipaddress.IPv4Network
    node_subnet: ipaddress.IPv4Network
    # [0] always (NAT gateway, bastion); [1] in a second AZ only for an internet-facing NLB.
    public_subnets: tuple[ipaddress.IPv4Network, ...]


def plan(node_cidr: ipaddress.IPv4Network, *, internet_facing: bool) -> VpcPlan:
    """Where every subnet goes; raises ValueError if network.cidr leaves no room."""
    if node_cidr.prefixlen <= LARGEST_VPC_PREFIX:
        raise ValueError(f"network.cidr {node_cidr} leaves no room for public subnets in a VPC (at most /16)")
    vpc_cidr = node_cidr.supernet(new_prefix=max(LARGEST_VPC_PREFIX, node_cidr.prefixlen - 2))
    public_prefix = max(PUBLIC_SUBNET_PREFIX, node_cidr.prefixlen)
    free = (block for block in vpc_cidr.subnets(new_prefix=public_prefix) if not block.overlaps(node_cidr))
    count = 2 if internet_facing else 1
    return VpcPlan(vpc_cidr, node_cidr, tuple(next(free) for _ in range(count)))


def outside_vpc(plan: VpcPlan, vpc_cidrs: list[str]) -> list[str]:
    """The planned subnets an existing VPC (its CIDR blocks) cannot hold, for the error."""
    blocks = [ipaddress.ip_network(cidr) for cidr in vpc_cidrs]
    wanted = [("network.cidr", plan.node_subnet)] + [("public subnet", net) for net in plan.public_subnets]
    return [
        f"{what} {subnet}"
        for what, subnet in wanted
        if not any(block.version == 4 and subnet.subnet_of(block) for block in blocks)
    ]
