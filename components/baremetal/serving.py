"""The model servers (vLLM) and the load balancer (nginx) as containers over `ssh://`."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_docker as docker

from components.config import ClusterConfig, Node
from components.render import nginx, vllm

# Pinned: a moving tag would change the load balancer on the next `pulumi up`. 1.30 is nginx's
# stable line (1.31 mainline); 1.27 and 1.28 get no more fixes. gixy-ng checks the rendered config
# against its CVE table for this version (tests/test_render_nginx.py).
NGINX_IMAGE = "nginx:1.30.6"
NGINX_CONF = "/etc/nginx/nginx.conf"
HF_CACHE = "/root/.cache/huggingface"
UNLIMITED = -1

# Finds the NIC that holds VLLM_HOST_IP when bareMetal.interface is not set (host network:
# the container sees the host's interfaces). Python is in every vLLM image; iproute2 is not.
_FIND_INTERFACE = (
    "import fcntl,os,socket,struct\n"
    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
    "for _,n in socket.if_nameindex():\n"
    "    try:\n"
    "        a=fcntl.ioctl(s.fileno(),0x8915,struct.pack('256s',n.encode()[:15]))[20:24]\n"
    "    except OSError:\n"
    "        continue\n"
    "    if socket.inet_ntoa(a)==os.environ['VLLM_HOST_IP']:\n"
    "        print(n);break\n"
)


def server_command(cluster: ClusterConfig, node: Node) -> tuple[str, dict[str, str]]:
    """The bash entry command and environment of one node's container (pure): the shared vLLM
    command (components/render/vllm.py) after finding the cluster interface."""
    env = vllm.environment(cluster, node.name)
    if cluster.bare_metal.interface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = cluster.bare_metal.interface
    if not cluster.tuning.rdma:
        env["NCCL_IB_DISABLE"] = "1"
    find = (
        'iface="${NCCL_SOCKET_IFNAME:-$(python3 -c "$QWEN_FIND_INTERFACE")}"\n'
        'export NCCL_SOCKET_IFNAME="$iface" GLOO_SOCKET_IFNAME="$iface"\n'
    )
    env["QWEN_FIND_INTERFACE"] = _FIND_INTERFACE
    return vllm.server_script(cluster, node.name, prelude=find), env


@dataclass(frozen=True)
class ModelServerArgs:
    cluster: ClusterConfig
    node: Node
    docker_host: str
    ssh_opts: list[str]
    depends_on: list[pulumi.Resource] = field(default_factory=list)


class ModelServer(pulumi.ComponentResource):
    """One node's vLLM container (a replica head, or a pipeline worker running Ray)."""

    def __init__(self, name: str, args: ModelServerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:ModelServer", name, None, opts)
        cluster, node = args.cluster, args.node
        self.provider = docker.Provider(
            f"{name}-docker",
            host=args.docker_host,
            ssh_opts=args.ssh_opts,
            opts=pulumi.ResourceOptions(parent=self),
        )
        on_host = pulumi.ResourceOptions(parent=self, provider=self.provider, depends_on=args.depends_on)
        self.image = docker.RemoteImage(
            f"{name}-image", name=cluster.model.image, keep_locally=True, opts=on_host
        )
        script, env = server_command(cluster, node)
        rdma = cluster.tuning.rdma
        role = "head" if cluster.topology.is_head(node.name) else "pipeline-worker"
        self.container = docker.Container(
            f"{name}-vllm",
            name=f"qwen-{role}",
            image=self.image.name,  # the pinned tag; the Output orders the pull first
            entrypoints=["/bin/bash", "-c"],
            command=[script],
            envs=[f"{key}={value}" for key, value in sorted(env.items())],
            # Host networking: NCCL, Ray and vLLM bind the node IP on the pinned ports, and the
            # host firewall (not Docker's NAT) decides who reaches them.
            network_mode="host",
            ipc_mode="host",
            gpus="all",
            # No shm_size: with host IPC the container shares the host's /dev/shm.
            restart="unless-stopped",
            capabilities=docker.ContainerCapabilitiesArgs(adds=["IPC_LOCK"]) if rdma else None,
            devices=[docker.ContainerDeviceArgs(host_path="/dev/infiniband")] if rdma else None,
            ulimits=[docker.ContainerUlimitArgs(name="memlock", soft=UNLIMITED, hard=UNLIMITED)]
            if rdma
            else None,
            volumes=[
                docker.ContainerVolumeArgs(
                    host_path="/var/cache/qwen-cluster/huggingface",
                    container_path=HF_CACHE,
                    # On an SELinux host the cache needs the container's label to be writable
                    # (a private one: only this container uses it); elsewhere Docker ignores it.
                    selinux_relabel="Z",
                )
            ],
            labels=[docker.ContainerLabelArgs(label="qwen-cluster.role", value=role)],
            opts=pulumi.ResourceOptions(parent=self, provider=self.provider, depends_on=args.depends_on),
        )
        self.register_outputs({"container": self.container.id})


@dataclass(frozen=True)
class LoadBalancerArgs:
    cluster: ClusterConfig
    provider: docker.Provider
    depends_on: list[pulumi.Resource] = field(default_factory=list)


class LoadBalancer(pulumi.ComponentResource):
    """nginx on bareMetal.loadBalancerNode with the rendered config, host networking."""

    def __init__(self, name: str, args: LoadBalancerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:LoadBalancer", name, None, opts)
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)
        self.config_text = nginx.for_cluster(args.cluster)
        self.image = docker.RemoteImage(f"{name}-image", name=NGINX_IMAGE, keep_locally=True, opts=on_host)
        self.container = docker.Container(
            f"{name}-nginx",
            name="qwen-nginx",
            image=self.image.name,  # the pinned tag; the Output orders the pull first
            network_mode="host",
            restart="unless-stopped",
            uploads=[docker.ContainerUploadArgs(file=NGINX_CONF, content=self.config_text)],
            # nginx raises its workers' descriptor limit to worker_rlimit_nofile; inside a container
            # (no CAP_SYS_RESOURCE) only up to the hard limit the container starts with.
            ulimits=[
                docker.ContainerUlimitArgs(
                    name="nofile", soft=nginx.WORKER_RLIMIT_NOFILE, hard=nginx.WORKER_RLIMIT_NOFILE
                )
            ],
            labels=[docker.ContainerLabelArgs(label="qwen-cluster.role", value="load-balancer")],
            # `image` and `ulimit` are ForceNew in terraform-provider-docker
            # (internal/provider/resource_docker_container.go): a new nginx image replaces the
            # container. Its name and host ports are fixed, so the old one must go first.
            opts=pulumi.ResourceOptions.merge(on_host, pulumi.ResourceOptions(delete_before_replace=True)),
        )
        self.register_outputs({"container": self.container.id})
