"""What the lab builds for a stack, as plain data: namespaces, addresses, expectations.

Pure (no `ip`, no root): the same plan is unit-tested, printed and executed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from qwen_cluster import config
from qwen_cluster import ports as port_table
from qwen_cluster.config import ClusterConfig, ConfigError
from qwen_cluster.ports import Vantage

PREFIX = "qcl-"
# Where the lab keeps logs, pid files and rendered files of running labs (not /etc).
STATE_ROOT = "/run/qwen-cluster-lab"
# The lab's image registry (labkit/hosts/registry.py): an address on the switch's bridge that no stack
# uses (link-local), port 80 so that a daemon falling back from HTTPS for an insecure registry
# (nvcr.io, mapped here) finds it. Not a member: no probe or scan of the stack reaches it.
REGISTRY_IP = "169.254.77.1"
REGISTRY_PORT = 80
# The interface every member namespace sees; the switch side is named per member.
MEMBER_IF = "eth0"
BRIDGE = "br0"
# Addresses tried, in order, for the outsider: documentation and shared ranges first.
_OUTSIDER_CANDIDATES = ("198.51.100.7", "100.64.0.7", "172.31.255.7", "192.0.2.7", "11.0.0.7")
# Vantage namespaces and the CIDR sets their address is picked from.
VANTAGES = (Vantage.CLIENT, Vantage.MONITORING, Vantage.ADMIN, Vantage.OUTSIDER, Vantage.INTRUDER)


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Member:
    """One namespace on the lab switch: a node or a vantage point."""

    namespace: str
    ip: str
    prefixlen: int  # nodes get the segment's prefix; vantages a /32 with on-link routes
    switch_port: str  # the veth end in the switch namespace
    node: str | None = None  # node name, None for a vantage
    vantage: Vantage | None = None
    roles: tuple[Vantage, ...] = ()  # the CIDR sets this address falls in (client, monitoring, admin)


@dataclass(frozen=True)
class ProbeExpectation:
    vantage: str  # a node name or a vantage name
    source: str  # namespace
    target_node: str
    target_ip: str
    name: str
    port: int
    open: bool
    why: str


@dataclass(frozen=True)
class LabPlan:
    label: str
    cluster: ClusterConfig
    switch: str
    nodes: tuple[Member, ...]
    vantages: tuple[Member, ...]
    load_balancer: Member
    heads: tuple[Member, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The stack file's `config:` map the cluster came from (None: built from a ClusterConfig);
    # the lab renders the program from it.
    stack_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def members(self) -> tuple[Member, ...]:
        return self.nodes + self.vantages

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.switch, *(member.namespace for member in self.members))

    @property
    def state_dir(self) -> str:
        return f"{STATE_ROOT}/{self.label}"

    def node(self, name: str) -> Member:
        return next(member for member in self.nodes if member.node == name)

    def vantage(self, vantage: Vantage) -> Member:
        return next(member for member in self.vantages if member.vantage is vantage)

    def probe_ports(self, node: str) -> list[int]:
        """Every port a probe connects to on `node`: listeners must exist there so that
        "open" means the firewall let the connection through, not that nothing refused it."""
        wanted = {exp.port for exp in self.expectations() if exp.target_node == node}
        return sorted(wanted)

    def expectations(self) -> list[ProbeExpectation]:
        return expectations(self)


def namespace_prefix(label: str) -> str:
    return f"{PREFIX}{label}-"


def with_node_count(cluster: ClusterConfig, count: int) -> ClusterConfig:
    """The same stack with `count` nodes: extra workers take the next free addresses of the
    segment, fewer keeps the master and the first workers. Validated like a stack file."""
    if count < 1:
        raise PlanError(f"--nodes {count}: give a positive node count")
    raw: dict[str, Any] = cluster.model_dump(by_alias=True, mode="json", exclude_none=True)
    nodes = sorted(raw["nodes"], key=lambda node: node.get("role") != "master")
    if count <= len(nodes):
        nodes = nodes[:count]
    else:
        used = {node["ip"] for node in nodes} | {node["name"] for node in nodes}
        segment = cluster.network.cidr
        # Continue after the highest node address (101, 102, 103 -> 104), then wrap around.
        hosts = [str(host) for host in segment.hosts()]
        last = max(hosts.index(node["ip"]) for node in nodes if node["ip"] in hosts)
        free = (ip for ip in hosts[last + 1 :] + hosts[: last + 1] if ip not in used)
        index = 1
        while len(nodes) < count:
            while f"worker-{index}" in used:
                index += 1
            ip = next(free, None)
            if ip is None:
                raise PlanError(f"--nodes {count}: network.cidr {segment} has no free address left")
            nodes.append({"name": f"worker-{index}", "ip": ip, "role": "worker"})
            used |= {ip, f"worker-{index}"}
    raw["nodes"] = nodes
    if raw.get("bareMetal", {}).get("hostKeys"):
        # Pins of nodes that left go with them; new nodes get theirs from the lab (substitutions).
        names = {node["name"] for node in nodes}
        raw["bareMetal"]["hostKeys"] = {k: v for k, v in raw["bareMetal"]["hostKeys"].items() if k in names}
    return config.validate(raw)


def _networks(cidrs) -> list[ipaddress.IPv4Network]:
    return [cidr for cidr in cidrs if cidr.version == 4]


def _first_host(networks, avoid: list, taken: set[str]) -> str | None:
    """The first usable address of `networks` outside every network in `avoid`."""
    for network in networks:
        hosts = [network.network_address] if network.prefixlen == 32 else network.hosts()
        for count, host in enumerate(hosts):
            if count > 4096:
                break
            if str(host) in taken or any(host in other for other in avoid):
                continue
            return str(host)
    return None


def _roles(ip: str, cluster: ClusterConfig) -> tuple[Vantage, ...]:
    address = ipaddress.ip_address(ip)
    access = cluster.access
    found = []
    for vantage, cidrs in (
        (Vantage.CLIENT, access.client_cidrs),
        (Vantage.MONITORING, access.monitoring_cidrs),
        (Vantage.ADMIN, access.admin_cidrs),
    ):
        if any(address in cidr for cidr in _networks(cidrs)):
            found.append(vantage)
    return tuple(found)


def build(cluster: ClusterConfig, label: str, *, stack_config: dict[str, Any] | None = None) -> LabPlan:
    """The lab for a validated bare-metal stack."""
    if cluster.bare_metal is None:
        raise PlanError(
            f"the lab rehearses bare-metal stacks (host firewall + nginx); target {cluster.target.value} "
            "uses security groups and a managed load balancer"
        )
    if cluster.bare_metal.firewall == "firewalld":
        raise PlanError(
            "bareMetal.firewall firewalld needs a D-Bus system daemon; the lab runs ufw and nftables"
        )
    if not label or len(label) > 24 or not all(ch.isalnum() or ch == "-" for ch in label):
        raise PlanError(f"lab label {label!r}: use up to 24 letters, digits or dashes")
    prefix = namespace_prefix(label)
    segment = cluster.network.cidr
    access = cluster.access
    node_ips = {str(node.ip) for node in cluster.nodes}
    nodes = tuple(
        Member(
            namespace=f"{prefix}node-{node.name}",
            ip=str(node.ip),
            prefixlen=segment.prefixlen,
            switch_port=f"n{index}",
            node=node.name,
        )
        for index, node in enumerate(cluster.nodes)
    )
    taken = set(node_ips)
    everyone = [
        segment,
        *_networks(access.client_cidrs),
        *_networks(access.monitoring_cidrs),
        *_networks(access.admin_cidrs),
    ]
    notes: list[str] = []
    picks: dict[Vantage, str | None] = {}
    clients = _networks(access.client_cidrs)
    others = [segment, *_networks(access.monitoring_cidrs), *_networks(access.admin_cidrs)]
    picks[Vantage.CLIENT] = _first_host(clients, others, taken) or _first_host(clients, [segment], taken)
    for vantage, cidrs in (
        (Vantage.MONITORING, access.monitoring_cidrs),
        (Vantage.ADMIN, access.admin_cidrs),
    ):
        picks[vantage] = _first_host(_networks(cidrs), [segment], taken | {picks[Vantage.CLIENT] or ""})
        if picks[vantage] is None:
            notes.append(
                f"no {vantage.value} vantage: access.{vantage.value}Cidrs has no IPv4 address to use"
            )
    outsider = next(
        (ip for ip in _OUTSIDER_CANDIDATES if not any(ipaddress.ip_address(ip) in net for net in everyone)),
        None,
    )
    picks[Vantage.OUTSIDER] = outsider
    unused = [str(host) for host in segment.hosts() if str(host) not in node_ips]
    picks[Vantage.INTRUDER] = unused[-1] if unused else None
    if picks[Vantage.INTRUDER] is None:
        notes.append(f"no intruder vantage: network.cidr {segment} has no unused address")
    vantages = []
    for index, vantage in enumerate(VANTAGES):
        ip = picks.get(vantage)
        if ip is None:
            continue
        roles = _roles(ip, cluster)
        extra = [role.value for role in roles if role is not vantage]
        if extra:
            notes.append(
                f"{vantage.value} {ip} is also inside {', '.join(extra)} CIDRs; expected to get that too"
            )
        vantages.append(
            Member(
                namespace=f"{prefix}{vantage.value}",
                ip=ip,
                prefixlen=32,
                switch_port=f"v{index}",
                vantage=vantage,
                roles=roles,
            )
        )
    lb_node = cluster.load_balancer_node
    by_name = {member.node: member for member in nodes}
    heads = tuple(by_name[head.name] for head in cluster.topology.heads)
    return LabPlan(
        label=label,
        cluster=cluster,
        switch=f"{prefix}switch",
        nodes=nodes,
        vantages=tuple(vantages),
        load_balancer=by_name[lb_node.name],
        heads=heads,
        notes=tuple(notes),
        stack_config=stack_config,
    )


def expectations(plan: LabPlan) -> list[ProbeExpectation]:
    """The port table's promise (qwen_cluster.ports.reachability) as concrete probes.

    A vantage namespace gets the union of its own rows and the rows of every access CIDR
    its address falls in (a monitoring host inside clientCidrs is a client too). Nodes
    probe every other node (NIXL's rows closed within a fenced pool: Expectation.open_between).
    The load balancer is a node on bare metal, a member, so its own rows (which assume a
    non-member) are covered by the node rows.
    """
    cluster = plan.cluster
    monitoring = cluster.monitoring_node
    rows = port_table.reachability(
        cluster.ports,
        listener_port=cluster.load_balancer.port,
        ssh_to_nodes=cluster.ssh_to_nodes,
        monitoring_node=monitoring.name if monitoring else None,
    )
    by_vantage: dict[Vantage, list[port_table.Expectation]] = {}
    for row in rows:
        by_vantage.setdefault(row.vantage, []).append(row)
    lb = plan.load_balancer
    result: list[ProbeExpectation] = []

    def targets(row: port_table.Expectation, source_node: str | None) -> list[Member]:
        if row.target is port_table.Target.LOAD_BALANCER:
            return [lb] if lb.node != source_node else []
        return [member for member in plan.nodes if member.node != source_node]

    for source in plan.nodes:
        source_pool = cluster.fenced_pool(source.node)
        for row in by_vantage[Vantage.NODE]:
            for target in targets(row, source.node):
                # NIXL's rows within a fenced pool (serving.mode disaggregated on bare metal) are closed.
                is_open = row.open_between(source_pool, cluster.fenced_pool(target.node))
                result.append(
                    ProbeExpectation(
                        source.node,
                        source.namespace,
                        target.node,
                        target.ip,
                        row.name,
                        row.port,
                        is_open,
                        "node" if is_open == row.open else f"node of the {source_pool} pool",
                    )
                )
    for source in plan.vantages:
        merged: dict[tuple[str, str, int], tuple[bool, list[str]]] = {}
        for vantage in dict.fromkeys((source.vantage, *source.roles)):
            for row in by_vantage[vantage]:
                key = (row.target.value, row.name, row.port)
                was_open, why = merged.get(key, (False, []))
                if row.open:
                    why = [*why, vantage.value]
                merged[key] = (was_open or row.open, why)
        for row in by_vantage[source.vantage]:
            is_open, why = merged[(row.target.value, row.name, row.port)]
            for target in targets(row, None):
                here = is_open and row.open_on(target.node) if row.only_on is not None else is_open
                result.append(
                    ProbeExpectation(
                        source.vantage.value,
                        source.namespace,
                        target.node,
                        target.ip,
                        row.name,
                        row.port,
                        here,
                        f"as {'+'.join(why)}"
                        if here
                        else f"runs on {row.only_on} only"
                        if is_open
                        else "no rule admits it",
                    )
                )
    return result


def load(
    stack: str,
    *,
    nodes: int | None = None,
    label: str | None = None,
    root=None,
    changes: tuple[str, ...] | list[str] = (),
) -> LabPlan:
    """The plan for a stack file; ConfigError if the stack does not validate. `changes`:
    `KEY=VALUE` as scripts/plan.py --change takes them, applied after the node count (so that
    they may name the nodes kept, e.g. a serving pool's)."""
    from tooling import stackfile
    from tooling.changes import edit

    raw = stackfile.read(stack) if root is None else stackfile.read(stack, root)
    cluster = stackfile.load(stack) if root is None else stackfile.load(stack, root)
    if nodes is not None:
        cluster = with_node_count(cluster, nodes)
        # with_nodes keeps bareMetal.hostKeys to the nodes kept: the plan's config validates again
        # (an upgrade applied to it).
        raw = stackfile.with_nodes(
            raw, cluster.model_dump(by_alias=True, mode="json", exclude_none=True)["nodes"]
        )
    if changes:
        raw = edit.apply_changes(raw, changes)
        cluster = config.validate(stackfile.cluster_keys(raw), aws_region=raw.get("aws:region"))
    return build(cluster, label or stack, stack_config=raw)


def from_stack_config(raw: dict[str, Any], label: str) -> LabPlan:
    """The plan for a `config:` map (an upgrade's changed config); ConfigError if invalid."""
    from tooling import stackfile

    cluster = config.validate(stackfile.cluster_keys(raw), aws_region=raw.get("aws:region"))
    return build(cluster, label, stack_config=raw)


__all__ = ["ConfigError", "LabPlan", "Member", "PlanError", "ProbeExpectation", "build", "load"]
