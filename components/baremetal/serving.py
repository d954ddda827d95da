"""The model servers (vLLM) and the load balancer (nginx) as containers over `ssh://`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components.baremetal import connection
from qwen_cluster import tags, topology
from qwen_cluster.config import ClusterConfig, EndpointSecrets, Node
from qwen_cluster.render import collective, kvtransfer, nginx, vllm, weights

NGINX_IMAGE = nginx.IMAGE  # pinned (qwen_cluster/render/nginx.py)


def server_command(cluster: ClusterConfig, node: Node) -> tuple[str, dict[str, str]]:
    """The bash entry command and environment of one node's container (pure): the shared vLLM
    command (qwen_cluster/render/vllm.py) after finding the cluster interface, with what every
    member of a replica needs for NCCL and Gloo (qwen_cluster/render/collective.py)."""
    env = {
        **vllm.environment(cluster, node.name),
        **weights.server_environment(cluster),
        **collective.environment(cluster, cluster.bare_metal.interface),
    }
    if not cluster.bare_metal.interface:
        env |= collective.finder_environment()
    prelude = collective.interface_prelude(ucx_tcp=kvtransfer.over_tcp(cluster))
    return vllm.server_script(cluster, node.name, prelude=prelude), env


# docker_container fields a change of which the provider applies in place (kreuzwerker/
# terraform-provider-docker v4.5.0 resource_docker_container_funcs.go resourceDockerContainerUpdate:
# restart, max_retry_count, cpu_shares, memory*, cpu_set, device_*); every other field we set
# is ForceNew (resource_docker_container.go), so a change of it replaces the container.
# destroy_grace_seconds is neither ForceNew nor applied by the update (resource_docker_container.go
# schema; resourceDockerContainerDelete reads it when the container goes): a change is stored only.
IN_PLACE_FIELDS = frozenset({"restart", "destroy_grace_seconds"})


def model_container_spec(cluster: ClusterConfig, node: Node) -> dict[str, Any]:
    """Everything one node's vLLM container is given, as plain data (pure). The rollout
    fingerprints the ForceNew part of it (`replacing_fields`), so the drain and health gate of
    a replica change exactly when one of its containers will be replaced."""
    script, env = server_command(cluster, node)
    settings = collective.container_settings(cluster)
    role = tags.HEAD_CONTAINER if cluster.topology.is_head(node.name) else tags.PIPELINE_WORKER_CONTAINER
    spec: dict[str, Any] = {
        "name": tags.MODEL_SERVER_CONTAINER,
        "image": cluster.model.image,
        "entrypoints": ["/bin/bash", "-c"],
        "command": [script],
        "envs": [f"{key}={value}" for key, value in sorted(env.items())],
        # Host networking: NCCL, Ray and vLLM bind the node IP on the pinned ports, and the
        # host firewall (not Docker's NAT) decides who reaches them.
        "network_mode": "host",
        # NCCL's /dev/shm (collective.py): the host's, never docker's 64 MiB.
        "ipc_mode": settings.ipc_mode,
        "gpus": "all",
        # No shm_size: with host IPC the container shares the host's /dev/shm.
        "restart": "unless-stopped",
        # vLLM's graceful shutdown must end before docker's SIGKILL (vllm.stop_grace_seconds):
        # stop_timeout for `docker stop` and the daemon's own stops (ForceNew), and
        # destroy_grace_seconds for the provider's delete, which otherwise stops with timeout 0
        # (terraform-provider-docker resource_docker_container_funcs.go
        # resourceDockerContainerDelete: ContainerStop with Timeout destroy_grace_seconds).
        "stop_timeout": vllm.stop_grace_seconds(cluster),
        "destroy_grace_seconds": vllm.stop_grace_seconds(cluster),
        # The host cache staging fills (bareMetal.weightsCache): it outlives the container. On an
        # SELinux host it needs a label the container may write; `z` is shared with the staging
        # container, which writes the same files (weights.stage_script); elsewhere ignored.
        "volumes": [
            {
                "host_path": cluster.bare_metal.weights_cache,
                "container_path": weights.CONTAINER_CACHE,
                "selinux_relabel": "z",
            }
        ],
        "labels": [{"label": tags.CONTAINER_ROLE_LABEL, "value": role}],
    }
    # With RDMA: the verbs devices, pinned memory (collective.container_settings).
    if settings.capabilities:
        spec["capabilities"] = {"adds": list(settings.capabilities)}
    if settings.devices:
        spec["devices"] = [{"host_path": device} for device in settings.devices]
    if settings.memlock is not None:
        spec["ulimits"] = [{"name": "memlock", "soft": settings.memlock, "hard": settings.memlock}]
    return spec


def replacing_fields(spec: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in spec.items() if key not in IN_PLACE_FIELDS}


@dataclass(frozen=True)
class ModelServerArgs:
    cluster: ClusterConfig
    node: Node
    docker_host: str
    ssh_opts: list[str]
    connection: remote.ConnectionArgs  # to the node, for the staging command
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    # qwen-cluster:rayAuthToken (an Output secret) when the replica spans nodes, else None.
    ray_auth_token: pulumi.Input[str] | None = None
    # What the container's (re)placement waits for besides `depends_on`: its replica's drain. The
    # Rollout registers the drain after this component (the drain waits for every node's staging,
    # registered here), so it arrives as an Input that resolves later (pulumi.deferred_output,
    # public since pulumi 3.x: sdk/python/lib/pulumi/output.py deferred_output); `depends_on`
    # awaits Inputs among its items (sdk/python/lib/pulumi/runtime/_depends_on.py).
    drained: pulumi.Input[pulumi.Resource] | None = None


def container_envs(spec: dict[str, Any], ray_auth_token: pulumi.Input[str] | None) -> pulumi.Input[list[str]]:
    """The container's environment: the spec's, and with Ray the token, added inside the secret's
    apply so the whole list stays secret (the plan shows [secret], never the token). `envs` is
    ForceNew (IN_PLACE_FIELDS), so a new token replaces the replica's containers."""
    if ray_auth_token is None:
        return spec["envs"]
    return pulumi.Output.secret(ray_auth_token).apply(
        lambda token: [
            *spec["envs"],
            *(f"{key}={value}" for key, value in sorted(topology.ray_auth_environment(token).items())),
        ]
    )


def token_tag(ray_auth_token: pulumi.Input[str] | None) -> pulumi.Output[str] | None:
    """A short digest of the Ray token, not secret, for the rollout's fingerprint: a new token
    replaces the replica's containers (`envs` is ForceNew), so it must drain the replica first,
    and the drain runs only when its fingerprint changes. The token is random
    (`openssl rand -hex 32`, 256 bits): 64 bits of a labelled SHA-256 of it tell nothing usable."""
    if ray_auth_token is None:
        return None
    digest = pulumi.Output.secret(ray_auth_token).apply(
        lambda token: hashlib.sha256(f"qwen-cluster rollout: {token}".encode()).hexdigest()[:16]
    )
    return pulumi.Output.unsecret(digest)


class ModelServer(pulumi.ComponentResource):
    """One node's vLLM container (a replica head, or a pipeline worker running Ray).

    The staging command, the Docker provider and the image start right after host setup, on every
    node in parallel, on day 0 and before a rolling upgrade reaches the node; the container waits
    besides for `args.drained`, its replica's drain in the rollout chain (components/baremetal/
    rollout.py), which the Rollout registers after this component.

    `stage` (`<node>-model-stage`) pulls the image and fetches the weights into
    bareMetal.weightsCache while the old container still serves (weights.stage_script). Its
    `triggers` hold the node's address alone and its `create` is the script, whose text changes
    exactly when the image, model.name, model.weights or the cache do: pulumi-command replaces a
    Command only on `triggers` (the one input tagged replaceOnChanges, pulumi/pulumi-command
    provider/pkg/provider/common/inputs.go) and runs `create` again on any other change
    (remote/commandController.go Update, without an `update`). So a new image or new weights
    re-run the staging in place, and nothing else does. No `delete`: the cache outlives the
    node's containers (a node leaving keeps its files; removing them is the operator's call).
    The image resource then finds the image on the host and pulls nothing
    (terraform-provider-docker resource_docker_image_funcs.go findImage: local images first).

    The container is replaced delete-before-replace: a fixed name and host ports cannot be
    held twice (pulumi/pulumi-docker provider/resources.go sets `DeleteBeforeReplace: true`
    for docker_container; said here too, as the rollout depends on it). The engine generates
    the delete only when the container registers (pulumi/pulumi pkg/resource/deploy/
    step_generator.go, continueStepsFromDiff: DeleteReplacement, Replace, CreateReplacement
    steps of one registration), and the program registers it only after its `depends_on` have
    finished (the SDK waits for their RegisterResource answers, which the engine sends once
    their steps are done). So the old container goes after its replica's drain, never before.
    calculateDependentReplacements (same file) deletes ahead only dependents whose *inputs*
    come from the container; the health gate depends on it by `depends_on` alone, so nothing
    is deleted ahead of the drain. The image is replaced create-before-delete (docker_image has
    no DeleteBeforeReplace in resources.go and no auto-named field), so it cascades nothing."""

    def __init__(self, name: str, args: ModelServerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:ModelServer", name, None, opts)
        self.token_tag = token_tag(args.ray_auth_token)
        self.spec = model_container_spec(args.cluster, args.node)
        self.provider = docker.Provider(
            f"{name}-docker",
            host=args.docker_host,
            ssh_opts=args.ssh_opts,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.stage = connection.command(
            f"{name}-stage",
            connection=args.connection,
            create=weights.stage_script(args.cluster, args.cluster.bare_metal.weights_cache),
            triggers=[str(args.node.ip)],
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.depends_on),
        )
        on_host = pulumi.ResourceOptions(
            parent=self, provider=self.provider, depends_on=[*args.depends_on, self.stage]
        )
        self.image = docker.RemoteImage(
            f"{name}-image", name=args.cluster.model.image, keep_locally=True, opts=on_host
        )
        spec = self.spec
        drained = [args.drained] if args.drained is not None else []
        self.container = docker.Container(
            f"{name}-vllm",
            name=spec["name"],
            image=self.image.name,  # the pinned tag (spec["image"]); the Output orders the pull first
            entrypoints=spec["entrypoints"],
            command=spec["command"],
            envs=container_envs(spec, args.ray_auth_token),
            network_mode=spec["network_mode"],
            ipc_mode=spec["ipc_mode"],
            gpus=spec["gpus"],
            restart=spec["restart"],
            capabilities=docker.ContainerCapabilitiesArgs(**spec["capabilities"])
            if "capabilities" in spec
            else None,
            devices=[docker.ContainerDeviceArgs(**device) for device in spec.get("devices", [])] or None,
            ulimits=[docker.ContainerUlimitArgs(**limit) for limit in spec.get("ulimits", [])] or None,
            volumes=[docker.ContainerVolumeArgs(**volume) for volume in spec["volumes"]],
            labels=[docker.ContainerLabelArgs(**label) for label in spec["labels"]],
            stop_timeout=spec["stop_timeout"],
            destroy_grace_seconds=spec["destroy_grace_seconds"],
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=self.provider,
                depends_on=[*args.depends_on, self.stage, *drained],
                delete_before_replace=True,
            ),
        )
        self.register_outputs({"container": self.container.id})


def secret_stdin(secrets: EndpointSecrets) -> pulumi.Output[str] | None:
    """The install script's stdin (nginx.secrets_bundle), a secret; None without any secret."""
    parts = (secrets.api_keys, secrets.tls_certificate, secrets.tls_private_key)
    if all(part is None for part in parts):
        return None
    bundle = pulumi.Output.all(*parts).apply(lambda values: nginx.secrets_bundle(*values))
    return pulumi.Output.secret(bundle)


@dataclass(frozen=True)
class LoadBalancerArgs:
    cluster: ClusterConfig
    provider: docker.Provider
    connection: remote.ConnectionArgs  # to bareMetal.loadBalancerNode
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    # API keys and TLS files, Output secrets (config.EndpointSecrets).
    secrets: EndpointSecrets = field(default_factory=EndpointSecrets)


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
        self.config = connection.command(
            f"{name}-config",
            connection=args.connection,
            create=nginx.install_script(
                self.config_text,
                nginx.upstream_servers(args.cluster),
                router_at=nginx.router_server(args.cluster),
            ),
            delete=nginx.remove_script(),
            # The keys and TLS files travel on stdin, a secret input (pulumi-command marks the
            # state secret and the plan shows [secret]); the script stays plain text. A changed
            # stdin is an update, which runs `create` again (pulumi-command remote
            # commandController.go `Update`; only `triggers` replace, common/inputs.go): the
            # files are rewritten and nginx reloads; no container is touched.
            stdin=secret_stdin(args.secrets),
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
            # nginx raises its workers' descriptor limit to worker_rlimit_nofile; inside a container
            # (no CAP_SYS_RESOURCE) only up to the hard limit the container starts with.
            ulimits=[
                docker.ContainerUlimitArgs(
                    name="nofile", soft=nginx.WORKER_RLIMIT_NOFILE, hard=nginx.WORKER_RLIMIT_NOFILE
                )
            ],
            labels=[
                docker.ContainerLabelArgs(label=tags.CONTAINER_ROLE_LABEL, value=tags.LOAD_BALANCER_CONTAINER)
            ],
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                depends_on=[*args.depends_on, self.config],
                # `image` and `ulimit` are ForceNew in terraform-provider-docker
                # (internal/provider/resource_docker_container.go): a new nginx image replaces the
                # container. Its name and host ports are fixed, so the old one must go first
                # (pulumi-docker sets this for docker_container itself, provider/resources.go
                # `DeleteBeforeReplace: true`; said here too, as the design depends on it).
                delete_before_replace=True,
            ),
        )
        self.register_outputs({"container": self.container.id, "config": self.config.id})
