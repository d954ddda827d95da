"""The monitoring containers, as data for every target (bare metal registers them with the
Docker provider, AWS runs them with `docker run` from an SSM document), the Prometheus and
Alertmanager files they mount on the monitoring node, and where they answer (stack outputs).
Pure: text and data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qwen_cluster import hostpaths
from qwen_cluster.node import nic
from qwen_cluster.render.monitoring import webconfig
from qwen_cluster.render.monitoring.alertmanager import (
    alertmanager_args,
    alertmanager_config,
    alertmanager_port,
)
from qwen_cluster.render.monitoring.alerts import rules
from qwen_cluster.render.monitoring.endpoint import (
    DCGM_COUNTERS,
    aggregator_json,
    blackbox_args,
    blackbox_config,
    dcgm_args,
    endpoint_port,
    node_exporter_args,
)
from qwen_cluster.render.monitoring.prometheus import prometheus_args, prometheus_config, prometheus_port
from qwen_cluster.render.shell import container_state_function, quote, script

# Pinned: the versions Debian bookworm ships, so the configs promtool and amtool check in
# the tests (Debian's packages) are read by the same versions on the nodes.
NODE_EXPORTER_IMAGE = "prom/node-exporter:v1.5.0"
BLACKBOX_EXPORTER_IMAGE = "prom/blackbox-exporter:v0.23.0"
PROMETHEUS_IMAGE = "prom/prometheus:v2.42.0"
ALERTMANAGER_IMAGE = "prom/alertmanager:v0.25.0"
# NVIDIA's README quick start pins this tag (github.com/NVIDIA/dcgm-exporter).
DCGM_EXPORTER_IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:4.4.2-4.7.1-ubuntu22.04"
# The aggregator is stdlib-only Python; any pinned CPython image runs it.
AGGREGATOR_IMAGE = "python:3.12.7-slim-bookworm"

HOST_CONFIG_DIR = f"{hostpaths.CONFIG_DIR}/monitoring"
HOST_DATA_DIR = hostpaths.STATE_DIR
# Where a monitoring container reads its files: uploads for the exporters and the endpoint,
# HOST_CONFIG_DIR mounted read-only for Prometheus and Alertmanager.
CONTAINER_CONFIG_DIR = "/etc/qwen-monitoring"
PROMETHEUS_CONTAINER = "qwen-prometheus"
ALERTMANAGER_CONTAINER = "qwen-alertmanager"
# prom/prometheus and prom/alertmanager run as nobody (their Dockerfiles: USER nobody).
CONTAINER_UID = 65534


# With monitoring.tls: the web config both servers read, the PEM file holding their certificate
# chain and key, and (with monitoring.password) the password Prometheus logs in with, beside the
# other files; readable by the servers' user only (webconfig.py). The web config's name says TLS:
# exporter-toolkit decides between HTTP and HTTPS when a server starts, so a stack turning TLS on
# changes the servers' command lines, which starts them again (a stack that had a password-only
# `web.yml` included).
WEB_CONFIG_FILE = "web-tls.yml"
PASSWORD_FILE = "password"
TLS_FILE = "tls.pem"
# The CA Prometheus verifies itself and Alertmanager with (monitoring.tls.caCertificate): public.
CA_FILE = "ca.pem"
# What earlier releases wrote and a server may no longer read: removed by the files step.
STALE_FILES = ("web.yml",)


def credentials(cluster) -> bool:
    """Do Prometheus and Alertmanager ask for the monitoring password?"""
    return cluster.monitoring.password is not None


def tls(cluster) -> bool:
    """Do Prometheus and Alertmanager serve HTTPS (monitoring.tls; config/rules.py requires it with
    the password)?"""
    return cluster.monitoring.tls is not None


def scheme(cluster) -> str:
    return "https" if tls(cluster) else "http"


def server_files(cluster) -> dict[str, str]:
    """File name (in HOST_CONFIG_DIR, mounted at CONTAINER_CONFIG_DIR) -> text. The secret files
    are apart (secret_files): they are made from the secrets."""
    password_file = f"{CONTAINER_CONFIG_DIR}/{PASSWORD_FILE}" if credentials(cluster) else None
    ca_file = f"{CONTAINER_CONFIG_DIR}/{CA_FILE}" if tls(cluster) else None
    files = {
        "prometheus.yml": prometheus_config(
            cluster, rules_path="rules.yml", password_file=password_file, ca_file=ca_file
        ),
        "rules.yml": rules(cluster),
        "alertmanager.yml": alertmanager_config(cluster),
    }
    if tls(cluster):
        files[CA_FILE] = cluster.monitoring.tls.ca_certificate.strip() + "\n"
    return files


def secret_file_names(cluster) -> tuple[str, ...]:
    """The secret files the monitoring node holds for this stack (secret_files' keys)."""
    if not tls(cluster):
        return ()
    return (WEB_CONFIG_FILE, TLS_FILE, *((PASSWORD_FILE,) if credentials(cluster) else ()))


def tls_pem(certificate: str, private_key: str) -> str:
    """The chain and its key in one file (webconfig.web_config: one rename swaps both)."""
    return f"{certificate.strip()}\n{private_key.strip()}\n"


def secret_files(
    stack: str, *, certificate: str, private_key: str, password: str | None = None
) -> dict[str, str]:
    """The web config (with the password: a bcrypt hash, the same for the same password and stack
    on every run), the certificate file, and the password file Prometheus logs in with. Secret:
    the caller keeps them an Output secret."""
    hashed = None if password is None else webconfig.password_hash(password, webconfig.salt_context(stack))
    tls_file = f"{CONTAINER_CONFIG_DIR}/{TLS_FILE}"
    files = {
        WEB_CONFIG_FILE: webconfig.web_config(hashed, tls_file=tls_file),
        TLS_FILE: tls_pem(certificate, private_key),
    }
    if password is not None:
        files[PASSWORD_FILE] = password
    return files


def server_files_script(
    files: Mapping[str, str],
    *,
    config_dir: str = HOST_CONFIG_DIR,
    secret_files: Mapping[str, str] | None = None,
    secret_sources: Mapping[str, str] | None = None,
) -> str:
    """Write the Prometheus/Alertmanager files atomically (temp file + rename in the same
    directory), then ask the running servers to re-read them: SIGHUP reloads Prometheus's
    config and rules and Alertmanager's config in place, no restart, no gap in the data.
    On the first run the containers do not exist yet and read the files when they start.
    `secret_files` (the module's secret_files) are written the same way, mode 0640 for the
    servers' group only; both servers read them again on every request or connection, so a new
    password or certificate needs no signal (webconfig.py). `secret_sources` are the same files
    where the text is not in the script: name -> a shell command that prints it on the node
    (AWS: the node reads SecureString parameters with its role, render/monitoring_ssm.py),
    written the same way. Files of earlier releases no server reads (STALE_FILES) are removed."""
    writes = []
    for name, text in sorted(files.items()):
        marker = f"QWEN_{name.upper().replace('.', '_')}_EOF"
        writes.append(
            f"cat >{quote(config_dir)}/.{name}.new <<'{marker}'\n{text.rstrip()}\n{marker}\n"
            f"mv -f {quote(config_dir)}/.{name}.new {quote(config_dir)}/{name}\n"
        )
    secrets = {name: ("text", text) for name, text in (secret_files or {}).items()}
    secrets.update({name: ("command", command) for name, command in (secret_sources or {}).items()})
    for name, (kind, value) in sorted(secrets.items()):
        marker = f"QWEN_{name.upper().replace('.', '_')}_EOF"
        temporary = f"{quote(config_dir)}/.{name}.new"
        written = (
            f"(umask 077 && cat >{temporary} <<'{marker}'\n{value.rstrip()}\n{marker}\n)\n"
            if kind == "text"
            else f"(umask 077 && {value} >{temporary})\n"
        )
        writes.append(
            written + f"chgrp {CONTAINER_UID} {temporary} && chmod 0640 {temporary}\n"
            f"mv -f {temporary} {quote(config_dir)}/{name}\n"
        )
    body = f"""
install -d -m 0755 {quote(config_dir)}
install -d -m 0750 -o {CONTAINER_UID} -g {CONTAINER_UID} {quote(HOST_DATA_DIR + "/prometheus")} \\
  {quote(HOST_DATA_DIR + "/alertmanager")}
{"".join(writes)}chmod 0644 {" ".join(f"{quote(config_dir)}/{name}" for name in sorted(files))}
rm -f {" ".join(f"{quote(config_dir)}/{name}" for name in STALE_FILES)}
{container_state_function().strip()}
for name in {PROMETHEUS_CONTAINER} {ALERTMANAGER_CONTAINER}; do
  state=$(container_state "$name")  # docker's errors fail the step
  if [ "$state" = running ]; then
    docker kill --signal HUP "$name" >/dev/null
    echo "monitoring: $name re-reads its configuration"
  fi
done
"""
    return script("Prometheus and Alertmanager configuration (reloaded in place)", body)


# ---------------------------------------------------------------- the containers, as data


@dataclass(frozen=True)
class Mount:
    host: str
    container: str
    read_only: bool = False
    propagation: str | None = None


@dataclass(frozen=True)
class ContainerSpec:
    """One monitoring container, for every target: bare metal registers it with the Docker
    provider, AWS runs it with `docker run` from an SSM document. Host network always."""

    role: str  # node-exporter, blackbox-exporter, dcgm-exporter, nodemetrics, prometheus, alertmanager
    name: str  # the container's name on the host
    image: str
    command: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()  # (path in the container, content): uploads
    mounts: tuple[Mount, ...] = ()
    capabilities: tuple[str, ...] = ()
    gpus: bool = False
    pid_host: bool = False


def node_containers(cluster, node_name: str, nodemetrics_source: str) -> list[ContainerSpec]:
    """One node's exporters and its endpoint. `nodemetrics_source` is qwen_cluster/node/nodemetrics.py's
    text (the caller reads it: renderers do no I/O)."""
    blackbox_file = f"{CONTAINER_CONFIG_DIR}/blackbox.yml"
    script_path = f"{CONTAINER_CONFIG_DIR}/nodemetrics.py"
    config_path = f"{CONTAINER_CONFIG_DIR}/nodemetrics.json"
    specs = [
        ContainerSpec(
            "node-exporter",
            "qwen-node-exporter",
            NODE_EXPORTER_IMAGE,
            command=tuple(node_exporter_args(rootfs="/host", ena=cluster.aws is not None)),
            # node_exporter's README (Docker): the host's / read-only at /host, rslave so mounts
            # made later (a new disk) show up too; the host's PID namespace for its processes.
            mounts=(Mount("/", "/host", read_only=True, propagation="rslave"),),
            pid_host=True,
        ),
        ContainerSpec(
            "blackbox-exporter",
            "qwen-blackbox-exporter",
            BLACKBOX_EXPORTER_IMAGE,
            command=tuple(blackbox_args(blackbox_file)),
            files=((blackbox_file, blackbox_config(cluster)),),
            capabilities=("NET_RAW",),  # ICMP echo needs a raw socket
        ),
    ]
    if cluster.gpus_per_node > 0:
        counters = f"{CONTAINER_CONFIG_DIR}/dcgm-counters.csv"
        specs.append(
            # NVIDIA's quick start: --gpus all --cap-add SYS_ADMIN (github.com/NVIDIA/dcgm-exporter).
            ContainerSpec(
                "dcgm-exporter",
                "qwen-dcgm-exporter",
                DCGM_EXPORTER_IMAGE,
                command=tuple(dcgm_args(counters)),
                files=((counters, DCGM_COUNTERS),),
                capabilities=("SYS_ADMIN",),
                gpus=True,
            )
        )
    specs.append(
        ContainerSpec(
            "nodemetrics",
            "qwen-nodemetrics",
            AGGREGATOR_IMAGE,
            entrypoint=("python3", script_path, config_path),
            # nic.py beside it: the program's one interface finder, which nodemetrics imports.
            files=(
                (script_path, nodemetrics_source),
                (f"{CONTAINER_CONFIG_DIR}/nic.py", nic.FINDER),
                (config_path, aggregator_json(cluster, node_name)),
            ),
        )
    )
    return specs


def server_containers(cluster) -> list[ContainerSpec]:
    """Prometheus and Alertmanager: their files on the host (server_files_script), mounted."""
    config = Mount(HOST_CONFIG_DIR, CONTAINER_CONFIG_DIR, read_only=True)
    web = f"{CONTAINER_CONFIG_DIR}/{WEB_CONFIG_FILE}" if tls(cluster) else None
    return [
        ContainerSpec(
            "prometheus",
            PROMETHEUS_CONTAINER,
            PROMETHEUS_IMAGE,
            command=tuple(
                prometheus_args(
                    cluster,
                    config_path=f"{CONTAINER_CONFIG_DIR}/prometheus.yml",
                    data_path="/prometheus",
                    web_config_path=web,
                )
            ),
            # On the host, so a replaced container (a new image) keeps the history.
            mounts=(config, Mount(f"{HOST_DATA_DIR}/prometheus", "/prometheus")),
        ),
        ContainerSpec(
            "alertmanager",
            ALERTMANAGER_CONTAINER,
            ALERTMANAGER_IMAGE,
            command=tuple(
                alertmanager_args(
                    cluster,
                    config_path=f"{CONTAINER_CONFIG_DIR}/alertmanager.yml",
                    data_path="/alertmanager",
                    web_config_path=web,
                )
            ),
            mounts=(config, Mount(f"{HOST_DATA_DIR}/alertmanager", "/alertmanager")),
        ),
    ]


def stack_outputs(cluster) -> dict[str, object]:
    """Stack outputs: where a central Prometheus scrapes, and the cluster's own (doctor reads it)."""
    result: dict[str, object] = {}
    if cluster.monitoring.exporters:
        port = endpoint_port(cluster)
        result["monitoringEndpoints"] = {n.name: f"http://{n.ip}:{port}/metrics" for n in cluster.nodes}
    if cluster.monitoring_node is not None:
        where = f"{scheme(cluster)}://{cluster.monitoring_node.ip}"
        result["prometheus"] = f"{where}:{prometheus_port(cluster)}"
        result["alertmanager"] = f"{where}:{alertmanager_port(cluster)}"
    return result
