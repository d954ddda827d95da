"""bandwidth-class: every GPU node's baseline bandwidth (the catalog's figure, or a bare-metal
host's declared NIC speed) meets the floor.
"""

from __future__ import annotations

from pulumi_policy import ReportViolation, ResourceValidationArgs, Severity

from policies import normalized as net
from policies.declaration import ADVISORY, MANDATORY, Settings, resource_policy
from policies.facts import current_facts
from policies.normalized import get
from qwen_cluster import catalog, config


def _measured(args: ResourceValidationArgs, report: ReportViolation) -> list[tuple[str, float, str]]:
    """The GPU nodes of one resource with a known bandwidth: (subject, Gbit/s, how it is known).
    What cannot be measured (no nicSpeedGbps, a type outside the catalog, a launch template
    without a type) is reported to `report` instead."""
    measured: list[tuple[str, float, str]] = []
    if args.resource_type == net.REMOTE_COMMAND:
        for doc in net.firewall_documents(args.props):
            if doc.nic_speed_gbps is None:
                report(f"host {doc.host} declares no nicSpeedGbps; the bandwidth class cannot be checked")
            else:
                measured.append((f"host {doc.host} NIC", doc.nic_speed_gbps, "declared nicSpeedGbps"))
        return measured
    if not net.is_gpu_node(args.resource_type, args.props):
        return measured
    for kind_name in net.instance_types_of(args.resource_type, args.props):
        kind = catalog.instance_type(kind_name)
        if kind is None:
            report(
                f"instance type {kind_name} is not in the catalog (qwen_cluster/catalog.py): add it with "
                "AWS's published baseline bandwidth before using it for GPU nodes"
            )
        else:
            measured.append((kind_name, kind.baseline_gbps, kind.bandwidth))
    if (
        args.resource_type == net.LAUNCH_TEMPLATE
        and get(args.props, "instanceType") is None
        and get(args.props, "instanceRequirements") is not None
    ):
        report("a GPU launch template picks types by instanceRequirements; name the instance type")
    return measured


def _below(subject: str, gbps: float, how: str, floor: str) -> str:
    if subject.startswith("host "):
        return f"{subject} {gbps:g} Gbit/s is below {floor}"
    return f"{subject} has a baseline of {gbps:g} Gbit/s ({how}), below {floor}"


@resource_policy(
    name="bandwidth-class",
    description="Every GPU node has a baseline bandwidth of at least minBandwidthGbps "
    f"(default {config.MIN_BANDWIDTH_GBPS:g} Gbit/s, the guide's minimum and the config's).",
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
    for subject, gbps, how in _measured(args, report):
        if gbps < floor:
            report(_below(subject, gbps, how, f"{floor:g} Gbit/s ({source})"))


def _ignore(message: str) -> None:
    """What bandwidth-class reports already (a node it cannot measure)."""


@resource_policy(
    name="bandwidth-recommended",
    description="Every GPU node has a baseline bandwidth of at least recommendedBandwidthGbps "
    f"(default {config.RECOMMENDED_BANDWIDTH_GBPS:g} Gbit/s, what the guide recommends).",
    enforcement_level=ADVISORY,
    severity=Severity.LOW,
    remediation_steps="Tensor-parallel traffic between nodes runs faster on wider links: prefer NICs or "
    f"instance types of {config.RECOMMENDED_BANDWIDTH_GBPS:g} Gbit/s or more (qwen_cluster/catalog.py); "
    "raise network.minBandwidthGbps to make a floor mandatory.",
    config_schema={
        "recommendedBandwidthGbps": {
            "type": "number",
            "minimum": 0,
            "default": config.RECOMMENDED_BANDWIDTH_GBPS,
            "description": "Baseline bandwidth per GPU node below which the pack advises, Gbit/s "
            "(a node already below the mandatory floor is bandwidth-class's)",
        }
    },
)
def bandwidth_recommended(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    recommended = float(settings["recommendedBandwidthGbps"])
    floor = max(float(config.MIN_BANDWIDTH_GBPS), current_facts().stack_floor_gbps)
    for subject, gbps, how in _measured(args, _ignore):
        if floor <= gbps < recommended:
            report(_below(subject, gbps, how, f"the recommended {recommended:g} Gbit/s"))
