"""Monitoring on bare metal: every node's :8000 endpoint and its exporters, and Prometheus +
Alertmanager on `monitoring.node`, all pinned containers on host networking.

What a change does on `pulumi up` (tooling/changes/rules.py, from the providers' source):
- A docker_container input change replaces the container, delete-before-replace
  (kreuzwerker/terraform-provider-docker resource_docker_container.go marks its fields
  ForceNew; pulumi-docker sets DeleteBeforeReplace, so the fixed name and host ports are free
  before the new one starts). The exporters' configs are uploads, so a new peer replaces this
  node's endpoint containers only; the model server is a separate resource and never moves.
- With monitoring.tls (and monitoring.password), their web config, their certificate file and
  Prometheus's password file are written by the same command (a new password or certificate: a
  new file, read by both servers on the next request or connection).
- Prometheus's and Alertmanager's files (scrape config, rules, routes) are not container
  inputs: a remote Command writes them on the host, and a change of its `create` is an
  in-place update that runs it again (pulumi/pulumi-command: only `triggers` replaces; Update
  re-runs `create` when there is no `update`), which rewrites the files and sends SIGHUP. A new
  alert bound therefore reloads Prometheus's rules and restarts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components.baremetal import connection
from qwen_cluster import tags
from qwen_cluster.config import ClusterConfig, Node
from qwen_cluster.node import NODEMETRICS_SCRIPT
from qwen_cluster.render.monitoring import containers


@dataclass(frozen=True)
class NodeMonitoringArgs:
    cluster: ClusterConfig
    node: Node
    provider: docker.Provider  # the node's docker provider (ssh://), shared with its model server
    depends_on: list[pulumi.Resource] = field(default_factory=list)


def register(
    resource_name: str, spec: containers.ContainerSpec, opts: pulumi.ResourceOptions
) -> docker.Container:
    """A ContainerSpec (qwen_cluster/render/monitoring/containers.py) as a pinned host-network container."""
    image = docker.RemoteImage(f"{resource_name}-image", name=spec.image, keep_locally=True, opts=opts)
    # Plain binds are volumes; a bind with a propagation mode needs the `mounts` form.
    volumes = [
        docker.ContainerVolumeArgs(
            host_path=mount.host, container_path=mount.container, read_only=mount.read_only or None
        )
        for mount in spec.mounts
        if not mount.propagation
    ]
    mounts = [
        docker.ContainerMountArgs(
            target=mount.container,
            source=mount.host,
            type="bind",
            read_only=mount.read_only or None,
            bind_options=docker.ContainerMountBindOptionsArgs(propagation=mount.propagation),
        )
        for mount in spec.mounts
        if mount.propagation
    ]
    return docker.Container(
        resource_name,
        name=spec.name,
        image=image.name,  # the pinned tag; the Output orders the pull first
        network_mode="host",
        restart="unless-stopped",
        command=list(spec.command) or None,
        entrypoints=list(spec.entrypoint) or None,
        uploads=[docker.ContainerUploadArgs(file=path, content=text) for path, text in spec.files] or None,
        volumes=volumes or None,
        mounts=mounts or None,
        capabilities=docker.ContainerCapabilitiesArgs(adds=list(spec.capabilities))
        if spec.capabilities
        else None,
        gpus="all" if spec.gpus else None,
        pid_mode="host" if spec.pid_host else None,
        labels=[docker.ContainerLabelArgs(label=tags.CONTAINER_ROLE_LABEL, value=tags.MONITORING_CONTAINER)],
        opts=opts,
    )


class NodeMonitoring(pulumi.ComponentResource):
    """One node's exporters (bound to loopback) and its :8000 endpoint."""

    def __init__(self, name: str, args: NodeMonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:NodeMonitoring", name, None, opts)
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)
        specs = containers.node_containers(args.cluster, args.node.name, NODEMETRICS_SCRIPT.read_text())
        self.containers = {spec.role: register(f"{name}-{spec.role}", spec, on_host) for spec in specs}
        self.register_outputs({role: container.id for role, container in self.containers.items()})


@dataclass(frozen=True)
class ClusterMonitoringArgs:
    cluster: ClusterConfig
    provider: docker.Provider  # the monitoring node's
    connection: remote.ConnectionArgs  # the monitoring node's
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    # monitoring.password, an Output secret (None: Prometheus and Alertmanager ask for nothing).
    password: pulumi.Input[str] | None = None
    # monitoring.tls's chain and key, Output secrets (None: the servers speak plain HTTP).
    tls_certificate: pulumi.Input[str] | None = None
    tls_private_key: pulumi.Input[str] | None = None


class ClusterMonitoring(pulumi.ComponentResource):
    """Prometheus and Alertmanager on `monitoring.node`, configs on the host, reloaded in place."""

    def __init__(self, name: str, args: ClusterMonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:ClusterMonitoring", name, None, opts)
        cluster = args.cluster
        files = containers.server_files(cluster)
        create: pulumi.Input[str] = containers.server_files_script(files)
        if containers.tls(cluster):
            if args.tls_certificate is None or args.tls_private_key is None:
                raise ValueError("monitoring.tls needs its certificate and private key as secrets")
            # The secret files ride in the same script, so the step stays one Output secret; its
            # text is the same for the same secrets (webconfig.py: the hash's salt comes from the
            # stack), so unchanged secrets change nothing on `up`.
            stack = pulumi.get_stack()
            password = args.password if containers.credentials(cluster) else None
            create = pulumi.Output.secret(
                pulumi.Output.all(args.tls_certificate, args.tls_private_key, password)
            ).apply(
                lambda values: containers.server_files_script(
                    files,
                    secret_files=containers.secret_files(
                        stack, certificate=values[0], private_key=values[1], password=values[2]
                    ),
                )
            )
        self.files = connection.command(
            f"{name}-config",
            connection=args.connection,
            create=create,
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.depends_on),
        )
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[self.files])
        specs = containers.server_containers(cluster)
        self.containers = {spec.role: register(f"{name}-{spec.role}", spec, on_host) for spec in specs}
        self.register_outputs({role: container.id for role, container in self.containers.items()})
