"""Model topology: replicas x (tensor, pipeline) parallel, head nodes, the ports a replica
that spans nodes opens between them.

A replica of `pipelineParallel` nodes runs vLLM's own multi-node launch by default (vLLM 0.33:
`vllm serve --nnodes N --node-rank R --master-addr HEAD --master-port P` on the head, the same with
`--headless` on the others, multiprocessing executor; no Ray). Its one fixed port, the
torch.distributed rendezvous (`--master-port`), is pinned inside the port table's cluster range;
what it cannot pin (NCCL and Gloo sockets, the cross-node message queues that bind
`tcp://<node ip>:0`) is said to be random in qwen_cluster/ports.py. Ray stays for an image that
carries it (`model.distributedBackend: ray`): every Ray port pinned inside the range as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from qwen_cluster.ports import PortEntry, PortRange, cluster_range

# Ray's fixed ports, in the order they are laid into the cluster range
# (https://docs.ray.io/en/latest/ray-core/configure.html#ports-configurations). No Ray client
# server: `--ray-client-server-port` makes `ray start --head` fail at once without ray[client]
# (grpcio), and nothing here uses the client. The two metrics servers bind 0.0.0.0 on the head
# without a token and move only by environment variable (ray_metrics_environment).
RAY_FIXED_PORTS = (
    "gcs",  # ray start --head --port
    "node_manager",  # --node-manager-port
    "object_manager",  # --object-manager-port
    "dashboard",  # --dashboard-port (head)
    "dashboard_agent_grpc",  # --dashboard-agent-grpc-port
    "dashboard_agent_http",  # --dashboard-agent-listen-port
    "metrics_export",  # --metrics-export-port
    "runtime_env_agent",  # --runtime-env-agent-port
    "autoscaler_metrics",  # env AUTOSCALER_METRIC_PORT (the monitor's metrics, head; default 44217)
    "dashboard_metrics",  # env DASHBOARD_METRIC_PORT (the dashboard's metrics, head; default 44227)
)
# Where the Ray dashboard listens on a replica head: loopback, never the cluster network.
DASHBOARD_HOST = "127.0.0.1"
# vLLM's fixed port across nodes: `--master-port` (vllm/config/parallel.py ParallelConfig.master_port,
# default 29501), where the head's torch.distributed TCPStore listens for the world group when
# nnodes > 1 (vllm/distributed/parallel_state.py init_distributed_environment).
VLLM_FIXED_PORTS = ("vllm_master",)
# Ray starts one worker process per port of --min/--max-worker-port; with 8 GPUs per node
# and the driver and helpers, 16 is the least that does not starve the scheduler.
MIN_WORKER_PORTS = 16
MIN_CLUSTER_PORTS = len(RAY_FIXED_PORTS) + len(VLLM_FIXED_PORTS) + MIN_WORKER_PORTS


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class PinnedPorts:
    gcs: int
    node_manager: int
    object_manager: int
    dashboard: int
    dashboard_agent_grpc: int
    dashboard_agent_http: int
    metrics_export: int
    runtime_env_agent: int
    autoscaler_metrics: int
    dashboard_metrics: int
    vllm_master: int  # vllm serve --master-port (multi-node replicas)
    workers: PortRange  # --min-worker-port / --max-worker-port

    def named(self) -> dict[str, PortRange]:
        """Every pinned port or range by name, for tables and collision checks."""
        fixed = (*RAY_FIXED_PORTS, *VLLM_FIXED_PORTS)
        ports = {name: PortRange(getattr(self, name), getattr(self, name)) for name in fixed}
        return {**ports, "ray_workers": self.workers}

    def ray_start_args(self, *, head: bool, head_ip: str | None = None) -> list[str]:
        """`ray start` flags for a head or a worker that keep Ray inside the range."""
        common = [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_http}",
            f"--metrics-export-port={self.metrics_export}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--min-worker-port={self.workers.low}",
            f"--max-worker-port={self.workers.high}",
        ]
        if head:
            return [
                "--head",
                f"--port={self.gcs}",
                # The dashboard and its job API run code for whoever reaches them (CVE-2023-48022):
                # loopback only (Ray's CLI: `ray start --dashboard-host`, docs.ray.io cluster/cli).
                f"--dashboard-host={DASHBOARD_HOST}",
                f"--dashboard-port={self.dashboard}",
                *common,
            ]
        if not head_ip:
            raise TopologyError("a Ray worker needs the head's IP")
        return [f"--address={head_ip}:{self.gcs}", *common]

    def ray_metrics_environment(self) -> dict[str, str]:
        """The two Ray metrics servers no `ray start` flag moves: pinned by the variables Ray reads
        (ray-project/ray: python/ray/autoscaler/_private/constants.py
        `AUTOSCALER_METRIC_PORT = env_integer("AUTOSCALER_METRIC_PORT", 44217)`,
        python/ray/dashboard/consts.py DASHBOARD_METRIC_PORT, 44227 by default),
        inside the range, so the table holds them (they bind 0.0.0.0 on the head)."""
        return {
            "AUTOSCALER_METRIC_PORT": str(self.autoscaler_metrics),
            "DASHBOARD_METRIC_PORT": str(self.dashboard_metrics),
        }

    def multinode_args(self, *, nnodes: int, node_rank: int, master_addr: str) -> list[str]:
        """vLLM's own multi-node launch (vllm/engine/arg_utils.py: --nnodes, --node-rank,
        --master-addr, --master-port; vllm/config/parallel.py: "for multi-node distributed
        inference when distributed_executor_backend is mp")."""
        return [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={self.vllm_master}",
        ]


def ray_auth_environment(token: str) -> dict[str, str]:
    """Ray's token authentication (Ray 2.52 and newer): every Ray process of a replica, head and
    workers, gets the same token and refuses RPCs and dashboard calls without it
    (ray-project/ray, `RAY_AUTH_MODE=token` with `RAY_AUTH_TOKEN`; `ray start` fails when the
    mode is token and no token is given). Call it only inside the secret's `apply`: the result
    holds the token in plain text."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def pin_ports(entry: PortEntry) -> PinnedPorts:
    """Lay Ray's and vLLM's fixed ports into the cluster range, or say why it is too small."""
    span = entry.port
    if span.size < MIN_CLUSTER_PORTS:
        raise TopologyError(
            f"ports entry {entry.name} ({span}) holds {span.size} ports; pinning Ray and vLLM "
            f"needs at least {MIN_CLUSTER_PORTS} ({len(RAY_FIXED_PORTS)} Ray ports, "
            f"{len(VLLM_FIXED_PORTS)} for vLLM, {MIN_WORKER_PORTS} Ray worker ports)"
        )
    names = (*RAY_FIXED_PORTS, *VLLM_FIXED_PORTS)
    fixed = {name: span.low + offset for offset, name in enumerate(names)}
    return PinnedPorts(**fixed, workers=PortRange(span.low + len(names), span.high))


@dataclass(frozen=True)
class NodeRef:
    name: str
    ip: str


@dataclass(frozen=True)
class Replica:
    index: int
    members: tuple[NodeRef, ...]  # pipeline stages in order; the first is the head

    @property
    def head(self) -> NodeRef:
        return self.members[0]

    @property
    def workers(self) -> tuple[NodeRef, ...]:
        return self.members[1:]


@dataclass(frozen=True)
class Topology:
    tensor_parallel: int
    pipeline_parallel: int
    model_port: int
    ports: PinnedPorts
    replicas: tuple[Replica, ...] = field(default_factory=tuple)

    # Computed once per topology (frozen: they never go stale): the renderers ask for every
    # node of every node, which at 256 nodes was a quarter of the render time.
    @cached_property
    def heads(self) -> tuple[NodeRef, ...]:
        """The load balancer's targets: one model server per replica."""
        return tuple(replica.head for replica in self.replicas)

    @cached_property
    def _replica_by_node(self) -> dict[str, Replica]:
        return {member.name: replica for replica in self.replicas for member in replica.members}

    def replica_of(self, node_name: str) -> Replica:
        try:
            return self._replica_by_node[node_name]
        except KeyError:
            raise KeyError(f"{node_name} is in no replica") from None

    def is_head(self, node_name: str) -> bool:
        replica = self._replica_by_node.get(node_name)
        return replica is not None and replica.head.name == node_name


def lanes(replicas: Sequence[Replica], width: int) -> tuple[tuple[Replica, ...], ...]:
    """The replicas in `width` lanes: replica i in lane i mod width, in replica order. A change
    rolls each lane one replica after another, the lanes independently of each other (Kubespray's
    graceful_rolling rather than Ansible's `serial` waves: a slow replica holds only its own
    lane), so at most `width` replicas are out of service at once and a lane is
    ceil(len(replicas) / width) long."""
    if width < 1:
        raise ValueError(f"a rollout needs at least one lane, not {width}")
    return tuple(lane for lane in (tuple(replicas[start::width]) for start in range(width)) if lane)


def pool_lanes(
    replicas: Sequence[Replica], width: int, pools: dict[str, str]
) -> tuple[tuple[Replica, ...], ...]:
    """The lanes of a disaggregated cluster (`pools`: a replica head's name -> its pool): each
    lane holds one pool's replicas, and a pool of n replicas gets at most n - 1 lanes, so the
    lanes out at once never empty a pool (the router has a prefill and a decode worker
    throughout); together at most `width` lanes, as `lanes`. A pool of one replica has one lane
    and is empty while that replica is replaced (nothing can keep it serving). `width` 1: one
    lane, one replica at a time."""
    if width < 1:
        raise ValueError(f"a rollout needs at least one lane, not {width}")
    if width == 1:
        return lanes(replicas, 1)
    by_pool: dict[str, list[Replica]] = {}
    for replica in replicas:
        by_pool.setdefault(pools[replica.head.name], []).append(replica)
    result: list[tuple[Replica, ...]] = []
    left = width
    for index, (_, members) in enumerate(by_pool.items()):
        still = len(by_pool) - index - 1  # pools after this one keep a lane each
        pool_width = max(1, min(len(members) - 1, left - still))
        result += lanes(members, pool_width)
        left -= pool_width
    # The master's lane first, as `lanes` orders them (the first replica's).
    return tuple(sorted(result, key=lambda lane: lane[0].index))


def previous_in_lane(replica: Replica, width: int) -> int | None:
    """The index of the replica before `replica` in its lane, or None for a lane's first."""
    return replica.index - width if replica.index >= width else None


def build(
    nodes: list[tuple[str, str, str]],
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    model_port: int,
    cluster_entry: PortEntry,
) -> Topology:
    """Group (name, ip, role) nodes into replicas of `pipeline_parallel` consecutive nodes.

    The master comes first so that it heads replica 0 (the guide's "model service on the
    master"); the others keep their config order, so adding a node never moves a replica.
    """
    if pipeline_parallel < 1 or tensor_parallel < 1:
        raise TopologyError("tensorParallel and pipelineParallel are at least 1")
    if len(nodes) % pipeline_parallel:
        raise TopologyError(f"{len(nodes)} nodes do not split into replicas of {pipeline_parallel} nodes")
    ordered = sorted(nodes, key=lambda node: node[2] != "master")
    refs = [NodeRef(name, ip) for name, ip, _ in ordered]
    replicas = tuple(
        Replica(index, tuple(refs[start : start + pipeline_parallel]))
        for index, start in enumerate(range(0, len(refs), pipeline_parallel))
    )
    return Topology(
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        model_port=model_port,
        ports=pin_ports(cluster_entry),
        replicas=replicas,
    )


def for_config(cluster) -> Topology:
    """The topology of a validated ClusterConfig."""
    return build(
        [(node.name, str(node.ip), node.role) for node in cluster.nodes],
        tensor_parallel=cluster.model.tensor_parallel,
        pipeline_parallel=cluster.model.pipeline_parallel,
        model_port=cluster.model_port,
        cluster_entry=cluster_range(cluster.ports),
    )
