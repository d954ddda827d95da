"""port-exposure: ingress follows the port table (who may reach which port of which role), on
security groups and on bare-metal host firewalls alike.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections import defaultdict
from collections.abc import Callable

from pulumi_policy import ReportViolation, Severity, StackValidationArgs

from policies import normalized as net
from policies.declaration import MANDATORY, Settings, stack_policy
from policies.facts import Facts, Net, current_facts
from policies.normalized import Peer, Rule, get
from policies.stack import Stack
from qwen_cluster import world
from qwen_cluster.ports import SSH_PORT, PortRange, Scope

RDP_PORT = 3389


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


EVERY_PORT = PortRange(0, 65535)


def _target_of(rule: Rule) -> tuple | None:
    """What a rule opens: a host's firewall or a security group (None: not known, judged alone)."""
    if rule.host is not None:
        return ("host", rule.resource, rule.host)
    return ("group", rule.group) if rule.group else None


def _intervals(spans: list[PortRange]) -> list[PortRange]:
    """The elementary port intervals the spans' bounds cut 0-65535 into (each inside or outside
    every span)."""
    cuts = sorted({0, 65536, *(span.low for span in spans), *(span.high + 1 for span in spans)})
    return [PortRange(low, high - 1) for low, high in zip(cuts, cuts[1:], strict=False) if low < high]


@functools.lru_cache(maxsize=4096)
def _worlds(cidrs: frozenset) -> tuple:
    """world.worlds, remembered: the hosts of a bare-metal stack share their member lists."""
    return tuple(world.worlds(cidrs))


def split_world(rules: list[Rule]) -> list[Rule]:
    """Ingress rules that open the world only together: for each rule that takes part, the same
    rule narrowed to the ports and protocol the world reaches through it, its peer the world with
    the parts named (Peer.ref). Rules of one target (a security group, a host's firewall) and
    protocol are taken together; a block that is the world by itself is judged as it is, so a
    port reached that way is not reported twice. One spelling for every form: inline rules,
    SecurityGroupRule and VpcSecurityGroupIngressRule resources, host-firewall entries."""
    by_target: dict[tuple, list[Rule]] = defaultdict(list)
    for rule in rules:
        target = _target_of(rule)
        judged = rule.direction == "ingress" and rule.protocol in ("tcp", "udp", "all")
        if judged and target is not None and any(peer.kind == "cidr" for peer in rule.peers):
            by_target[target].append(rule)
    # (rule identity, family) -> protocol -> the ports the world reaches through it
    reached: dict[tuple[int, ipaddress.IPv4Network | ipaddress.IPv6Network], dict[str, list[PortRange]]] = {}
    parts: dict[tuple[int, ipaddress.IPv4Network | ipaddress.IPv6Network], set[str]] = defaultdict(set)
    rule_of: dict[int, Rule] = {}
    for group in by_target.values():
        for protocol in ("tcp", "udp"):
            same = [rule for rule in group if rule.protocol in (protocol, "all")]
            for interval in _intervals([rule.ports or EVERY_PORT for rule in same]):
                covering = [rule for rule in same if (rule.ports or EVERY_PORT).overlaps(interval)]
                cidrs = [peer.cidr for rule in covering for peer in rule.peers if peer.cidr is not None]
                for every in _worlds(frozenset(cidrs)):
                    blocks = [cidr for cidr in cidrs if cidr.version == every.version]
                    if any(world.is_world(cidr) for cidr in blocks):
                        continue  # judged as it is
                    named = " + ".join(
                        f"{peer.cidr} ({rule.resource})"
                        for rule in covering
                        for peer in rule.peers
                        if peer.cidr is not None and peer.cidr.version == every.version
                    )
                    for rule in covering:
                        if any(p.cidr is not None and p.cidr.version == every.version for p in rule.peers):
                            rule_of[id(rule)] = rule
                            spans = reached.setdefault((id(rule), every), {}).setdefault(protocol, [])
                            if spans and spans[-1].high + 1 == interval.low:
                                spans[-1] = PortRange(spans[-1].low, interval.high)
                            else:
                                spans.append(interval)
                            parts[(id(rule), every)].add(named)
    narrowed: list[Rule] = []
    for (key, every), by_protocol in reached.items():
        rule = rule_of[key]
        peer = Peer("cidr", every, ref=" | ".join(sorted(parts[(key, every)])))
        if rule.protocol == "all" and by_protocol.get("tcp") == by_protocol.get("udp"):
            by_protocol = {"all": by_protocol["tcp"]}
        for protocol, spans in by_protocol.items():
            for span in spans:
                ports = None if span == EVERY_PORT else span
                narrowed.append(dataclasses.replace(rule, protocol=protocol, ports=ports, peers=(peer,)))
    return narrowed


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
    single_node_here: str | None = None,
) -> list[str]:
    """Why an ingress rule on `target` (node / lb / bastion / other) breaks the port table, if it does.

    `peer_role(peer)` says what a security-group peer is (node / lb / bastion / other); CIDR peers
    are judged here against the node CIDR (members), monitoring, admin CIDRs and the world. The
    nodes take SSH from the bastion's group, so the bastion itself takes SSH from adminCidrs only.

    `single_node_here`: on a node target, what the rule's place is when it is not
    `monitoring.node` ("the group of every node", "host worker-1"); None where it is. The
    Prometheus and Alertmanager rows run there only, so elsewhere their ports are refused: anything
    that later listened on them on a worker would be reachable.

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
        if target == "node" and single_node_here is not None and facts.monitoring_node is not None:
            wrong = [entry for entry in facts.single_node_rows() if rule.overlaps(entry.port)]
            if wrong:
                rows = ", ".join(f"{entry.name} {entry.port}" for entry in wrong)
                problems.append(
                    f"{rule.where} admits {peer} to {_ports(rule)}: {rows} runs on "
                    f"{facts.monitoring_node} only (monitoring.node); {single_node_here} admits it"
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


@stack_policy(
    name="port-exposure",
    description="Ingress follows the port table: world only to the LB listener, cluster ports and "
    "all-traffic only from members, the model port only from the LB, monitoring only from its CIDRs, "
    "SSH/RDP never from the world.",
    enforcement_level=MANDATORY,
    severity=Severity.CRITICAL,
    remediation_steps="Remove the rule or narrow its source: members via the node security group's self "
    "reference (or the node CIDR on bare metal), the model port via the load balancer's security group, "
    "monitoring via access.monitoringCidrs, SSH via access.adminCidrs.",
    config_schema={
        "adminPorts": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 65535},
            "default": [SSH_PORT, RDP_PORT],
            "description": "Ports that are never open to the world (SSH, RDP)",
        }
    },
)
def port_exposure(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
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
    admin_ports = tuple(settings["adminPorts"])
    listener_ports = facts.listener_ports
    if not facts.known:
        # No stack config: the listeners the stack declares are the ones the world may reach.
        declared = {net.integral(get(r.props, "port")) for r in stack.of_type(net.LISTENER)}
        listener_ports = tuple(sorted(p for p in declared if p is not None)) or listener_ports
    docs = {(r.name, doc.host): doc for r, doc in firewalls}
    rules = stack.rules()
    for rule in rules + split_world(rules):
        if rule.direction != "ingress":
            continue
        if rule.host is not None:
            # A host is a node; the load-balancer host also serves the listener.
            doc = docs.get((rule.resource, rule.host))
            target = "node"
            single_node_here = None if rule.host == facts.monitoring_node else f"host {rule.host}"
            listener_here = doc is not None and doc.load_balancer
            listeners = (doc.listener_port,) if doc is not None and doc.listener_port else listener_ports
        else:
            target = roles.get(rule.group or "", "other")
            # The monitoring node's own group is a node's, and the one place for its services.
            single_node_here = "the group of every node" if target == "node" else None
            target = "node" if target == "monitoring-node" else target
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
            single_node_here=single_node_here,
        )
        owner = stack.by_name.get(rule.resource)
        for problem in problems:
            report(problem, owner.urn if owner is not None else None)
