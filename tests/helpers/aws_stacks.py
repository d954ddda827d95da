"""Shared helpers for the AWS target tests: stack renders (cached) and config variants."""

from __future__ import annotations

import copy
import functools
import ipaddress
import json
from typing import Any

from tooling import offline, stackfile
from tooling.offline import Render

SG_RULE_TYPES = (
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
)
SG_TYPE = "aws:ec2/securityGroup:SecurityGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
SG_ATTACHMENT = "aws:ec2/networkInterfaceSecurityGroupAttachment:NetworkInterfaceSecurityGroupAttachment"


def variant(stack: str = "dev", *, nodes: int | None = None, **sections: dict[str, Any]) -> dict[str, Any]:
    """A stack file's config with `nodes` generated (master first) and sections merged in."""
    config = copy.deepcopy(stackfile.read(stack))
    if nodes is not None:
        cidr = ipaddress.IPv4Network(config["qwen-cluster:network"]["cidr"])
        first = list(cidr.hosts())[9]  # clear of the addresses AWS reserves
        config["qwen-cluster:nodes"] = [
            {
                "name": "master" if i == 0 else f"worker-{i}",
                "ip": str(first + i),
                "role": "master" if i == 0 else "worker",
            }
            for i in range(nodes)
        ]
    for key, value in sections.items():
        full = f"qwen-cluster:{key}"
        config[full] = {**config.get(full, {}), **value} if isinstance(value, dict) else value
    return config


@functools.lru_cache(maxsize=16)
def _render(frozen: str, stack: str) -> Render:
    result = offline.render(json.loads(frozen), stack)
    assert result.error is None, result.error
    return result


def render(config: dict[str, Any], stack: str = "dev") -> Render:
    return _render(json.dumps(config, sort_keys=True), stack)


def render_stack(stack: str) -> Render:
    return render(stackfile.read(stack), stack)


def group_names(result: Render) -> dict[str, str]:
    """SG mock id -> the group's role (nodes, load-balancer, bastion)."""
    return {f"{sg.name}-id": sg.name.removeprefix("security-") for sg in result.of_type(SG_TYPE)}


def rule_set(result: Render) -> set[tuple]:
    """Every SG rule as (group, direction, protocol, from, to, peer)."""
    names = group_names(result)
    rules = set()
    for type_ in SG_RULE_TYPES:
        direction = "ingress" if "Ingress" in type_ else "egress"
        for rule in result.of_type(type_):
            inputs = rule.inputs
            peer = (
                names[inputs["referencedSecurityGroupId"]]
                if "referencedSecurityGroupId" in inputs
                else inputs.get("cidrIpv4") or inputs.get("cidrIpv6")
            )
            ports = (inputs.get("fromPort"), inputs.get("toPort"))
            ports = tuple(int(p) if p is not None else None for p in ports)
            rules.add((names[inputs["securityGroupId"]], direction, inputs["ipProtocol"], *ports, peer))
    return rules


def sg_rule_resources(result: Render) -> list:
    return [rule for type_ in SG_RULE_TYPES for rule in result.of_type(type_)]
