"""The resources of a stack as the stack policies see them: an index by name and type, with
references between resources resolved through the engine's property dependencies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pulumi_policy import PolicyResource

from policies import normalized as net
from policies.normalized import UNKNOWN, Rule, get, items


class Stack:
    """The resources of a stack with references resolved through the engine's property
    dependencies (a security-group id in preview is unknown; its dependency is not)."""

    def __init__(self, resources: list[PolicyResource]):
        self.resources = resources
        self.by_urn = {r.urn: r for r in resources}
        self.by_name: dict[str, PolicyResource] = {}
        for resource in resources:
            self.by_name.setdefault(resource.name, resource)

    def of_type(self, *types: str) -> list[PolicyResource]:
        return [r for r in self.resources if r.resource_type in types]

    def resolve(self, resource: PolicyResource, prop: str, value: Any, types: tuple[str, ...]) -> str | None:
        """The name of the resource of `types` that `resource.prop` (value `value`) refers to."""
        top = prop.split(".", 1)[0]
        candidates = [d for d in resource.property_dependencies.get(top, []) if d.resource_type in types]
        if len(candidates) == 1:
            return candidates[0].name
        for candidate in candidates or self.of_type(*types):
            if value is not UNKNOWN and value in (get(candidate.props, "name"), get(candidate.props, "arn")):
                return candidate.name
        if candidates and len({self.role(c) for c in candidates}) == 1:
            return candidates[0].name
        return None

    def resolver(self, resource: PolicyResource) -> Callable[[str, Any], str | None]:
        return lambda prop, value: self.resolve(resource, prop, value, (net.SECURITY_GROUP,))

    def role(self, resource: PolicyResource) -> str | None:
        return net.role_of(resource.props)

    def gpu_nodes(self) -> list[PolicyResource]:
        return [r for r in self.of_type(*net.COMPUTE_TYPES) if net.is_gpu_node(r.resource_type, r.props)]

    def launch_template_of(self, resource: PolicyResource) -> PolicyResource | None:
        spec = get(resource.props, "launchTemplate")
        if spec is None and resource.resource_type == net.AUTOSCALING_GROUP:
            spec = get(
                resource.props, "mixedInstancesPolicy", "launchTemplate", "launchTemplateSpecification"
            )
        if not isinstance(spec, Mapping):
            return None
        value = get(spec, "id") or get(spec, "name")
        found = self.resolve(resource, "launchTemplate", value, (net.LAUNCH_TEMPLATE,))
        return self.by_name.get(found) if found else None

    def groups_of(self, node: PolicyResource) -> set[str]:
        """The security groups a compute resource puts its interfaces in (names when resolved)."""
        groups: set[str] = set()
        sources = [(node, "vpcSecurityGroupIds"), (node, "securityGroups")]
        sources += [
            (node, f"networkInterfaces.{i}") for i in range(len(items(node.props, "networkInterfaces")))
        ]
        template = self.launch_template_of(node)
        if template is not None:
            sources += [(template, "vpcSecurityGroupIds"), (template, "securityGroupNames")]
            for entry in items(template.props, "networkInterfaces"):
                for value in items(entry, "securityGroups"):
                    found = self.resolve(template, "networkInterfaces", value, (net.SECURITY_GROUP,))
                    groups.add(found or str(value))
        for owner, prop in sources:
            if "." in prop:
                continue
            for value in items(owner.props, prop):
                found = self.resolve(owner, prop, value, (net.SECURITY_GROUP,))
                groups.add(found or str(value))
        return groups

    def group_roles(self) -> dict[str, str]:
        """Security group name -> node / monitoring-node / lb / bastion / other."""
        roles: dict[str, str] = {}
        by_tag = {
            net.NODE_SG: "node",
            net.MONITORING_SG: "monitoring-node",
            net.LB_SG: "lb",
            net.BASTION_SG: "bastion",
        }
        for group in self.of_type(net.SECURITY_GROUP):
            roles[group.name] = by_tag.get(self.role(group) or "", "other")
        for node in self.gpu_nodes():
            for group in self.groups_of(node):
                if roles.get(group, "other") == "other":
                    roles[group] = "node"
        return roles

    def rules(self) -> list[Rule]:
        found: list[Rule] = []
        for resource in self.of_type(*net.RULE_TYPES, net.REMOTE_COMMAND):
            found += net.rules_of(
                resource.resource_type, resource.name, resource.props, self.resolver(resource)
            )
        return found

    def host_firewalls(self) -> list[tuple[PolicyResource, net.HostFirewall]]:
        return [(r, doc) for r in self.of_type(net.REMOTE_COMMAND) for doc in net.firewall_documents(r.props)]
