"""Monitoring on bare metal: every node's :8000 endpoint and its exporters, and Prometheus +
Alertmanager on `monitoring.node`, all pinned containers on host networking.

What a change does on `pulumi up` (components/changes.py RULES, from the providers' source):
- A docker_container input change replaces the container, delete-before-replace
  (kreuzwerker/terraform-provider-docker resource_docker_container.go marks its fields
  ForceNew; pulumi-docker sets DeleteBeforeReplace, so the fixed name and host ports are free
  before the new one starts). The exporters' configs are uploads, so a new peer replaces this
  node's endpoint containers only; the model server is a separate resource and never moves.
- Prometheus's and Alertmanager's files (scrape config, rules, routes) are not container
  inputs: a remote Command writes them on the host, and a change of its `create` is an
  in-place update that runs it again (pulumi/pulumi-command: only `triggers` replaces; Update
  re-runs `create` when there is no `update`), which rewrites the files and sends SIGHUP. A new
  alert bound therefore reloads Prometheus's rules and restarts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_docker as docker
from pulumi_command import remote

from components.config import ClusterConfig, Node
from components.render import monitoring

NODEMETRICS_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "nodemetrics.py"
IN_CONTAINER = "/etc/qwen-monitoring"


@dataclass(frozen=True)
class NodeMonitoringArgs:
    cluster: ClusterConfig
    node: Node
    provider: docker.Provider  # the node's docker provider (ssh://), shared with its model server
    depends_on: list[pulumi.Resource] = field(default_factory=list)


def _container(
    resource_name: str, image: docker.RemoteImage, opts: pulumi.ResourceOptions, **kwargs
) -> docker.Container:
    return docker.Container(
        resource_name,
        image=image.name,  # the pinned tag; the Output orders the pull first
        network_mode="host",
        restart="unless-stopped",
        labels=[docker.ContainerLabelArgs(label="qwen-cluster.role", value="monitoring")],
        opts=opts,
        **kwargs,
    )


class NodeMonitoring(pulumi.ComponentResource):
    """One node's exporters (bound to loopback) and its :8000 endpoint."""

    def __init__(self, name: str, args: NodeMonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:NodeMonitoring", name, None, opts)
        cluster, node = args.cluster, args.node
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)

        def image(role: str, ref: str) -> docker.RemoteImage:
            return docker.RemoteImage(f"{name}-{role}-image", name=ref, keep_locally=True, opts=on_host)

        self.containers: dict[str, docker.Container] = {}
        self.containers["node-exporter"] = _container(
            f"{name}-node-exporter",
            image("node-exporter", monitoring.NODE_EXPORTER_IMAGE),
            on_host,
            name="qwen-node-exporter",
            command=monitoring.node_exporter_args(rootfs="/host"),
            pid_mode="host",
            # node_exporter's README (Docker): the host's / read-only at /host, rslave so mounts
            # made later (a new disk) show up too.
            mounts=[
                docker.ContainerMountArgs(
                    target="/host",
                    source="/",
                    type="bind",
                    read_only=True,
                    bind_options=docker.ContainerMountBindOptionsArgs(propagation="rslave"),
                )
            ],
        )
        blackbox_file = f"{IN_CONTAINER}/blackbox.yml"
        self.containers["blackbox-exporter"] = _container(
            f"{name}-blackbox-exporter",
            image("blackbox-exporter", monitoring.BLACKBOX_EXPORTER_IMAGE),
            on_host,
            name="qwen-blackbox-exporter",
            command=monitoring.blackbox_args(blackbox_file),
            uploads=[
                docker.ContainerUploadArgs(file=blackbox_file, content=monitoring.blackbox_config(cluster))
            ],
            # ICMP echo needs a raw socket.
            capabilities=docker.ContainerCapabilitiesArgs(adds=["NET_RAW"]),
        )
        if cluster.gpus_per_node > 0:
            counters = f"{IN_CONTAINER}/dcgm-counters.csv"
            # NVIDIA's quick start: --gpus all --cap-add SYS_ADMIN (github.com/NVIDIA/dcgm-exporter).
            self.containers["dcgm-exporter"] = _container(
                f"{name}-dcgm-exporter",
                image("dcgm-exporter", monitoring.DCGM_EXPORTER_IMAGE),
                on_host,
                name="qwen-dcgm-exporter",
                command=monitoring.dcgm_args(counters),
                gpus="all",
                capabilities=docker.ContainerCapabilitiesArgs(adds=["SYS_ADMIN"]),
                uploads=[docker.ContainerUploadArgs(file=counters, content=monitoring.DCGM_COUNTERS)],
            )
        script, config = f"{IN_CONTAINER}/nodemetrics.py", f"{IN_CONTAINER}/nodemetrics.json"
        self.containers["nodemetrics"] = _container(
            f"{name}-nodemetrics",
            image("nodemetrics", monitoring.AGGREGATOR_IMAGE),
            on_host,
            name="qwen-nodemetrics",
            entrypoints=["python3", script, config],
            uploads=[
                docker.ContainerUploadArgs(file=script, content=NODEMETRICS_SCRIPT.read_text()),
                docker.ContainerUploadArgs(
                    file=config, content=monitoring.aggregator_json(cluster, node.name)
                ),
            ],
        )
        self.register_outputs({name: container.id for name, container in self.containers.items()})


@dataclass(frozen=True)
class ClusterMonitoringArgs:
    cluster: ClusterConfig
    provider: docker.Provider  # the monitoring node's
    connection: remote.ConnectionArgs  # the monitoring node's
    depends_on: list[pulumi.Resource] = field(default_factory=list)


class ClusterMonitoring(pulumi.ComponentResource):
    """Prometheus and Alertmanager on `monitoring.node`, configs on the host, reloaded in place."""

    def __init__(self, name: str, args: ClusterMonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:ClusterMonitoring", name, None, opts)
        cluster = args.cluster
        self.files = remote.Command(
            f"{name}-config",
            connection=args.connection,
            create=monitoring.server_files_script(monitoring.server_files(cluster)),
            opts=pulumi.ResourceOptions(parent=self, depends_on=args.depends_on),
        )
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[self.files])
        config_volume = docker.ContainerVolumeArgs(
            host_path=monitoring.HOST_CONFIG_DIR,
            container_path=monitoring.CONTAINER_CONFIG_DIR,
            read_only=True,
        )

        def data(kind: str, path: str) -> docker.ContainerVolumeArgs:
            # On the host, so a replaced container (a new image) keeps the history and silences.
            return docker.ContainerVolumeArgs(
                host_path=f"{monitoring.HOST_DATA_DIR}/{kind}", container_path=path
            )

        prometheus_image = docker.RemoteImage(
            f"{name}-prometheus-image", name=monitoring.PROMETHEUS_IMAGE, keep_locally=True, opts=on_host
        )
        self.prometheus = _container(
            f"{name}-prometheus",
            prometheus_image,
            on_host,
            name=monitoring.PROMETHEUS_CONTAINER,
            command=monitoring.prometheus_args(
                cluster,
                config_path=f"{monitoring.CONTAINER_CONFIG_DIR}/prometheus.yml",
                data_path="/prometheus",
            ),
            volumes=[config_volume, data("prometheus", "/prometheus")],
        )
        alertmanager_image = docker.RemoteImage(
            f"{name}-alertmanager-image", name=monitoring.ALERTMANAGER_IMAGE, keep_locally=True, opts=on_host
        )
        self.alertmanager = _container(
            f"{name}-alertmanager",
            alertmanager_image,
            on_host,
            name=monitoring.ALERTMANAGER_CONTAINER,
            command=monitoring.alertmanager_args(
                cluster,
                config_path=f"{monitoring.CONTAINER_CONFIG_DIR}/alertmanager.yml",
                data_path="/alertmanager",
            ),
            volumes=[config_volume, data("alertmanager", "/alertmanager")],
        )
        self.register_outputs({"prometheus": self.prometheus.id, "alertmanager": self.alertmanager.id})


def outputs(cluster: ClusterConfig) -> dict[str, object]:
    """Stack outputs: where a central Prometheus scrapes, and the cluster's own (doctor reads it)."""
    result: dict[str, object] = {}
    if cluster.monitoring.exporters:
        port = monitoring.endpoint_port(cluster)
        result["monitoringEndpoints"] = {n.name: f"http://{n.ip}:{port}/metrics" for n in cluster.nodes}
    if cluster.monitoring_node is not None:
        result["prometheus"] = f"http://{cluster.monitoring_node.ip}:{monitoring.prometheus_port(cluster)}"
        result["alertmanager"] = (
            f"http://{cluster.monitoring_node.ip}:{monitoring.alertmanager_port(cluster)}"
        )
    return result
