"""Monitoring on AWS by the model server's means: an SSM Command document, and per node an
association whose parameters carry that node's containers (pure; components/aws/monitoring.py
registers them).

The containers are the same ContainerSpecs bare metal registers with the Docker provider
(qwen_cluster/render/monitoring/containers.py), run here with `docker run`: each is replaced only when
its spec changed (a hash label, as the model-server document does), so a run on an unchanged
node touches nothing. On the monitoring node the run also writes Prometheus's and
Alertmanager's files and sends SIGHUP (server_files_script): a new alert bound changes that
node's parameters only, and the servers re-read their files without a restart. Parameters
are gzip + base64: a spec holds whole files (the endpoint's script and config).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import shlex
from dataclasses import asdict

from qwen_cluster import tags
from qwen_cluster.render import ssm
from qwen_cluster.render.monitoring import containers
from qwen_cluster.render.shell import script

FILES_DIR = f"{containers.HOST_CONFIG_DIR}/files"
CONFIG_LABEL = "qwen-cluster.monitoring-config"
_PACKED = "^[A-Za-z0-9+/=]*$"
PARAMETERS: dict[str, tuple[str, str]] = {
    "Containers": (_PACKED, "gzip+base64: the bash script that runs this node's monitoring containers"),
    "ServerFiles": (_PACKED, "gzip+base64: Prometheus/Alertmanager files (monitoring node; else empty)"),
}
# One monitoring run: pulling the images (Prometheus, dcgm-exporter: a few hundred MB) and
# starting them. Not rollout.healthTimeoutSeconds, though equal to its default: that bounds a
# model server loading its weights, and no replica waits for this run (nothing drains).
RUN_TIMEOUT_SECONDS = 1800

_RUN = r"""#!/bin/bash
set -euo pipefail
unpack() { printf '%s' "$1" | base64 -d | gunzip; }
install -d -m 0755 __DIR__
if [ -n '{{ ServerFiles }}' ]; then
  unpack '{{ ServerFiles }}' > __DIR__/server-files.sh
  bash __DIR__/server-files.sh
fi
unpack '{{ Containers }}' > __DIR__/containers.sh
bash __DIR__/containers.sh
"""


def pack(text: str) -> str:
    return base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()


def unpack(value: str) -> str:
    return gzip.decompress(base64.b64decode(value)).decode()


def run_script() -> str:
    return _RUN.replace("__DIR__", containers.HOST_CONFIG_DIR)


def document() -> str:
    """The monitoring SSM Command document."""
    return ssm.command_document(
        "qwen-cluster: one node's monitoring containers (qwen_cluster/render/monitoring_ssm.py)",
        "monitoring",
        PARAMETERS,
        run_script(),
        RUN_TIMEOUT_SECONDS,
    )


def spec_hash(spec: containers.ContainerSpec) -> str:
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()


def docker_run(spec: containers.ContainerSpec, digest: str | None = None) -> list[str]:
    """`docker run` for a spec: host network, restart unless-stopped, its files bind-mounted
    read-only from FILES_DIR/<name>/ (docker run has no uploads). `digest`: spec_hash(spec)."""
    digest = spec_hash(spec) if digest is None else digest
    argv = ["docker", "run", "--detach", f"--name={spec.name}", f"--label={CONFIG_LABEL}={digest}"]
    argv += [f"--label={tags.CONTAINER_ROLE_LABEL}={tags.MONITORING_CONTAINER}", "--network=host"]
    argv.append("--restart=unless-stopped")
    for path, _ in spec.files:
        argv.append(f"--volume={FILES_DIR}/{spec.name}{path}:{path}:ro")
    for mount in spec.mounts:
        options = ",readonly" if mount.read_only else ""
        if mount.propagation:
            options += f",bind-propagation={mount.propagation}"
        argv.append(f"--mount=type=bind,source={mount.host},target={mount.container}{options}")
    argv += [f"--cap-add={capability}" for capability in spec.capabilities]
    if spec.gpus:
        argv.append("--gpus=all")
    if spec.pid_host:
        argv.append("--pid=host")
    if spec.entrypoint:
        argv.append(f"--entrypoint={spec.entrypoint[0]}")
    argv.append(spec.image)
    argv += [*spec.entrypoint[1:], *spec.command]
    return argv


def containers_script(specs: list[containers.ContainerSpec]) -> str:
    """Run each spec, replacing a container only when its spec hash differs."""
    parts = []
    for spec in specs:
        files = ""
        for path, text in spec.files:
            target = f"{FILES_DIR}/{spec.name}{path}"
            files += (
                f"install -d -m 0755 {shlex.quote(target.rsplit('/', 1)[0])}\n"
                f"cat > {shlex.quote(target)} <<'QWEN_FILE_EOF'\n{text.rstrip()}\nQWEN_FILE_EOF\n"
            )
        digest = spec_hash(spec)
        running = f"--filter 'name=^{spec.name}$' --filter 'label={CONFIG_LABEL}={digest}'"
        parts.append(
            f"""
# {spec.role}
if [ -n "$(docker ps --quiet {running})" ]; then
  echo "{spec.name}: unchanged"
else
  docker pull {shlex.quote(spec.image)} >/dev/null
{files}  docker rm --force {spec.name} >/dev/null 2>&1 || true
  {shlex.join(docker_run(spec, digest))} >/dev/null
  echo "{spec.name}: started"
fi
"""
        )
    return script("monitoring containers (replaced only when their spec changed)", "".join(parts))


def parameters(cluster, node_name: str, nodemetrics_source: str) -> dict[str, str]:
    """One node's association parameters."""
    specs = (
        containers.node_containers(cluster, node_name, nodemetrics_source)
        if cluster.monitoring.exporters
        else []
    )
    server_files = ""
    where = cluster.monitoring_node
    if where is not None and where.name == node_name:
        specs += containers.server_containers(cluster)
        server_files = pack(containers.server_files_script(containers.server_files(cluster)))
    return {"Containers": pack(containers_script(specs)), "ServerFiles": server_files}


def shell_check_text() -> str:
    """The run script with parameters filled by harmless placeholders, for `bash -n`."""
    text = run_script()
    for name in PARAMETERS:
        text = text.replace("{{ " + name + " }}", "")
    return text
