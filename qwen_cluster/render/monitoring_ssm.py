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

With monitoring.tls the secret files (containers.secret_files: the web config, with the password
its bcrypt hash; the servers' certificate and key; Prometheus's password file) come from
SecureString parameters (components/aws/monitoring.py): the certificate chain and its key are
two, which the run joins into the one file the servers read. The monitoring node's association
names them by ARN and carries their versions, never a value: its run reads them with the node's
role, as the proxy reads the endpoint's keys (render/proxy.py), and writes them with the same
server_files_script as bare metal. A new password or certificate is a new version, so new
association parameters and a new run (UpdateAssociation runs an association again), which
rewrites the files; both servers read them on the next request or connection, so nothing
restarts (webconfig.py).
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
# A parameter's ARN (GetParameter takes a name or an ARN), as the proxy's document holds them.
_SSM_ARN = "^(arn:[A-Za-z0-9:/._-]+)?$"
PARAMETERS: dict[str, tuple[str, str]] = {
    "Containers": (_PACKED, "gzip+base64: the bash script that runs this node's monitoring containers"),
    "ServerFiles": (_PACKED, "gzip+base64: Prometheus/Alertmanager files (monitoring node; else empty)"),
    "Region": ("^[a-z0-9-]*$", "the AWS region (for the aws CLI); with monitoring.tls only"),
    "WebConfigParameter": (_SSM_ARN, "SecureString: the servers' web config; empty: no monitoring.tls"),
    "PasswordParameter": (_SSM_ARN, "SecureString: the password Prometheus logs in with; empty: none"),
    "TlsCertificateParameter": (_SSM_ARN, "SecureString: the servers' certificate chain; empty: none"),
    "TlsPrivateKeyParameter": (_SSM_ARN, "SecureString: the certificate's private key; empty: none"),
    "SecretsVersion": ("^[0-9,]*$", "the secret parameters' versions: a new secret is a new run"),
}
# Where server-files.sh finds the secrets' parameters (the run sets them from the above).
_WEB_CONFIG_VARIABLE = "QWEN_WEB_CONFIG_PARAMETER"
_PASSWORD_VARIABLE = "QWEN_PASSWORD_PARAMETER"
_TLS_CERTIFICATE_VARIABLE = "QWEN_TLS_CERTIFICATE_PARAMETER"
_TLS_PRIVATE_KEY_VARIABLE = "QWEN_TLS_PRIVATE_KEY_PARAMETER"
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
  # The secrets' parameters by ARN (empty without monitoring.tls): server-files.sh reads them
  # with the node's role. Their values are never in this document or its parameters.
  AWS_DEFAULT_REGION='{{ Region }}' __WEB__='{{ WebConfigParameter }}' \
    __PASSWORD__='{{ PasswordParameter }}' __CERTIFICATE__='{{ TlsCertificateParameter }}' \
    __KEY__='{{ TlsPrivateKeyParameter }}' bash __DIR__/server-files.sh
  echo "monitoring: server files written (secrets version '{{ SecretsVersion }}')"
fi
unpack '{{ Containers }}' > __DIR__/containers.sh
bash __DIR__/containers.sh
"""


def pack(text: str) -> str:
    return base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()


def unpack(value: str) -> str:
    return gzip.decompress(base64.b64decode(value)).decode()


def run_script() -> str:
    return (
        _RUN.replace("__DIR__", containers.HOST_CONFIG_DIR)
        .replace("__WEB__", _WEB_CONFIG_VARIABLE)
        .replace("__PASSWORD__", _PASSWORD_VARIABLE)
        .replace("__CERTIFICATE__", _TLS_CERTIFICATE_VARIABLE)
        .replace("__KEY__", _TLS_PRIVATE_KEY_VARIABLE)
    )


def _read_parameter(variable: str) -> str:
    """The shell command that prints the SecureString parameter named by $variable (an ARN),
    read with the node's role: never on a command line, in a log or in the document."""
    return (
        f'aws ssm get-parameter --name "${variable}" --with-decryption --query Parameter.Value --output text'
    )


def secret_sources(cluster) -> dict[str, str]:
    """The secret files (containers.secret_file_names) and how the run reads each: the
    certificate file is the chain's parameter and then the key's, as containers.tls_pem joins
    them (a parameter's value is its text without the last newline, parameter_value)."""
    every = {
        containers.WEB_CONFIG_FILE: _read_parameter(_WEB_CONFIG_VARIABLE),
        containers.PASSWORD_FILE: _read_parameter(_PASSWORD_VARIABLE),
        containers.TLS_FILE: "{ "
        + _read_parameter(_TLS_CERTIFICATE_VARIABLE)
        + "; "
        + _read_parameter(_TLS_PRIVATE_KEY_VARIABLE)
        + "; }",
    }
    return {name: every[name] for name in containers.secret_file_names(cluster)}


def parameter_value(text: str) -> str:
    """A secret file (or the chain, or the key) as its parameter holds it: `--output text` prints
    the value and one newline, so the file on the node is the bytes bare metal writes."""
    return text.rstrip()


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


def runs_servers(cluster, node_name: str) -> bool:
    where = cluster.monitoring_node
    return where is not None and where.name == node_name


def with_secrets(cluster) -> bool:
    """Does the monitoring node's run read secret files (monitoring.tls set)?"""
    return cluster.monitoring_node is not None and bool(containers.secret_file_names(cluster))


def parameters(
    cluster,
    node_name: str,
    nodemetrics_source: str,
    *,
    web_config_parameter: object = "",
    password_parameter: object = "",
    tls_certificate_parameter: object = "",
    tls_private_key_parameter: object = "",
    secrets_version: object = "",
) -> dict[str, object]:
    """One node's association parameters. With monitoring.tls the monitoring node's also name
    the secrets' parameters (ARNs) and carry their versions (all may be Outputs); the other
    nodes' and a stack's without TLS have none of these keys, so turning it on changes the
    monitoring node's association only."""
    specs = (
        containers.node_containers(cluster, node_name, nodemetrics_source)
        if cluster.monitoring.exporters
        else []
    )
    result: dict[str, object] = {"ServerFiles": ""}
    if runs_servers(cluster, node_name):
        specs += containers.server_containers(cluster)
        sources = secret_sources(cluster) if with_secrets(cluster) else None
        files = containers.server_files_script(containers.server_files(cluster), secret_sources=sources)
        result["ServerFiles"] = pack(files)
        if sources:
            result |= {
                "Region": cluster.aws.region if cluster.aws else "",
                "WebConfigParameter": web_config_parameter,
                "PasswordParameter": password_parameter,
                "TlsCertificateParameter": tls_certificate_parameter,
                "TlsPrivateKeyParameter": tls_private_key_parameter,
                "SecretsVersion": secrets_version,
            }
    return {"Containers": pack(containers_script(specs)), **result}


def shell_check_text() -> str:
    """The run script with parameters filled by harmless placeholders, for `bash -n`."""
    text = run_script()
    for name in PARAMETERS:
        text = text.replace("{{ " + name + " }}", "")
    return text
