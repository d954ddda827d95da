"""The model servers (vLLM) and the load balancer (nginx) as containers over `ssh://`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components import catalog
from components.config import ClusterConfig, Node
from components.render import nginx

# Pinned: a moving tag would change the load balancer on the next `pulumi up`.
NGINX_IMAGE = "nginx:1.27.3"
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
    """The bash entry command and environment of one node's container (pure)."""
    topology = cluster.topology
    replica = topology.replica_of(node.name)
    head = replica.head
    ports = topology.ports
    is_head = head.name == node.name
    env = {
        "VLLM_HOST_IP": str(node.ip),
        "VLLM_PORT": str(ports.vllm.low),
        "RAY_ADDRESS": f"{head.ip}:{ports.gcs}",
    }
    if cluster.bare_metal.interface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = cluster.bare_metal.interface
    if not cluster.tuning.rdma:
        env["NCCL_IB_DISABLE"] = "1"
    find = (
        'iface="${NCCL_SOCKET_IFNAME:-$(python3 -c "$QWEN_FIND_INTERFACE")}"\n'
        'export NCCL_SOCKET_IFNAME="$iface" GLOO_SOCKET_IFNAME="$iface"\n'
    )
    serve = [
        "vllm",
        "serve",
        cluster.model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(cluster.model_port),
        "--tensor-parallel-size",
        str(cluster.model.tensor_parallel),
        "--pipeline-parallel-size",
        str(cluster.model.pipeline_parallel),
        "--gpu-memory-utilization",
        str(catalog.GPU_MEMORY_UTILIZATION),
    ]
    if cluster.model.pipeline_parallel == 1:
        script = find + "exec " + shlex.join(serve)
    elif is_head:
        ray = ["ray", "start", *ports.ray_start_args(head=True), f"--node-ip-address={node.ip}"]
        script = (
            find + shlex.join(ray) + "\nexec " + shlex.join([*serve, "--distributed-executor-backend", "ray"])
        )
    else:
        ray = [
            "ray",
            "start",
            *ports.ray_start_args(head=False, head_ip=head.ip),
            f"--node-ip-address={node.ip}",
        ]
        script = find + "exec " + shlex.join([*ray, "--block"])
    env["QWEN_FIND_INTERFACE"] = _FIND_INTERFACE
    return script, env


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
    connection: remote.ConnectionArgs  # to bareMetal.loadBalancerNode
    depends_on: list[pulumi.Resource] = field(default_factory=list)


class LoadBalancer(pulumi.ComponentResource):
    """nginx on bareMetal.loadBalancerNode, host networking. Its configuration is a directory
    on the host (nginx.CONF_DIR), written by a command and mounted read-only: a node joining
    or leaving rewrites the upstream file and reloads nginx, and the container stays.

    The command's `triggers` hold only the host: pulumi-command replaces on `triggers` alone
    (common/inputs.go), so a changed config is an update, which runs `create` again
    (remote/commandController.go `Update`). The container's inputs no longer carry the config:
    `upload` is ForceNew in kreuzwerker/terraform-provider-docker (v4.5.0, the provider
    pulumi-docker 5.x wraps; internal/provider/resource_docker_container.go), so a changed
    upload meant a new container, and every stream in flight cut."""

    def __init__(self, name: str, args: LoadBalancerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:LoadBalancer", name, None, opts)
        self.config_text = nginx.for_cluster(args.cluster, upstream_file=nginx.UPSTREAM_FILE)
        self.config = remote.Command(
            f"{name}-config",
            connection=args.connection,
            create=nginx.install_script(self.config_text, nginx.upstream_servers(args.cluster)),
            delete=nginx.remove_script(),
            triggers=[str(args.cluster.load_balancer_node.ip)],
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.depends_on),
        )
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)
        self.image = docker.RemoteImage(f"{name}-image", name=NGINX_IMAGE, keep_locally=True, opts=on_host)
        self.container = docker.Container(
            f"{name}-nginx",
            name=nginx.CONTAINER_NAME,
            image=self.image.name,  # the pinned tag; the Output orders the pull first
            command=["nginx", "-c", f"{nginx.CONTAINER_CONF_DIR}/{nginx.CONF_FILE}", "-g", "daemon off;"],
            network_mode="host",
            restart="unless-stopped",
            volumes=[
                docker.ContainerVolumeArgs(
                    host_path=nginx.CONF_DIR,
                    container_path=nginx.CONTAINER_CONF_DIR,
                    read_only=True,
                    # SELinux hosts: the container's own label, so nginx may read the files
                    # (new files written in the directory inherit it); elsewhere ignored.
                    selinux_relabel="Z",
                )
            ],
            labels=[docker.ContainerLabelArgs(label="qwen-cluster.role", value="load-balancer")],
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                depends_on=[*args.depends_on, self.config],
                # A fixed name and host ports: the old container must go first. pulumi-docker
                # sets this for docker_container itself (provider/resources.go
                # `DeleteBeforeReplace: true`); said here too, as the design depends on it.
                delete_before_replace=True,
            ),
        )
        self.register_outputs({"container": self.container.id, "config": self.config.id})
