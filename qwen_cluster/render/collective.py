"""What every member of a replica gives NCCL, Gloo and vLLM so that they meet on the cluster
interface and use the fast transport, or fail loudly (docs/monitoring.md, "The ten failures").
One function per fact, for both targets: the bare-metal container
(components/baremetal/serving.py) and the SSM model server (qwen_cluster/render/ssm.py) take
their environment and container settings from here, so the two cannot drift apart.

Signatures:
    transport(cluster) -> str                      NCCL_NET: "AWS Libfabric" | "IB" | "Socket"
    environment(cluster, interface=None) -> dict   the NCCL/Gloo environment of every member
    container_settings(cluster) -> Settings        ipc, memlock, devices, capabilities
    docker_run_options(cluster) -> list[str]       the same as `docker run` options
    interface_prelude(ucx_tcp=False) -> str        bash: find the interface, export the variables

What cannot be known when the program renders (the interface's name, the host's own limits,
whether /dev/infiniband exists) is found on the host: the interface by the one finder
(qwen_cluster/node/nic.py) when the container starts, the rest by the preflight
(qwen_cluster/render/preflight.py), which stops naming the host fact.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen_cluster.config import ClusterConfig, Target
from qwen_cluster.node import nic

# NCCL_NET forces one network and makes NCCL fail instead of falling back to another one
# (NCCL's env.html, "NCCL_NET": "Forces NCCL to use a specific network, for example to make
# sure NCCL uses an external plugin and doesn't automatically fall back on the internal IB or
# Socket implementation"). aws-ofi-nccl's plugin is named "AWS Libfabric" (aws/aws-ofi-nccl, the
# ncclNet_vN structs' `.name`; newer releases call it "Libfabric" and rename it back when NCCL_NET
# asks for "AWS Libfabric", plugin_name_fixup in src/nccl_ofi_interface_nvidia.cpp).
NET_EFA = "AWS Libfabric"
NET_IB = "IB"
NET_SOCKET = "Socket"
# The transport NCCL picked, in its own words (NVIDIA/nccl src/init.cc
# `INFO(NCCL_INIT, "Using network %s", ...)`): printed with NCCL_DEBUG=INFO and the INIT
# subsystem, once per communicator. `doctor` reads it from the model server's log.
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
# A registered memory region must be pinned: without an unlimited memlock, ibv_reg_mr fails at
# NCCL init ("Cannot allocate memory", aws/aws-ofi-nccl#663). -1 is docker's "unlimited".
UNLIMITED = -1
# NCCL's shared-memory transport and its proxy buffers live in /dev/shm; docker gives a container
# 64 MiB unless told otherwise ("Error while creating shared memory segment", NVIDIA/nccl#1524).
# Host IPC shares the host's /dev/shm (half the RAM by default) and nothing is to be sized.
IPC_MODE = "host"
MIN_SHM_BYTES = 1 << 30  # what doctor and preflight accept in /dev/shm
RDMA_DEVICE = "/dev/infiniband"


def transport(cluster: ClusterConfig) -> str:
    """The network NCCL must use across nodes: EFA through aws-ofi-nccl on AWS with aws.efa,
    InfiniBand/RoCE verbs on bare metal with tuning.rdma, TCP sockets otherwise."""
    if cluster.target is Target.AWS:
        return NET_EFA if cluster.aws and cluster.aws.efa else NET_SOCKET
    return NET_IB if cluster.tuning.rdma else NET_SOCKET


def environment(cluster: ClusterConfig, interface: str | None = None) -> dict[str, str]:
    """The NCCL and Gloo environment of every member of every replica, the same on head and
    workers (cause 9 of the table: variables on the head only). `interface`, when the config
    names it (bareMetal.interface), pins both variables here; otherwise interface_prelude()
    exports them when the container starts."""
    env = {"NCCL_NET": transport(cluster), **DEBUG_ENV}
    if env["NCCL_NET"] == NET_SOCKET:
        env["NCCL_IB_DISABLE"] = "1"  # nothing to probe: the stack says there is no RDMA
    if env["NCCL_NET"] == NET_EFA:
        env["FI_PROVIDER"] = "efa"  # libfabric: EFA or nothing, never its TCP provider
    if interface:
        env |= interface_environment(interface)
    return env


def interface_environment(interface: str) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME is a list of name prefixes, `=` makes it exact (NCCL env.html: "=eth0:
    use only interface eth0"), so eth1 never matches eth10; GLOO_SOCKET_IFNAME is one name."""
    return {"NCCL_SOCKET_IFNAME": f"={interface}", "GLOO_SOCKET_IFNAME": interface}


def interface_prelude(ucx_tcp: bool = False) -> str:
    """Bash run first in the model server's container: the interface holding VLLM_HOST_IP, found
    by the one finder (nic.py, in Python: the vLLM image has no iproute2), exported as the two
    variables; a container whose address no interface holds stops here, naming it. `ucx_tcp`
    (disaggregated over UCX without RDMA: kvtransfer.over_tcp): NIXL's UCX gets the same NIC
    (UCX_NET_DEVICES), so the KV leaves by the cluster interface, not whichever UCX picks."""
    ucx = (
        'if [ -z "${UCX_NET_DEVICES:-}" ]; then export UCX_NET_DEVICES="$GLOO_SOCKET_IFNAME"; fi\n'
        if ucx_tcp
        else ""
    )
    return (
        'if [ -z "${GLOO_SOCKET_IFNAME:-}" ]; then\n'
        '  iface=$(python3 -c "$QWEN_FIND_INTERFACE" "$VLLM_HOST_IP")\n'
        '  if [ -z "$iface" ]; then echo "no interface holds VLLM_HOST_IP $VLLM_HOST_IP" >&2; exit 1; fi\n'
        '  export NCCL_SOCKET_IFNAME="=$iface" GLOO_SOCKET_IFNAME="$iface"\n'
        "fi\n"
    ) + ucx


def finder_environment() -> dict[str, str]:
    """The finder's source for interface_prelude (an environment variable: no file to mount)."""
    return {"QWEN_FIND_INTERFACE": nic.FINDER}


@dataclass(frozen=True)
class Settings:
    ipc_mode: str
    memlock: int | None  # None: docker's default (no RDMA to register memory for)
    devices: tuple[str, ...]
    capabilities: tuple[str, ...]


def container_settings(cluster: ClusterConfig) -> Settings:
    """What the model server's container needs for NCCL: host IPC (/dev/shm), and with RDMA or
    EFA the verbs devices, an unlimited memlock and IPC_LOCK (causes 3 to 6 of the table)."""
    fast = transport(cluster) != NET_SOCKET
    return Settings(
        ipc_mode=IPC_MODE,
        memlock=UNLIMITED if fast else None,
        devices=(RDMA_DEVICE,) if fast else (),
        capabilities=("IPC_LOCK",) if fast else (),
    )


def docker_run_options(cluster: ClusterConfig) -> list[str]:
    settings = container_settings(cluster)
    options = [f"--ipc={settings.ipc_mode}"]
    if settings.memlock is not None:
        options.append(f"--ulimit=memlock={settings.memlock}")
    options += [f"--device={device}" for device in settings.devices]
    options += [f"--cap-add={capability}" for capability in settings.capabilities]
    return options
