"""The qwen-cluster-guard policies: bandwidth class, port exposure, required paths, EFA placement,
node count and the security baseline. Importing this module has no side effects: `POLICIES` is a
list the thin `__main__.py` hands to `PolicyPack`, and the offline harness runs directly.

The facts the policies judge against come from one place each: instance figures from
`qwen_cluster.catalog`, ports and scopes from `qwen_cluster.ports` (the stack's own table when the
stack config is readable, the project default otherwise), thresholds from the policy config.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    PolicyResource,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    Severity,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies import normalized as net
from policies.normalized import UNKNOWN, Peer, Rule, get, items
from qwen_cluster import catalog, config
from qwen_cluster.ports import DEFAULT_PORTS, SSH_PORT, PortEntry, PortRange, Scope

PACK_NAME = "qwen-cluster-guard"
RDP_PORT = 3389
# A streamed, thinking-mode answer can stay silent for minutes; AWS's NLB default (350 s)
# and nginx's (60 s) cut it. Ten minutes is the least we accept without a warning.
STREAMING_IDLE_FLOOR_SECONDS = 600
NLB_DEFAULT_IDLE_SECONDS = 350  # tcp.idle_timeout.seconds default
ALB_DEFAULT_IDLE_SECONDS = 60

# Each policy's config schema; DEFAULTS mirrors the schema defaults, because the CLI applies
# them but a direct call (tests, the offline harness) does not.
SCHEMAS: dict[str, dict[str, dict[str, Any]]] = {
    "bandwidth-class": {
        "minBandwidthGbps": {
            "type": "number",
            "minimum": 0,
            "default": config.MIN_BANDWIDTH_GBPS,
            "description": "Least baseline bandwidth per GPU node, Gbit/s (the stack's own floor "
            "network.minBandwidthGbps applies too when it is higher)",
        }
    },
    "port-exposure": {
        "adminPorts": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 65535},
            "default": [SSH_PORT, RDP_PORT],
            "description": "Ports that are never open to the world (SSH, RDP)",
        }
    },
    "required-paths": {
        "efaSelfRules": {
            "type": "boolean",
            "default": True,
            "description": "Require the all-traffic self rules, in and out, on the node SG when EFA is used",
        }
    },
    "efa-placement": {
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
    "node-count": {
        "minNodes": {"type": "integer", "minimum": 1, "default": 2, "description": "Least GPU nodes"}
    },
    "baseline-imdsv2": {},
    "baseline-ebs-encryption": {},
    "baseline-no-public-ip": {},
    "baseline-rule-descriptions": {},
    "baseline-health-check": {},
    "baseline-idle-timeout": {
        "minIdleTimeoutSeconds": {
            "type": "integer",
            "minimum": 1,
            "default": STREAMING_IDLE_FLOOR_SECONDS,
            "description": "Least idle timeout on the load balancer for streamed responses",
        }
    },
    "baseline-selinux": {},
    "stack-config": {},
}
DEFAULTS: dict[str, dict[str, Any]] = {
    name: {key: spec["default"] for key, spec in schema.items() if "default" in spec}
    for name, schema in SCHEMAS.items()
}


def settings(name: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """A policy's config with the schema defaults filled in. Configure delivers it as a protobuf
    Struct, so an integer property (minNodes: 3) arrives as 3.0: integers are made ints again."""
    merged = dict(DEFAULTS[name])
    for key, value in (given or {}).items():
        if key != "enforcementLevel":
            merged[key] = _as_schema_type(SCHEMAS[name].get(key, {}), value)
    return merged


def _as_schema_type(spec: Mapping[str, Any], value: Any) -> Any:
    if spec.get("type") == "integer" and net.integral(value) is not None:
        return net.integral(value)
    if spec.get("type") == "array" and net.is_list(value):
        return [_as_schema_type(spec.get("items", {}), item) for item in value]
    return value


# --- the stack's facts --------------------------------------------------------------------------

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Facts:
    """What the stack intends: its port table, CIDRs and listener. Without a readable stack
    config (`known` false, `unknown_because` says why): the project's default table and listener,
    no CIDRs; the checks that need the real ones are relaxed (see RELAXED_WITHOUT_CONFIG)."""

    ports: tuple[PortEntry, ...]
    listener_ports: tuple[int, ...]
    node_cidrs: tuple[Net, ...] = ()
    monitoring_cidrs: tuple[Net, ...] = ()
    admin_cidrs: tuple[Net, ...] = ()
    stack_floor_gbps: float = 0.0
    efa: bool | None = None
    heads: tuple[str, ...] | None = None  # load-balancer targets by node name
    known: bool = False  # read from the stack config
    unknown_because: str = ""

    @property
    def model_port(self) -> int:
        return next(e.port.low for e in self.ports if e.scope is Scope.CLIENTS)

    def spans(self, scope: Scope) -> list[PortRange]:
        return [entry.port for entry in self.ports if entry.scope is scope]

    def entry_at(self, span: PortRange) -> list[PortEntry]:
        return [entry for entry in self.ports if entry.port.overlaps(span)]


# Why the pack can be without the stack config. The CLI hands a Python pack the stack config as
# PULUMI_CONFIG, which the language host sets from the ConfigureStack call it awaits before starting
# the pack (pulumi/pulumi sdk/python/cmd/pulumi-language-python/main.go RunPlugin, sdk/policy_proxy.go).
# The engine sends ConfigureStack only when it has stack options
# (pkg/resource/plugin/analyzer_plugin.go NewPolicyAnalyzer: `if opts != nil`); `pulumi policy
# analyze` loads packs with none (pkg/cmd/pulumi/policy/policy_analyze.go).
NO_CONFIG = "PULUMI_CONFIG is not set (the engine sent no stack config, as `pulumi policy analyze` does)"
# What is relaxed without the stack config: these checks judge against facts only the config holds.
RELAXED_WITHOUT_CONFIG = (
    "port-exposure: everything but world exposure and all traffic from non-members (the port table, "
    "the node, monitoring and admin CIDRs are unknown)",
    "required-paths: the model port from the load balancer and the host firewall paths of the port "
    "table (the table is unknown)",
    "efa-placement: EFA devices are expected only where the stack declares EFA interfaces "
    "(aws.efa is unknown)",
    "bandwidth-class: only the policy's minBandwidthGbps applies (network.minBandwidthGbps is unknown)",
)


def facts_for(cluster: config.ClusterConfig | None, unknown_because: str = NO_CONFIG) -> Facts:
    if cluster is None:
        return Facts(
            ports=DEFAULT_PORTS,
            listener_ports=(config.LoadBalancer().port,),
            unknown_because=unknown_because,
        )
    return Facts(
        ports=tuple(cluster.ports),
        listener_ports=(cluster.load_balancer.port,),
        node_cidrs=(cluster.network.cidr,),
        monitoring_cidrs=tuple(cluster.access.monitoring_cidrs),
        admin_cidrs=tuple(cluster.access.admin_cidrs),
        stack_floor_gbps=cluster.network.min_bandwidth_gbps,
        efa=bool(cluster.aws.efa) if cluster.aws else None,
        heads=tuple(head.name for head in cluster.topology.heads),
        known=True,
    )


_MISSING = object()
# The offline harness sets the stack it analyzes here (None: no stack config); under the CLI the
# stack config is read from PULUMI_CONFIG.
STACK: contextvars.ContextVar[Any] = contextvars.ContextVar("qwen_cluster_stack", default=_MISSING)


def current_facts() -> Facts:
    cluster = STACK.get()
    if cluster is not _MISSING:
        return facts_for(cluster)
    import pulumi.runtime

    values = dict(pulumi.runtime.config.CONFIG.get() or {})
    values.update(pulumi.runtime.get_config_env())
    present = "PULUMI_CONFIG" in os.environ or bool(values)
    return _facts_from_engine(json.dumps(values, sort_keys=True), present)


@functools.lru_cache(maxsize=8)
def _facts_from_engine(values_json: str, present: bool) -> Facts:
    """The stack config the engine handed over, validated once per distinct config (every
    Analyze call asks for it)."""
    if not present:
        return facts_for(None)
    prefix = f"{config.NAMESPACE}:"
    raw = {
        key[len(prefix) :]: config.decode_value(value)
        for key, value in json.loads(values_json).items()
        if key.startswith(prefix) and key[len(prefix) :] not in config.SECRET_KEYS
    }
    if not raw:
        return facts_for(None, f"PULUMI_CONFIG holds no {prefix} keys")
    try:
        return facts_for(config.validate(raw))
    except ValueError as exc:  # ConfigError lists every problem
        return facts_for(None, f"the stack config in PULUMI_CONFIG is not valid: {exc}")


# --- the stack as an index ----------------------------------------------------------------------


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
        """Security group name -> node / lb / bastion / other."""
        roles: dict[str, str] = {}
        by_tag = {net.NODE_SG: "node", net.LB_SG: "lb", net.BASTION_SG: "bastion"}
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


# --- port exposure ------------------------------------------------------------------------------


def _within(cidr: Net, blocks: tuple[Net, ...]) -> bool:
    """Is every address of `cidr` inside `blocks` taken together? (A host firewall admits its peers
    as aggregated blocks: 192.168.1.102/31 is the hosts .102 and .103.)"""
    same = [block for block in blocks if block.version == cidr.version]
    return any(cidr.subnet_of(block) for block in ipaddress.collapse_addresses(same))  # type: ignore[arg-type]


def _covered(span: PortRange, spans: list[PortRange]) -> bool:
    """Is every port of `span` inside the union of `spans`?"""
    low = span.low
    for other in sorted(spans):
        if other.low <= low <= other.high:
            low = other.high + 1
            if low > span.high:
                return True
    return low > span.high


def _ports(rule: Rule) -> str:
    return (
        "all traffic"
        if rule.ports is None and rule.protocol == "all"
        else (
            f"every {rule.protocol.upper()} port" if rule.ports is None else f"{rule.ports}/{rule.protocol}"
        )
    )


def exposure_problems(
    rule: Rule,
    target: str,
    facts: Facts,
    *,
    peer_role: Callable[[Peer], str],
    admin_ports: tuple[int, ...],
    members: tuple[Net, ...],
    listener_ports: tuple[int, ...],
    listener_here: bool,
) -> list[str]:
    """Why an ingress rule on `target` (node / lb / bastion / other) breaks the port table, if it does.

    `peer_role(peer)` says what a security-group peer is (node / lb / bastion / other); CIDR peers
    are judged here against the node CIDR (members), monitoring, admin CIDRs and the world. The
    nodes take SSH from the bastion's group, so the bastion itself takes SSH from adminCidrs only.

    Without the stack config (`facts.known` false) only what needs none of it is judged: world
    exposure, all traffic from a known non-member, and the bastion's non-SSH rules.
    """
    problems: list[str] = []
    cluster_spans = facts.spans(Scope.CLUSTER)
    monitoring_spans = facts.spans(Scope.MONITORING)
    table_spans = [entry.port for entry in facts.ports]
    model = facts.model_port
    for peer in rule.peers:
        if peer.kind == "unknown":
            continue
        if peer.kind == "cidr":
            world = net.is_world(peer.cidr)
            member = not world and _within(peer.cidr, members)
            role = "world" if world else "node" if member else "cidr"
        elif peer.kind == "self":
            role = target if target in ("lb", "bastion") else "node"
        elif peer.kind == "sg":
            role = peer_role(peer)
        else:
            role = "other"
        if role == "world":
            opened = [port for port in admin_ports if rule.opens(port)]
            if opened:
                problems.append(
                    f"{rule.where} admits {peer}: port {', '.join(map(str, opened))} (SSH/RDP) is never "
                    "open to the world; use access.adminCidrs"
                )
                continue
            listener = (
                listener_here
                and rule.protocol == "tcp"
                and rule.ports is not None
                and rule.ports.low == rule.ports.high
                and rule.ports.low in listener_ports
            )
            if not listener:
                problems.append(
                    f"{rule.where} admits {peer}: only the load balancer listener "
                    f"({', '.join(map(str, listener_ports))}/tcp) may be reached from the world"
                )
            continue
        if target == "bastion":
            ssh_only = rule.protocol == "tcp" and rule.ports == PortRange(SSH_PORT, SSH_PORT)
            if ssh_only and peer.kind == "cidr" and not facts.known:
                continue  # adminCidrs unknown
            if not (ssh_only and peer.kind == "cidr" and _within(peer.cidr, facts.admin_cidrs)):
                problems.append(
                    f"{rule.where} admits {peer} to {_ports(rule)}: the bastion takes SSH "
                    f"{SSH_PORT}/tcp from access.adminCidrs only (the nodes trust whoever reaches it)"
                )
            continue
        if role == "node":
            continue  # members reach every port of every member (the all-traffic rule)
        if not facts.known and ((peer.kind == "cidr" and not members) or not rule.all_traffic):
            continue  # a CIDR may be the node CIDR; ports are judged against the stack's table
        if rule.all_traffic or any(rule.overlaps(span) for span in cluster_spans):
            what = (
                "all traffic"
                if rule.all_traffic
                else ", ".join(
                    f"{entry.name} {entry.port}"
                    for span in cluster_spans
                    if rule.overlaps(span)
                    for entry in facts.entry_at(span)
                )
            )
            problems.append(
                f"{rule.where} admits {peer} to {what}: cluster ports and all-traffic rules are for "
                "members only (the node security group itself or the node CIDR)"
            )
            continue
        if target != "lb" and rule.opens(model) and role != "lb":
            problems.append(
                f"{rule.where} admits {peer} to the model port {model}/tcp: clients reach it only "
                "through the load balancer"
            )
            continue
        in_monitoring = peer.kind == "cidr" and _within(peer.cidr, facts.monitoring_cidrs)
        if any(rule.overlaps(span) for span in monitoring_spans) and not in_monitoring:
            allowed = ", ".join(map(str, facts.monitoring_cidrs)) or "none configured"
            problems.append(
                f"{rule.where} admits {peer} to monitoring {', '.join(map(str, monitoring_spans))}: "
                f"only access.monitoringCidrs ({allowed})"
            )
            continue
        if target == "node" and rule.ports is not None:
            allowed = list(table_spans)
            if listener_here:
                allowed += [PortRange(port, port) for port in listener_ports]
            # SSH: from adminCidrs directly, or (aws.bastion) from the bastion's security group.
            if (peer.kind == "cidr" and _within(peer.cidr, facts.admin_cidrs)) or role == "bastion":
                allowed.append(PortRange(SSH_PORT, SSH_PORT))
            if not _covered(rule.ports, allowed):
                problems.append(
                    f"{rule.where} admits {peer} to {rule.ports}/{rule.protocol}, which the port table "
                    "does not list (SSH only from access.adminCidrs or the bastion's security group)"
                )
        elif target == "node" and rule.ports is None:
            problems.append(f"{rule.where} admits {peer} to {_ports(rule)}: the port table lists the ports")
    return problems


def _validate_port_exposure(args: StackValidationArgs, report: ReportViolation) -> None:
    cfg = settings("port-exposure", args.get_config())
    facts = current_facts()
    stack = Stack(args.resources)
    roles = stack.group_roles()
    firewalls = stack.host_firewalls()
    members = facts.node_cidrs
    if not members and firewalls:
        # No stack config: the hosts' own addresses are the members.
        members = tuple(
            ipaddress.ip_network(doc.address) for _, doc in firewalls if net.network(doc.address) is not None
        )
    admin_ports = tuple(cfg["adminPorts"])
    listener_ports = facts.listener_ports
    if not facts.known:
        # No stack config: the listeners the stack declares are the ones the world may reach.
        declared = {net.integral(get(r.props, "port")) for r in stack.of_type(net.LISTENER)}
        listener_ports = tuple(sorted(p for p in declared if p is not None)) or listener_ports
    docs = {(r.name, doc.host): doc for r, doc in firewalls}
    for rule in stack.rules():
        if rule.direction != "ingress":
            continue
        if rule.host is not None:
            # A host is a node; the load-balancer host also serves the listener.
            doc = docs.get((rule.resource, rule.host))
            target = "node"
            listener_here = doc is not None and doc.load_balancer
            listeners = (doc.listener_port,) if doc is not None and doc.listener_port else listener_ports
        else:
            target = roles.get(rule.group or "", "other")
            listener_here = target == "lb"
            listeners = listener_ports
        problems = exposure_problems(
            rule,
            target,
            facts,
            peer_role=lambda peer: roles.get(peer.ref, "other"),
            admin_ports=admin_ports,
            members=members,
            listener_ports=listeners,
            listener_here=listener_here,
        )
        owner = stack.by_name.get(rule.resource)
        for problem in problems:
            report(problem, owner.urn if owner is not None else None)


# --- required paths -----------------------------------------------------------------------------


def _efa_interfaces(stack: Stack, node: PolicyResource) -> int:
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


def _efa_in_use(stack: Stack, facts: Facts) -> bool:
    if facts.efa is not None:
        return facts.efa
    return any(_efa_interfaces(stack, node) for node in stack.gpu_nodes())


def _validate_required_paths(args: StackValidationArgs, report: ReportViolation) -> None:
    cfg = settings("required-paths", args.get_config())
    facts = current_facts()
    stack = Stack(args.resources)
    roles = stack.group_roles()
    rules = stack.rules()
    model = facts.model_port
    node_groups = sorted(name for name, role in roles.items() if role == "node" and name in stack.by_name)
    lb_groups = {name for name, role in roles.items() if role == "lb"}
    target_groups = stack.of_type(net.TARGET_GROUP)

    def admits_model_from_lb(group: str) -> bool:
        return any(
            r.direction == "ingress"
            and r.group == group
            and r.opens(model)
            and any(p.kind == "sg" and p.ref in lb_groups for p in r.peers)
            for r in rules
        )

    if target_groups or lb_groups:
        for group in stack.of_type(net.TARGET_GROUP):
            port = net.integral(get(group.props, "port"))
            if facts.known and port is not None and port != model:
                report(
                    f"target group {group.name} forwards to port {port}; the model listens on {model}",
                    group.urn,
                )
        if not lb_groups:
            report(
                f"no security group tagged {net.ROLE_TAG}={net.LB_SG}: no load balancer path to "
                + (f"{model}" if facts.known else "the model port")
            )
        instances = {n.name: n for n in stack.gpu_nodes() if n.resource_type == net.INSTANCE}
        targets: list[PolicyResource] = []
        for attachment in stack.of_type(net.TARGET_GROUP_ATTACHMENT):
            found = stack.resolve(attachment, "targetId", get(attachment.props, "targetId"), (net.INSTANCE,))
            if found in instances:
                targets.append(instances[found])
            port = net.integral(get(attachment.props, "port"))
            if facts.known and port is not None and port != model:
                report(
                    f"{attachment.name} registers port {port}; the model service listens on {model}",
                    attachment.urn,
                )
        # The model port comes from the stack's port table: without it, the path is not judged.
        for target in (targets or list(instances.values())) if facts.known else []:
            groups = stack.groups_of(target) or set(node_groups)
            if lb_groups and not any(admits_model_from_lb(g) for g in groups):
                report(
                    f"{target.name}: no security group of it ({', '.join(sorted(groups)) or 'none'}) admits "
                    f"{model}/tcp from the load balancer security group",
                    target.urn,
                )
        if not instances and lb_groups and facts.known:
            for group in node_groups:
                if not admits_model_from_lb(group):
                    owner = stack.by_name[group]
                    report(
                        f"{group} does not admit {model}/tcp from the load balancer security group", owner.urn
                    )

    if cfg["efaSelfRules"] and node_groups and _efa_in_use(stack, facts):
        for group in node_groups:
            for direction in ("ingress", "egress"):
                if not any(
                    r.group == group
                    and r.direction == direction
                    and r.all_traffic
                    and any(p.kind == "self" for p in r.peers)
                    for r in rules
                ):
                    report(
                        f"{group} lacks the all-traffic {direction} rule referencing itself; EFA needs "
                        "all traffic between members of the node security group, in and out",
                        stack.by_name[group].urn,
                    )

    firewalls = stack.host_firewalls()
    if firewalls:
        lb_hosts = [doc for _, doc in firewalls if doc.load_balancer]
        if not lb_hosts:
            report("no host firewall is marked loadBalancer: nothing reaches the model service")
        lb_nets = [net.network(doc.address) for doc in lb_hosts if net.network(doc.address) is not None]
        addresses = {doc.host: net.network(doc.address) for _, doc in firewalls}
        cluster_spans = facts.spans(Scope.CLUSTER)
        # The paths of the port table: without the stack config, the table is not known.
        for resource, doc in firewalls if facts.known else []:
            inbound = [r for r in doc.rules if r.direction == "ingress"]

            def reaches(source: Net, port_check: Callable[[net.FirewallRule], bool], rules=inbound) -> bool:
                return any(
                    port_check(r)
                    and any(source.version == s.version and source.subnet_of(s) for s in r.sources)
                    for r in rules
                )

            # The load-balancer host reaches its own model server over loopback.
            is_target = (facts.heads is None or doc.host in facts.heads) and not doc.load_balancer
            opens_model = lambda r: r.protocol in ("all", "tcp") and (r.ports is None or model in r.ports)  # noqa: E731
            if is_target:
                for source in lb_nets:
                    if not reaches(source, opens_model):
                        report(
                            f"{doc.host}: the firewall does not admit {model}/tcp from the load balancer "
                            f"{source}",
                            resource.urn,
                        )
            for other, source in addresses.items():
                if other == doc.host or source is None:
                    continue
                for span in cluster_spans:

                    def opens_span(r, span=span):
                        return r.protocol in ("all", "tcp") and (
                            r.ports is None or (r.ports.low <= span.low and span.high <= r.ports.high)
                        )

                    if not reaches(source, opens_span):
                        report(
                            f"{doc.host}: the firewall does not admit {span}/tcp from node {other}",
                            resource.urn,
                        )


# --- EFA and placement --------------------------------------------------------------------------


def _validate_efa_placement(args: StackValidationArgs, report: ReportViolation) -> None:
    cfg = settings("efa-placement", args.get_config())
    facts = current_facts()
    stack = Stack(args.resources)
    nodes = stack.gpu_nodes()
    strategy = cfg["placementStrategy"]
    subnets: dict[str, set[str]] = {}
    zones: dict[str, set[str]] = {}
    launched = {id(t) for other in nodes if (t := stack.launch_template_of(other)) is not None}
    efa_in_use = _efa_in_use(stack, facts)
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
        wanted = cfg["efa"]
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
            have = _efa_interfaces(stack, node)
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


# --- node count ---------------------------------------------------------------------------------


def _validate_node_count(args: StackValidationArgs, report: ReportViolation) -> None:
    cfg = settings("node-count", args.get_config())
    stack = Stack(args.resources)
    counted = [(n.name, net.node_count(n.resource_type, n.props)) for n in stack.gpu_nodes()]
    counted += [(doc.host, 1) for _, doc in stack.host_firewalls() if doc.role == net.GPU_NODE]
    total = sum(count for _, count in counted)
    if total < cfg["minNodes"]:
        listed = ", ".join(name for name, count in counted if count) or "none"
        report(
            f"{total} GPU node(s) ({listed}); the cluster needs at least {cfg['minNodes']} "
            "(4 or more recommended)"
        )


# --- resource policies --------------------------------------------------------------------------


def _validate_bandwidth(args: ResourceValidationArgs, report: ReportViolation) -> None:
    cfg = settings("bandwidth-class", args.get_config())
    facts = current_facts()
    floor = max(float(cfg["minBandwidthGbps"]), facts.stack_floor_gbps)
    source = (
        "network.minBandwidthGbps"
        if facts.stack_floor_gbps > float(cfg["minBandwidthGbps"])
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


def _launched_from_template(props: Any) -> bool:
    return isinstance(get(props, "launchTemplate"), Mapping)


def _validate_imdsv2(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type not in (net.INSTANCE, net.LAUNCH_TEMPLATE):
        return
    tokens = get(args.props, "metadataOptions", "httpTokens")
    if tokens is None and args.resource_type == net.INSTANCE and _launched_from_template(args.props):
        return  # the launch template's own options apply (and are checked there)
    if tokens is UNKNOWN:
        return
    if tokens != "required":
        report(
            f"metadataOptions.httpTokens is {tokens or 'unset (IMDSv1 allowed)'}; set it to required (IMDSv2)"
        )
    if str(get(args.props, "metadataOptions", "httpEndpoint", default="enabled")) == "disabled":
        return


def _validate_ebs(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type == net.INSTANCE:
        root = get(args.props, "rootBlockDevice")
        if root is None and not _launched_from_template(args.props):
            report(
                "rootBlockDevice is not declared, so the root volume is not encrypted; set encrypted: true"
            )
        elif root is not None and net.truthy(get(root, "encrypted")) is not True:
            report("rootBlockDevice.encrypted is not true")
        for index, device in enumerate(items(args.props, "ebsBlockDevices")):
            if net.truthy(get(device, "encrypted")) is not True:
                report(
                    f"ebsBlockDevices[{index}] ({get(device, 'deviceName', default='?')}) is not encrypted"
                )
    elif args.resource_type == net.LAUNCH_TEMPLATE:
        mappings = [m for m in items(args.props, "blockDeviceMappings") if get(m, "ebs") is not None]
        if not mappings:
            report("blockDeviceMappings declares no EBS volume, so the root volume is not encrypted")
        for index, mapping in enumerate(mappings):
            if net.truthy(get(mapping, "ebs", "encrypted")) is not True:
                report(
                    f"blockDeviceMappings[{index}] ({get(mapping, 'deviceName', default='?')}) "
                    "is not encrypted"
                )
    elif (
        args.resource_type == "aws:ebs/volume:Volume" and net.truthy(get(args.props, "encrypted")) is not True
    ):
        report("the volume is not encrypted")


def _validate_public_ip(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not net.is_gpu_node(args.resource_type, args.props):
        return
    if net.truthy(get(args.props, "associatePublicIpAddress")):
        report("associatePublicIpAddress is true on a GPU node; nodes are reached through the load balancer")
    for index, entry in enumerate(items(args.props, "networkInterfaces")):
        if net.truthy(get(entry, "associatePublicIpAddress")):
            report(f"networkInterfaces[{index}].associatePublicIpAddress is true on a GPU node")


def _validate_descriptions(args: ResourceValidationArgs, report: ReportViolation) -> None:
    for rule in net.rules_of(args.resource_type, args.name, args.props):
        if not rule.description.strip():
            report(f"{rule.where} has no description; say who needs it and why")
    if args.resource_type == net.REMOTE_COMMAND:
        for doc in net.firewall_documents(args.props):
            for problem in doc.problems:
                report(f"host {doc.host} firewall {problem}")


def _validate_health_check(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != net.TARGET_GROUP:
        return
    check = get(args.props, "healthCheck")
    if check is None:
        report("the target group declares no healthCheck; a dead model server would keep receiving requests")
    elif net.truthy(get(check, "enabled")) is False:
        report("healthCheck.enabled is false; a dead model server would keep receiving requests")


_NGINX_TIMEOUT = re.compile(r"\b(proxy_read_timeout|proxy_send_timeout)\s+(\d+)\s*(ms|s|m|h|d)?\s*;")
_UNIT_SECONDS = {None: 1, "s": 1, "ms": 0.001, "m": 60, "h": 3600, "d": 86400}


def _validate_idle_timeout(args: ResourceValidationArgs, report: ReportViolation) -> None:
    floor = settings("baseline-idle-timeout", args.get_config())["minIdleTimeoutSeconds"]
    if args.resource_type == net.LISTENER:
        protocol = str(get(args.props, "protocol", default="")).upper()
        if protocol in ("TCP", "TLS", "TCP_UDP"):
            value = net.number(get(args.props, "tcpIdleTimeoutSeconds", default=NLB_DEFAULT_IDLE_SECONDS))
            if value is not None and value < floor:
                report(
                    f"tcpIdleTimeoutSeconds {value:g} is below {floor} s: "
                    "a silent, thinking answer is cut off"
                )
    elif args.resource_type == net.LOAD_BALANCER:
        if str(get(args.props, "loadBalancerType", default="application")) == "application":
            value = net.number(get(args.props, "idleTimeout", default=ALB_DEFAULT_IDLE_SECONDS))
            if value is not None and value < floor:
                report(f"idleTimeout {value:g} is below {floor} s: a silent, thinking answer is cut off")
    else:
        for where, text in net.texts_of(args.resource_type, args.props):
            # Per directive, the longest value in the text: the one on the model's streams. A
            # short one on another location (a health check) cuts no answer. The bare-metal
            # load balancer's config travels in a command script (its install step).
            longest: dict[str, tuple[float, re.Match[str]]] = {}
            for match in _NGINX_TIMEOUT.finditer(text):
                seconds = int(match.group(2)) * _UNIT_SECONDS[match.group(3)]
                if seconds >= longest.get(match.group(1), (-1.0, match))[0]:
                    longest[match.group(1)] = (seconds, match)
            for seconds, match in longest.values():
                if seconds < floor:
                    report(
                        f"{where}: nginx {match.group(1)} {match.group(2)}{match.group(3) or ''} "
                        f"is below {floor} s"
                    )


def _validate_selinux(args: ResourceValidationArgs, report: ReportViolation) -> None:
    for where, text in net.texts_of(args.resource_type, args.props):
        match = net.SELINUX_OFF.search(text)
        if match:
            report(
                f"{where} runs {match.group(0)!r}: SELinux stays enforcing (write a policy module instead)"
            )


# --- without the stack config -------------------------------------------------------------------


def _validate_stack_config(args: StackValidationArgs, report: ReportViolation) -> None:
    """Once per stack: without the stack config, which checks were relaxed (an advisory, so a
    pack started without PULUMI_CONFIG never fails a stack on facts it cannot know)."""
    facts = current_facts()
    if facts.known:
        return
    report(
        f"No stack config: {facts.unknown_because}. Relaxed, so they cannot fail the stack: "
        + "; ".join(RELAXED_WITHOUT_CONFIG)
        + ". World exposure, the EFA self rules and the baseline are enforced as always."
    )


# --- the pack -----------------------------------------------------------------------------------

MANDATORY = EnforcementLevel.MANDATORY
ADVISORY = EnforcementLevel.ADVISORY


def _schema(name: str) -> PolicyConfigSchema:
    return PolicyConfigSchema(properties=SCHEMAS[name])


POLICIES: list[ResourceValidationPolicy | StackValidationPolicy] = [
    ResourceValidationPolicy(
        name="bandwidth-class",
        description="Every GPU node has a baseline bandwidth of at least minBandwidthGbps "
        "(default 10 Gbit/s).",
        validate=_validate_bandwidth,
        enforcement_level=MANDATORY,
        config_schema=_schema("bandwidth-class"),
        severity=Severity.HIGH,
        remediation_steps="Pick an instance type from qwen_cluster/catalog.py whose baseline meets the floor "
        "(g6e.12xlarge: 100 Gbit/s); on bare metal use NICs of at least the floor and declare nicSpeedGbps. "
        "A type missing from the catalog must be added there with AWS's published figures.",
    ),
    StackValidationPolicy(
        name="port-exposure",
        description="Ingress follows the port table: world only to the LB listener, cluster ports and "
        "all-traffic only from members, the model port only from the LB, monitoring only from its CIDRs, "
        "SSH/RDP never from the world.",
        validate=_validate_port_exposure,
        enforcement_level=MANDATORY,
        config_schema=_schema("port-exposure"),
        severity=Severity.CRITICAL,
        remediation_steps="Remove the rule or narrow its source: members via the node security group's self "
        "reference (or the node CIDR on bare metal), the model port via the load balancer's security group, "
        "monitoring via access.monitoringCidrs, SSH via access.adminCidrs.",
    ),
    StackValidationPolicy(
        name="required-paths",
        description="The model port is reachable from the load balancer on every target; with EFA the node "
        "security group has all-traffic self rules in both directions.",
        validate=_validate_required_paths,
        enforcement_level=MANDATORY,
        config_schema=_schema("required-paths"),
        severity=Severity.HIGH,
        remediation_steps="Add an ingress rule on the node security group for the model port referencing the "
        "load balancer's security group; with EFA add ipProtocol -1 ingress and egress rules referencing the "
        "node security group itself.",
    ),
    StackValidationPolicy(
        name="efa-placement",
        description="GPU nodes sit in a placement group with strategy cluster, in one subnet and AZ, with "
        "one EFA device per network card when EFA is configured.",
        validate=_validate_efa_placement,
        enforcement_level=MANDATORY,
        config_schema=_schema("efa-placement"),
        severity=Severity.HIGH,
        remediation_steps="Create an aws.ec2.PlacementGroup with strategy cluster and put every GPU node "
        "in it; "
        "use one subnet; give the launch template the interfaces catalog.interface_layout() lists.",
    ),
    StackValidationPolicy(
        name="node-count",
        description="The cluster has at least minNodes GPU nodes (default 2).",
        validate=_validate_node_count,
        enforcement_level=MANDATORY,
        config_schema=_schema("node-count"),
        severity=Severity.MEDIUM,
        remediation_steps="List at least two nodes in qwen-cluster:nodes (four or more recommended).",
    ),
    ResourceValidationPolicy(
        name="baseline-imdsv2",
        description="Instances and launch templates require IMDSv2 (metadataOptions.httpTokens = required).",
        validate=_validate_imdsv2,
        enforcement_level=MANDATORY,
        config_schema=_schema("baseline-imdsv2"),
        severity=Severity.HIGH,
        remediation_steps="Set metadata_options={'http_tokens': 'required'} (hop limit 2 for containers).",
    ),
    ResourceValidationPolicy(
        name="baseline-ebs-encryption",
        description="EBS volumes of instances and launch templates are encrypted.",
        validate=_validate_ebs,
        enforcement_level=MANDATORY,
        config_schema=_schema("baseline-ebs-encryption"),
        severity=Severity.HIGH,
        remediation_steps="Declare root_block_device / block_device_mappings with encrypted=True.",
    ),
    ResourceValidationPolicy(
        name="baseline-no-public-ip",
        description="GPU nodes have no public IP address.",
        validate=_validate_public_ip,
        enforcement_level=MANDATORY,
        config_schema=_schema("baseline-no-public-ip"),
        severity=Severity.HIGH,
        remediation_steps="Set associate_public_ip_address=False; clients reach the model through the load "
        "balancer, admins through the bastion.",
    ),
    ResourceValidationPolicy(
        name="baseline-rule-descriptions",
        description="Every security-group and host-firewall rule has a description.",
        validate=_validate_descriptions,
        enforcement_level=MANDATORY,
        config_schema=_schema("baseline-rule-descriptions"),
        severity=Severity.LOW,
        remediation_steps="Give the rule a description naming its port-table entry and its peer.",
    ),
    ResourceValidationPolicy(
        name="baseline-health-check",
        description="Load balancer target groups declare an enabled health check.",
        validate=_validate_health_check,
        enforcement_level=MANDATORY,
        config_schema=_schema("baseline-health-check"),
        severity=Severity.MEDIUM,
        remediation_steps="Set health_check={'enabled': True, 'protocol': 'HTTP', 'path': '/health', 'port': "
        "'traffic-port'} on the target group.",
    ),
    ResourceValidationPolicy(
        name="baseline-idle-timeout",
        description="The load balancer's idle timeout is long enough for streamed, thinking-mode answers.",
        validate=_validate_idle_timeout,
        enforcement_level=ADVISORY,
        config_schema=_schema("baseline-idle-timeout"),
        severity=Severity.LOW,
        remediation_steps="Raise loadBalancer.idleTimeoutSeconds (NLB tcp_idle_timeout_seconds up to 6000; "
        "nginx proxy_read_timeout / proxy_send_timeout).",
    ),
    ResourceValidationPolicy(
        name="baseline-selinux",
        description="No command or user data disables SELinux.",
        validate=_validate_selinux,
        enforcement_level=MANDATORY,
        config_schema=_schema("baseline-selinux"),
        severity=Severity.HIGH,
        remediation_steps="Keep SELinux enforcing; label what needs access (semanage, a policy module) "
        "instead of setenforce 0.",
    ),
    StackValidationPolicy(
        name="stack-config",
        description="The pack judges against the stack's own config; without it (PULUMI_CONFIG unset) "
        "the checks that need it are relaxed, and this says which.",
        validate=_validate_stack_config,
        enforcement_level=ADVISORY,
        config_schema=_schema("stack-config"),
        severity=Severity.LOW,
        remediation_steps="Run the pack with the stack: `pulumi preview --policy-pack policies` (the "
        "engine then hands the pack the stack config), not `pulumi policy analyze` alone.",
    ),
]
