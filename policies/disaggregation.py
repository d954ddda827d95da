"""kv-link-floor, kv-link-share, kv-transport: a disaggregated stack's prefill->decode path carries
the KV cache its prefill pool makes, over RDMA (docs/disaggregation.md).

What the stack intends comes from its config when the engine handed it over, else from the
`qwen-cluster/kv-link@1` declaration the program registers (components/kvlink.py): a pack started
without the stack config judges the same figures. The link itself is read off the resources where
they show it (an AWS node's instance type, a bare-metal host's declared nicSpeedGbps), so a node
group built by hand is judged on what it is; the arithmetic is qwen_cluster/kvlink.py's, the one
the config rules, `doctor` and the docs use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pulumi_policy import PolicyResource, ReportViolation, Severity, StackValidationArgs

from policies import normalized as net
from policies.declaration import ADVISORY, MANDATORY, Settings, stack_policy
from policies.efa import efa_interfaces
from policies.facts import current_facts
from policies.stack import Stack
from qwen_cluster import catalog, kvlink


@dataclasses.dataclass(frozen=True)
class KvDeclaration:
    """A disaggregated stack's declaration and the resource that carries it (None: from the config only)."""

    document: Mapping[str, Any]
    resource: PolicyResource | None

    @property
    def urn(self) -> str | None:
        return self.resource.urn if self.resource is not None else None

    def pool_nodes(self) -> list[str]:
        return [str(name) for pool in ("prefill", "decode") for name in self.document[pool]["nodes"]]


def declared(stack: Stack) -> KvDeclaration | None:
    """The stack's KV-path declaration: the stack config's when the pack has it (None when that
    says aggregated), else the registered one; None when neither says disaggregated or a preview
    has not resolved it."""
    facts = current_facts()
    resources = [
        (resource, document)
        for resource in stack.of_type(net.KV_LINK)
        if (document := net.kv_link_declaration(resource.resource_type, resource.props)) is not None
    ]
    carrier = resources[0][0] if resources else None
    if facts.known:
        return KvDeclaration(facts.kv_link, carrier) if facts.kv_link is not None else None
    if not resources or resources[0][1] is net.UNKNOWN:
        return None
    return KvDeclaration(resources[0][1], carrier)  # type: ignore[arg-type]


def _instance_type(stack: Stack, node: PolicyResource) -> catalog.InstanceType | None:
    kinds = net.instance_types_of(node.resource_type, node.props)
    template = stack.launch_template_of(node)
    if not kinds and template is not None:
        kinds = net.instance_types_of(template.resource_type, template.props)
    return catalog.instance_type(kinds[0]) if kinds else None


def node_links(stack: Stack) -> dict[str, tuple[float, str]]:
    """Node name -> (its link in Gbit/s, what says so), for the nodes whose resources show it: an
    AWS GPU node tagged with its name (the catalog's baseline of its instance type), a bare-metal
    host's firewall document (its declared nicSpeedGbps)."""
    links: dict[str, tuple[float, str]] = {}
    for node in stack.gpu_nodes():
        name = net.tags_of(node.props).get(net.NODE_TAG)
        kind = _instance_type(stack, node)
        if name and kind is not None:
            links[name] = (kind.baseline_gbps, f"aws.instanceType {kind.name}")
    for _, doc in stack.host_firewalls():
        if doc.nic_speed_gbps is not None:
            links[doc.host] = (doc.nic_speed_gbps, "bareMetal.nicSpeedGbps")
    return links


def link_demand(stack: Stack, found: KvDeclaration) -> kvlink.LinkDemand | None:
    """The link demand of the declaration, on the narrowest link the pool nodes' resources show
    (the declared one where they show none). None when its figures are unknown (a model or GPU
    outside the catalog: the config rules refuse those by name)."""
    computed = kvlink.demand_of(found.document)
    if computed is None:
        return None
    links = node_links(stack)
    shown = sorted((links[name][0], name) for name in found.pool_nodes() if name in links)
    if shown and shown[0][0] != computed.link_gbps:
        gbps, name = shown[0]
        source = f"{links[name][1]} of node {name}, the narrowest of the pools"
        computed = dataclasses.replace(computed, link_gbps=gbps, link_source=source)
    return computed


def _malformed(report: ReportViolation, found: KvDeclaration, error: Exception) -> None:
    report(
        f"the {kvlink.SCHEMA} declaration cannot be read ({type(error).__name__}: {error}); the link "
        "the prefill pool needs cannot be judged",
        found.urn,
    )


@stack_policy(
    name="kv-link-floor",
    description="A disaggregated stack's prefill->decode path carries the KV cache its prefill pool "
    "makes: the model's KV bytes per token x the prefill rate of the declared GPUs, per node.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Give the nodes a link at least the floor the message names (an instance type or NICs "
    "of that bandwidth; on bare metal declare it in bareMetal.nicSpeedGbps), or make less KV per node: "
    "fewer GPUs per prefill replica (serving.prefill.tensorParallel), FP8 KV (`--kv-cache-dtype fp8` "
    "halves it), more decode nodes; or serve aggregated (serving.mode aggregated). A measured prefill "
    "rate replaces the datasheet estimate: serving.prefill.tokensPerSecondPerGpu (docs/disaggregation.md).",
)
def kv_link_floor(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    stack = Stack(args.resources)
    found = declared(stack)
    if found is None:
        return
    try:
        computed = link_demand(stack, found)
    except (KeyError, TypeError, ValueError) as error:
        _malformed(report, found, error)
        return
    if computed is not None and not computed.carried:
        report(
            f"the prefill->decode path cannot carry the KV cache the prefill pool makes: "
            f"{computed.link_gbps:g} Gbit/s per node is below the link floor of "
            f"{computed.floor_gbps:,.1f} Gbit/s. {computed.figures()}",
            found.urn,
        )


@stack_policy(
    name="kv-link-share",
    description="A disaggregated stack's KV transfer takes at most maxTransferShare of the prefill time "
    f"(default {kvlink.TRANSFER_SHARE:g}): above it, the transfer is a visible part of every time to "
    "first token.",
    enforcement_level=ADVISORY,
    severity=Severity.LOW,
    remediation_steps="A wider link (the message names the one that keeps the transfer under the share), "
    "FP8 KV (`--kv-cache-dtype fp8`), or more decode nodes; measure before and after "
    "(docs/disaggregation.md).",
    config_schema={
        "maxTransferShare": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": kvlink.TRANSFER_SHARE,
            "description": "The share of the prefill time the KV transfer may take before the pack advises "
            "(0.1: a tenth)",
        }
    },
)
def kv_link_share(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    stack = Stack(args.resources)
    found = declared(stack)
    if found is None:
        return
    try:
        computed = link_demand(stack, found)
    except (KeyError, TypeError, ValueError):
        return  # kv-link-floor says it
    bar = float(settings["maxTransferShare"])
    if computed is not None and computed.carried and computed.share > bar:
        report(
            f"the KV transfer takes {computed.share:.0%} of the prefill time, above {bar:.0%}: "
            f"{computed.advised_for(bar):,.0f} Gbit/s per node keeps it under. {computed.figures(bar)}",
            found.urn,
        )


@stack_policy(
    name="kv-transport",
    description="On AWS a disaggregated stack moves the KV cache over EFA with NIXL's LIBFABRIC backend: "
    "every pool node has EFA interfaces, and the backend is libfabric (UCX does not connect across "
    "nodes on EFA; without EFA NIXL falls back to TCP).",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Use an EFA instance type with aws.efa true (the node group then carries one EFA "
    "device per network card) and serving.kvTransfer.backend libfabric (the default on aws).",
)
def kv_transport(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    stack = Stack(args.resources)
    found = declared(stack)
    if found is None:
        return
    document = found.document
    try:
        pools = {name: pool for pool in ("prefill", "decode") for name in document[pool]["nodes"]}
    except (KeyError, TypeError):
        return  # kv-link-floor says the declaration cannot be read
    # The pool nodes as the stack registers them, by the node tag (an instance follows its template).
    by_name: dict[str, list[PolicyResource]] = {}
    for node in stack.gpu_nodes():
        name = net.tags_of(node.props).get(net.NODE_TAG)
        if name in pools:
            by_name.setdefault(name, []).append(node)
    on_aws = document.get("target") == "aws" or bool(by_name)
    if not on_aws:
        return
    backend = str(document.get("backend") or "")
    if backend != "libfabric":
        report(
            f"serving.kvTransfer.backend {backend or '(none)'} on aws: NIXL's UCX backend does not connect "
            "across nodes on EFA; use libfabric (NIXL's EFA backend)",
            found.urn,
        )
    for name in sorted(by_name):
        nodes = by_name[name]
        if max(efa_interfaces(stack, node) for node in nodes) == 0:
            shown = next((n for n in nodes if n.resource_type == net.INSTANCE), nodes[0])
            report(
                f"{shown.name} (node {name}, {pools[name]} pool) has no EFA interface: NIXL "
                "would move the KV cache over TCP, which the field reports as effectively unusable (~98 s "
                "to the first token on p5.48xlarge, NVIDIA Dynamo's communication guide)",
                shown.urn,
            )
