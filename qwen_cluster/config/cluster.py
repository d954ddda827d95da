"""ClusterConfig: the validated stack config as one object, the facts renderers derive from
it (master, topology, bandwidth class, exposures), and the table of top-level keys.
"""

from __future__ import annotations

import functools
import types
from typing import Any, get_args

from pydantic import Field, model_validator

from qwen_cluster import catalog
from qwen_cluster import ports as port_table
from qwen_cluster import topology as topology_module
from qwen_cluster.config import limits
from qwen_cluster.config.rules import cross_errors
from qwen_cluster.config.sections import (
    KV_BLOCK_SIZE,
    Access,
    AwsTarget,
    BareMetalTarget,
    LoadBalancer,
    Model,
    Monitoring,
    Network,
    Node,
    Rollout,
    Serving,
    Target,
    Tuning,
)
from qwen_cluster.config.values import Section

NAMESPACE = "qwen-cluster"


class ClusterConfig(Section):
    target: Target = Field(
        description="Where the cluster runs. That target's section (`aws` or `bareMetal`) is required, "
        "the other's refused.",
    )
    nodes: list[Node] = Field(
        description="The GPU nodes, each `{name, ip, role}` (`nodes[]` below): at least "
        f"{limits.MIN_NODES} ({limits.RECOMMENDED_NODES} or more recommended), names and IPs unique, "
        "exactly one master.",
    )
    network: Network = Field(description="The node segment and what the network between nodes must deliver.")
    ports: list[port_table.PortEntry] = Field(
        default_factory=lambda: list(port_table.DEFAULT_PORTS),
        description="The port table, each row `{name, port, scope, required}` (`ports[]` below). Names "
        f"unique; no two rows overlap and none includes SSH {port_table.SSH_PORT}; exactly one "
        "`clients` row (the model port) and at least one `cluster` row, the widest of which must hold "
        f"the {topology_module.MIN_CLUSTER_PORTS} ports vLLM's `--master-port` and Ray are pinned into "
        "(what nothing pins, NCCL, Gloo and vLLM's cross-node message queues, binds a random port that "
        "only the cluster's members reach). Scopes: `clients` "
        "(through the load balancer only), `cluster` (node to node only: the node security group's "
        "members on AWS, the exact node IPs on bare metal), `monitoring` (`access.monitoringCidrs`), "
        "`admin` (`access.adminCidrs`).",
    )
    access: Access = Field(
        description="Who may reach what: the CIDR blocks of clients, monitoring and admins."
    )
    load_balancer: LoadBalancer = Field(
        default=LoadBalancer(),
        description="The endpoint clients use: an NLB on AWS, nginx on a node on bare metal.",
    )
    model: Model = Field(
        default=Model(), description="What the replicas serve and how a replica spans GPUs and nodes."
    )
    tuning: Tuning = Field(default=Tuning(), description="Host tuning on every node: sysctl values and RDMA.")
    monitoring: Monitoring = Field(
        default=Monitoring(),
        description="Every node's metrics endpoint, and the cluster's own Prometheus and Alertmanager.",
    )
    serving: Serving = Field(
        default=Serving(),
        description="How the replicas split the work: `aggregated` (each prefills and decodes its own "
        "requests) or `disaggregated` (a prefill pool hands each prompt's KV cache to a decode pool over "
        "NIXL; `serving` below, docs/disaggregation.md).",
    )
    rollout: Rollout = Field(
        default=Rollout(),
        description="How a Day-2 change rolls over the replicas (both targets): in `maxUnavailable` "
        "independent lanes, each replica drained, restarted and answering `/health` before the next "
        "one of its lane starts.",
    )
    aws: AwsTarget | None = Field(
        default=None, description="Required when `target` is `aws`, refused otherwise."
    )
    bare_metal: BareMetalTarget | None = Field(
        default=None, description="Required when `target` is `bare-metal`, refused otherwise."
    )

    @model_validator(mode="after")
    def _cross_rules(self) -> ClusterConfig:
        sections = {name: getattr(self, name) for name in type(self).model_fields}
        given = {field.alias for name, field in type(self).model_fields.items() if sections[name] is not None}
        errors = cross_errors(sections, given)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    # Derived facts the renderers share.
    @property
    def master(self) -> Node:
        return next(node for node in self.nodes if node.role == "master")

    @functools.cached_property
    def topology(self) -> topology_module.Topology:
        """Computed once: the config is frozen, and renderers ask for it per node."""
        return topology_module.for_config(self)

    @property
    def runs_ray(self) -> bool:
        """Replicas span nodes through Ray (model.distributedBackend ray), not vLLM's own launch."""
        return self.topology.pipeline_parallel > 1 and self.model.distributed_backend == "ray"

    @functools.cached_property
    def max_unavailable(self) -> int:
        """rollout.maxUnavailable as a count of this cluster's replicas."""
        return self.rollout.unavailable(len(self.topology.replicas))

    @functools.cached_property
    def rollout_lanes(self) -> tuple[tuple[topology_module.Replica, ...], ...]:
        """The replicas in the lanes a change rolls in (topology_module.lanes); disaggregated, by
        pool, so that no pool is ever emptied by the lanes out at once (topology_module.pool_lanes)."""
        replicas = self.topology.replicas
        if self.disaggregated:
            pools = {replica.head.name: self.serving.pool_of(replica.head.name) or "" for replica in replicas}
            return topology_module.pool_lanes(replicas, self.max_unavailable, pools)
        return topology_module.lanes(replicas, self.max_unavailable)

    @functools.cached_property
    def _previous_in_lane(self) -> dict[int, int | None]:
        return {
            replica.index: (lane[position - 1].index if position else None)
            for lane in self.rollout_lanes
            for position, replica in enumerate(lane)
        }

    def previous_in_lane(self, replica: topology_module.Replica) -> int | None:
        """The index of the replica before `replica` in its lane (rollout_lanes), or None for a
        lane's first."""
        return self._previous_in_lane[replica.index]

    @property
    def model_port(self) -> int:
        return port_table.model_port(self.ports)

    @property
    def disaggregated(self) -> bool:
        return self.serving.mode == "disaggregated"

    @property
    def router_port(self) -> int | None:
        """vLLM's router's port (the `router` row) with loadBalancer.routing cache-aware or
        kv-aware, or serving.mode disaggregated (the router in P/D mode), else None."""
        if not self.load_balancer.routed and not self.disaggregated:
            return None
        return port_table.port_of(self.ports, port_table.ROUTER)

    @property
    def kv_events_port(self) -> int | None:
        """Where each replica head publishes its KV-cache events (the `kv-events` row) with
        loadBalancer.routing kv-aware, else None."""
        if self.load_balancer.routing != "kv-aware":
            return None
        return port_table.port_of(self.ports, port_table.KV_EVENTS)

    @property
    def kv_block_size(self) -> int:
        """The replicas' KV block size in tokens: model.vllmFlags `--block-size`, else
        sections.KV_BLOCK_SIZE (rendered explicitly with kv-aware routing, render/vllm.py)."""
        given = self.model.vllm_flags.get("--block-size")
        return KV_BLOCK_SIZE if given is None else int(given)

    @property
    def router_worker_port(self) -> int | None:
        """Where each head's proxy listens for the router (the `router-worker` row): AWS with
        loadBalancer.routing cache-aware, else None."""
        if self.router_port is None or self.aws is None:
            return None
        return port_table.port_of(self.ports, port_table.ROUTER_WORKER)

    @property
    def router_node(self) -> Node | None:
        """Where vLLM's router runs (cache-aware): the load-balancer node on bare metal, the
        master on AWS (one router for every node's proxy, docs/routing.md); else None."""
        if self.router_port is None:
            return None
        return self.load_balancer_node if self.aws is None else self.master

    @property
    def load_balancer_node(self) -> Node | None:
        """The node nginx runs on (bare metal); None on AWS, where the NLB is managed."""
        if self.bare_metal is None:
            return None
        wanted = self.bare_metal.load_balancer_node or self.master.name
        return next(node for node in self.nodes if node.name == wanted)

    @property
    def instance(self) -> catalog.InstanceType | None:
        return catalog.instance_type(self.aws.instance_type) if self.aws else None

    @property
    def gpus_per_node(self) -> int:
        if self.aws:
            return self.instance.gpus
        return self.bare_metal.gpus_per_node

    @property
    def gpu_memory_gb(self) -> float:
        if self.aws:
            return self.instance.gpu_memory_gb
        return self.bare_metal.gpu_memory_gb

    @property
    def gpu_model(self) -> str | None:
        """The GPU, as the catalog names it: the instance type's on AWS, bareMetal.gpuModel (if stated)."""
        if self.aws:
            return self.instance.gpu_model if self.instance else None
        return self.bare_metal.gpu_model if self.bare_metal else None

    def kv_side_channel_host(self, node: Node) -> str:
        """The address `node`'s NIXL side channel binds and advertises (serving.kvTransfer)."""
        return self.serving.kv_transfer.side_channel_hosts.get(node.name, str(node.ip))

    def fenced_pool(self, node_name: str) -> str | None:
        """The pool kept off `node_name`'s NIXL rows (ports.POOL_FENCED_ROWS): its own, on bare metal
        with serving.mode disaggregated, where the host firewall drops its pool's other members there
        (render/firewall.py). None elsewhere: aggregated has no such rows, and on aws every member
        reaches them (a security group has allow rules only, and EFA needs its all-traffic self rule:
        render/sg_rules.py)."""
        return self._fenced_pools.get(node_name)

    @functools.cached_property
    def _fenced_pools(self) -> dict[str, str]:
        """fenced_pool of every node that has one, computed once: renderers ask per pair of nodes."""
        if self.bare_metal is None or not self.disaggregated:
            return {}
        return {name: pool for pool in ("prefill", "decode") for name in getattr(self.serving, pool).nodes}

    @property
    def kv_backend(self) -> str | None:
        """serving.kvTransfer.backend in effect (libfabric on aws, ucx on bare metal), or None
        when aggregated."""
        if not self.disaggregated:
            return None
        return self.serving.kv_transfer.backend_on(aws=self.aws is not None)

    @property
    def bandwidth_gbps(self) -> float:
        """The bandwidth class: the catalog's baseline on AWS, the declared NIC speed on bare metal."""
        if self.aws:
            return self.instance.baseline_gbps
        return self.bare_metal.nic_speed_gbps

    @property
    def monitoring_node(self) -> Node | None:
        """Where Prometheus and Alertmanager run; None when monitoring.prometheus is off."""
        if not self.monitoring.prometheus:
            return None
        wanted = self.monitoring.node or self.master.name
        return next(node for node in self.nodes if node.name == wanted)

    @property
    def ssh_to_nodes(self) -> bool:
        """SSH reaches the nodes only over an admin path: always on bare metal, a bastion on AWS."""
        return self.target is Target.BARE_METAL or bool(self.aws and self.aws.bastion)

    def exposures(self) -> list[port_table.Exposure]:
        return port_table.exposures(
            self.ports,
            listener_port=self.load_balancer.port,
            client_cidrs=tuple(str(c) for c in self.access.client_cidrs),
            monitoring_cidrs=tuple(str(c) for c in self.access.monitoring_cidrs),
            admin_cidrs=tuple(str(c) for c in self.access.admin_cidrs),
            ssh_to_nodes=self.ssh_to_nodes,
            ssh_via_bastion=bool(self.aws and self.aws.bastion),
            monitoring_node=self.monitoring_node.name if self.monitoring_node else None,
        )


def _section_type(annotation: Any) -> Any:
    """`AwsTarget | None` -> AwsTarget: an absent section is handled before its type is checked."""
    if isinstance(annotation, types.UnionType):
        (kind,) = (arg for arg in get_args(annotation) if arg is not type(None))
        return kind
    return annotation


# Top-level keys, in the order problems are reported: config key -> (attribute, type, required).
SECTIONS: dict[str, tuple[str, Any, bool]] = {
    field.alias: (name, _section_type(field.annotation), field.is_required())
    for name, field in ClusterConfig.model_fields.items()
}
# Keys read apart from the validated sections (secrets stay Outputs): key -> description.
SECRET_KEYS: dict[str, str] = {
    "sshPrivateKey": "The SSH private key pulumi connects to hosts and bastions with, a secret: "
    "`pulumi config set --secret sshPrivateKey < key`.",
    "rayAuthToken": "The token Ray's processes authenticate each other with (`RAY_AUTH_MODE=token`), a "
    "secret; required when `model.pipelineParallel` > 1 with `model.distributedBackend` `ray`: "
    "`pulumi config set --secret rayAuthToken $(openssl rand -hex 32)`.",
}
KNOWN_KEYS = (*SECTIONS, *SECRET_KEYS)
