"""bandwidth-class: every GPU node's baseline bandwidth (the catalog's figure, or a bare-metal
host's declared NIC speed) meets the floor.
"""

from __future__ import annotations

from pulumi_policy import ReportViolation, ResourceValidationArgs, Severity

from policies import normalized as net
from policies.declaration import MANDATORY, Settings, resource_policy
from policies.facts import current_facts
from policies.normalized import get
from qwen_cluster import catalog, config


@resource_policy(
    name="bandwidth-class",
    description="Every GPU node has a baseline bandwidth of at least minBandwidthGbps "
    f"(default {config.MIN_BANDWIDTH_GBPS:g} Gbit/s).",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Pick an instance type from qwen_cluster/catalog.py whose baseline meets the floor "
    "(g6e.12xlarge: 100 Gbit/s); on bare metal use NICs of at least the floor and declare nicSpeedGbps. "
    "A type missing from the catalog must be added there with AWS's published figures.",
    config_schema={
        "minBandwidthGbps": {
            "type": "number",
            "minimum": 0,
            "default": config.MIN_BANDWIDTH_GBPS,
            "description": "Least baseline bandwidth per GPU node, Gbit/s (the stack's own floor "
            "network.minBandwidthGbps applies too when it is higher)",
        }
    },
)
def bandwidth_class(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    facts = current_facts()
    floor = max(float(settings["minBandwidthGbps"]), facts.stack_floor_gbps)
    source = (
        "network.minBandwidthGbps"
        if facts.stack_floor_gbps > float(settings["minBandwidthGbps"])
        else ("the policy's minBandwidthGbps")
    )
    if args.resource_type == net.REMOTE_COMMAND:
        for doc in net.firewall_documents(args.props):
            if doc.nic_speed_gbps is None:
                report(f"host {doc.host} declares no nicSpeedGbps; the bandwidth class cannot be checked")
            elif doc.nic_speed_gbps < floor:
                report(
                    f"host {doc.host} NIC {doc.nic_speed_gbps:g} Gbit/s is below {floor:g} Gbit/s ({source})"
                )
        return
    if not net.is_gpu_node(args.resource_type, args.props):
        return
    for kind_name in net.instance_types_of(args.resource_type, args.props):
        kind = catalog.instance_type(kind_name)
        if kind is None:
            report(
                f"instance type {kind_name} is not in the catalog (qwen_cluster/catalog.py): add it with "
                "AWS's published baseline bandwidth before using it for GPU nodes"
            )
        elif kind.baseline_gbps < floor:
            report(
                f"{kind_name} has a baseline of {kind.baseline_gbps:g} Gbit/s ({kind.bandwidth}), below "
                f"{floor:g} Gbit/s ({source})"
            )
    if (
        args.resource_type == net.LAUNCH_TEMPLATE
        and get(args.props, "instanceType") is None
        and get(args.props, "instanceRequirements") is not None
    ):
        report("a GPU launch template picks types by instanceRequirements; name the instance type")
