"""The model server's command line: `vllm serve` on a replica head, `ray start` on the other
members of a pipeline-parallel replica. One source for both targets (AWS runs it through SSM
and the first boot, bare metal as a container's entry command), pure.

The program owns the flags that must agree with the rest of the config (address, port,
parallel sizes, memory plan, executor backend: config.OWNED_VLLM_FLAGS); everything else is
`model.vllmFlags` over config.DEFAULT_VLLM_FLAGS.
"""

from __future__ import annotations

import shlex

from qwen_cluster import catalog
from qwen_cluster.config import DEFAULT_VLLM_FLAGS, ClusterConfig, Target, VllmFlagValue
from qwen_cluster.render import weights

# On AWS vLLM listens on loopback only, behind the node's proxy (qwen_cluster/render/proxy.py),
# which holds the node address and the model port, checks keys and routes and terminates TLS.
LOOPBACK = "127.0.0.1"
# vLLM's health route, the one definition of it here: `GET /health` in
# vllm/entrypoints/openai/api_server.py (vllm-project/vllm, the release of config.DEFAULT_IMAGE)
# answers 200 while the engine serves and 503 once it is dead (EngineDeadError); before the
# weights are loaded nothing listens. The NLB health check, nginx's /health, the rollout gate,
# the SSM run's wait and the lab's stand-in model server all ask this path.
HEALTH_PATH = "/health"
# vLLM's own graceful shutdown (config.DEFAULT_VLLM_FLAGS): on SIGTERM it refuses new requests
# and lets those in flight finish for at most this many seconds.
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"
# What docker waits beyond that before SIGKILL: the engine's processes exit and free the GPUs.
STOP_MARGIN_SECONDS = 30


def extra_flags(cluster: ClusterConfig) -> dict[str, VllmFlagValue]:
    """The flags beyond the owned ones, in effect: served name, Qwen3 defaults, then the
    stack's `model.vllmFlags` (false or null drops a flag)."""
    merged: dict[str, VllmFlagValue] = {
        "--served-model-name": cluster.model.name,
        **DEFAULT_VLLM_FLAGS,
        **cluster.model.vllm_flags,
    }
    return {flag: value for flag, value in sorted(merged.items()) if value is not None and value is not False}


def _argument(flag: str, value: VllmFlagValue) -> str:
    if value is True:
        return flag
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # the engine hands numbers over as floats
    return f"{flag}={value}"


def listen_address(cluster: ClusterConfig, node_name: str) -> str:
    """Where a head's vLLM listens (`--host`). Bare metal: the node's cluster address, never every
    interface; nginx on the load-balancer node reaches it there, and the host firewall admits the
    model port from that node only. AWS: loopback, behind the node's proxy on the node address."""
    if cluster.target is Target.AWS:
        return LOOPBACK
    return str(next(node.ip for node in cluster.nodes if node.name == node_name))


def serve_argv(cluster: ClusterConfig, node_name: str | None = None) -> list[str]:
    """`vllm serve MODEL ...` for a replica head (default: the first)."""
    topology = cluster.topology
    node_name = node_name or topology.heads[0].name
    owned = [
        f"--host={listen_address(cluster, node_name)}",
        f"--port={topology.model_port}",
        f"--tensor-parallel-size={topology.tensor_parallel}",
        f"--pipeline-parallel-size={topology.pipeline_parallel}",
        f"--gpu-memory-utilization={catalog.GPU_MEMORY_UTILIZATION}",
    ]
    if topology.pipeline_parallel > 1:
        owned.append("--distributed-executor-backend=ray")  # the replica spans nodes
    extras = [_argument(flag, value) for flag, value in extra_flags(cluster).items()]
    # The repository id (resolved in the staged cache) or the staged S3 copy; clients still ask
    # for model.name (`--served-model-name`).
    return ["vllm", "serve", weights.model_path(cluster), *owned, *extras]


def stop_grace_seconds(cluster: ClusterConfig) -> int:
    """How long docker lets the model server stop (SIGTERM, then SIGKILL): longer than vLLM's own
    shutdown timeout in effect, so its drain is never cut. Without the flag vLLM aborts at once
    and the margin is all it needs."""
    value = extra_flags(cluster).get(SHUTDOWN_TIMEOUT_FLAG, 0)
    drain = 0 if value is True else int(float(value))
    return drain + STOP_MARGIN_SECONDS


def ray_argv(cluster: ClusterConfig, node_name: str) -> list[str]:
    """`ray start` for a member of a pipeline-parallel replica, its ports pinned in the range."""
    topology = cluster.topology
    replica = topology.replica_of(node_name)
    node_ip = next(member.ip for member in replica.members if member.name == node_name)
    ray = ["ray", "start", f"--node-ip-address={node_ip}"]
    if replica.head.name == node_name:
        return [*ray, *topology.ports.ray_start_args(head=True)]
    return [*ray, "--block", *topology.ports.ray_start_args(head=False, head_ip=replica.head.ip)]


def server_script(cluster: ClusterConfig, node_name: str, prelude: str = "") -> str:
    """The bash script the model server runs on `node_name` (`bash -c`): vLLM on a replica head
    (after the Ray head when the replica spans nodes), a blocking Ray worker elsewhere.
    `prelude` runs first (a target's own setup, e.g. finding the cluster interface)."""
    topology = cluster.topology
    if topology.pipeline_parallel == 1:
        command = f"exec {shlex.join(serve_argv(cluster, node_name))}"
    elif topology.is_head(node_name):
        serve = shlex.join(serve_argv(cluster, node_name))
        command = f"{shlex.join(ray_argv(cluster, node_name))} && exec {serve}"
    else:
        command = f"exec {shlex.join(ray_argv(cluster, node_name))}"
    return prelude + command


def environment(cluster: ClusterConfig, node_name: str) -> dict[str, str]:
    """The environment every target gives the model server: the node's own address for vLLM and
    the first port of vLLM's pinned block (and the replica's Ray head when it spans nodes)."""
    topology = cluster.topology
    replica = topology.replica_of(node_name)
    node_ip = next(member.ip for member in replica.members if member.name == node_name)
    env = {"VLLM_HOST_IP": str(node_ip), "VLLM_PORT": str(topology.ports.vllm.low)}
    if topology.pipeline_parallel > 1:
        env["RAY_ADDRESS"] = f"{replica.head.ip}:{topology.ports.gcs}"
    return env
