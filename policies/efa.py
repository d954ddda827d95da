"""efa-placement: GPU nodes sit in one placement group of the configured strategy, in one subnet
and zone, with one EFA device per network card when EFA is in use.
"""

from __future__ import annotations

from pulumi_policy import PolicyResource, ReportViolation, Severity, StackValidationArgs

from policies import normalized as net
from policies.declaration import MANDATORY, Settings, stack_policy
from policies.facts import Facts, current_facts
from policies.normalized import get, items
from policies.stack import Stack
from qwen_cluster import catalog


def efa_interfaces(stack: Stack, node: PolicyResource) -> int:
    """EFA devices a compute resource gets: its template's, its own secondary or attached ENIs."""
    count = 0
    template = node if node.resource_type == net.LAUNCH_TEMPLATE else stack.launch_template_of(node)
    if template is not None:
        count += sum(
            1
            for entry in items(template.props, "networkInterfaces")
            if str(get(entry, "interfaceType", default="")).lower() in ("efa", "efa-only")
        )
    if node.resource_type == net.INSTANCE:
        count += sum(
            1
            for entry in items(node.props, "secondaryNetworkInterfaces")
            if str(get(entry, "interfaceType", default="")).lower() in ("efa", "efa-only")
        )
        for entry in items(node.props, "networkInterfaces"):
            found = stack.resolve(
                node, "networkInterfaces", get(entry, "networkInterfaceId"), (net.NETWORK_INTERFACE,)
            )
            eni = stack.by_name.get(found) if found else None
            if eni is not None and str(get(eni.props, "interfaceType", default="")).lower() in (
                "efa",
                "efa-only",
            ):
                count += 1
    return count


def uses_efa(stack: Stack, facts: Facts) -> bool:
    if facts.efa is not None:
        return facts.efa
    return any(efa_interfaces(stack, node) for node in stack.gpu_nodes())


@stack_policy(
    name="efa-placement",
    description="GPU nodes sit in a placement group with strategy cluster, in one subnet and AZ, with "
    "one EFA device per network card when EFA is configured.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Create an aws.ec2.PlacementGroup with strategy cluster and put every GPU node "
    "in it; use one subnet; give the launch template the interfaces catalog.interface_layout() lists.",
    config_schema={
        "placementStrategy": {
            "type": "string",
            "enum": ["cluster", "partition", "spread"],
            "default": "cluster",
            "description": "The placement group strategy GPU nodes must use",
        },
        "efa": {
            "type": "string",
            "enum": ["auto", "required", "off"],
            "default": "auto",
            "description": "auto: as the stack config says (aws.efa), else wherever the type supports it",
        },
    },
)
def efa_placement(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    facts = current_facts()
    stack = Stack(args.resources)
    nodes = stack.gpu_nodes()
    strategy = settings["placementStrategy"]
    subnets: dict[str, set[str]] = {}
    zones: dict[str, set[str]] = {}
    launched = {id(t) for other in nodes if (t := stack.launch_template_of(other)) is not None}
    efa_in_use = uses_efa(stack, facts)
    for node in nodes:
        if node.resource_type == net.LAUNCH_TEMPLATE and id(node) in launched:
            continue  # judged through the instances and groups launched from it
        template = stack.launch_template_of(node)
        if node.resource_type == net.LAUNCH_TEMPLATE:
            template = node
        # The placement group: the node's own, else its launch template's (by name or by id;
        # the AWS target names it by name: the provider's PlacementGroup.id is the name).
        candidates = [
            (node, "placementGroup", get(node.props, "placementGroup")),
            (node, "placementGroupId", get(node.props, "placementGroupId")),
        ]
        if template is not None:
            candidates += [
                (template, "placement", get(template.props, "placement", key))
                for key in ("groupName", "groupId")
            ]
        present = [(owner, prop, value) for owner, prop, value in candidates if value is not None]
        if not present:
            report(
                f"{node.name} is in no placement group: GPU nodes need one with strategy {strategy}", node.urn
            )
        else:
            owner, prop, value = present[0]
            found = stack.resolve(owner, prop, value, (net.PLACEMENT_GROUP,))
            group = stack.by_name.get(found) if found else None
            if group is None:
                report(
                    f"{node.name}: placement group {value} is not declared in this stack, so its strategy "
                    f"cannot be checked; declare it (strategy {strategy})",
                    node.urn,
                )
            elif str(get(group.props, "strategy", default="")).lower() != strategy:
                report(
                    f"{node.name}: placement group {group.name} has strategy "
                    f"{get(group.props, 'strategy', default='(none)')}; GPU nodes need {strategy} "
                    "(one spine, the lowest latency between nodes)",
                    node.urn,
                )
        # Subnets and zones.
        if node.resource_type == net.AUTOSCALING_GROUP:
            ids = items(node.props, "vpcZoneIdentifiers")
            if len(ids) > 1:
                report(f"{node.name} spans {len(ids)} subnets; GPU nodes need one subnet in one AZ", node.urn)
            for value in ids:
                subnets.setdefault(
                    stack.resolve(node, "vpcZoneIdentifiers", value, ("aws:ec2/subnet:Subnet",))
                    or str(value),
                    set(),
                ).add(node.name)
            azs = items(node.props, "availabilityZones")
            if len(azs) > 1:
                report(f"{node.name} spans {len(azs)} availability zones; GPU nodes need one", node.urn)
            for value in azs:
                zones.setdefault(str(value), set()).add(node.name)
        else:
            sources = [(node, "subnetId", get(node.props, "subnetId"))]
            if template is not None:
                for entry in items(template.props, "networkInterfaces")[:1]:
                    sources.append((template, "networkInterfaces", get(entry, "subnetId")))
            for owner, prop, value in sources:
                if value is not None:
                    subnet = stack.resolve(owner, prop, value, ("aws:ec2/subnet:Subnet",))
                    subnets.setdefault(subnet or str(value), set()).add(node.name)
                    break
            zone = get(node.props, "availabilityZone")
            if zone is None and template is not None:
                zone = get(template.props, "placement", "availabilityZone")
            if isinstance(zone, str):
                zones.setdefault(zone, set()).add(node.name)
        # EFA devices.
        kinds = net.instance_types_of(node.resource_type, node.props)
        if not kinds and template is not None:
            kinds = net.instance_types_of(net.LAUNCH_TEMPLATE, template.props)
        wanted = settings["efa"]
        for kind_name in kinds[:1]:
            kind = catalog.instance_type(kind_name)
            if facts.efa is not None:
                configured = facts.efa
            elif facts.known:
                configured = bool(kind and kind.efa)
            else:  # aws.efa unknown: EFA is expected where the stack itself uses it
                configured = efa_in_use
            expected = wanted == "required" or (wanted == "auto" and configured)
            if not expected:
                continue
            if kind is None or not kind.efa:
                report(f"{node.name}: {kind_name} has no EFA support but EFA is configured", node.urn)
                continue
            need = len(catalog.interface_layout(kind, True))
            have = efa_interfaces(stack, node)
            if have < need:
                report(
                    f"{node.name}: {have} EFA interface(s); {kind_name} has {kind.network_cards} network "
                    f"card(s) and needs {need} (one EFA device per card)",
                    node.urn,
                )
    for label, seen in (("subnets", subnets), ("availability zones", zones)):
        if len(seen) > 1:
            spread = "; ".join(f"{key}: {', '.join(sorted(names))}" for key, names in sorted(seen.items()))
            report(
                f"GPU nodes are spread over {len(seen)} {label} ({spread}); "
                "a cluster placement group needs one"
            )
