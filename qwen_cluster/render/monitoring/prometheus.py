"""The cluster's Prometheus: its scrape config (one static target per node's endpoint,
labelled with what the rules group by) and its command line. Pure: text and data.
"""

from __future__ import annotations

import yaml

from qwen_cluster import ports as port_table
from qwen_cluster.render.monitoring import webconfig
from qwen_cluster.render.monitoring.alertmanager import alertmanager_port
from qwen_cluster.render.monitoring.clock import duration, timing
from qwen_cluster.render.monitoring.endpoint import endpoint_port

JOB = "qwen-node"


def prometheus_port(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.PROMETHEUS)


def server_address(cluster) -> str:
    """Where Prometheus and Alertmanager listen: the monitoring node's cluster address, not every
    interface (nor loopback: a central Prometheus in monitoringCidrs and doctor reach them there)."""
    return str(cluster.monitoring_node.ip)


def scrape_targets(cluster) -> list[dict]:
    """One static target per node: its endpoint, labelled with what the rules group by."""
    topology = cluster.topology
    port = endpoint_port(cluster)
    targets = []
    for node in cluster.nodes:
        replica = topology.replica_of(node.name)
        targets.append(
            {
                "targets": [f"{node.ip}:{port}"],
                "labels": {
                    "node": node.name,
                    "replica": str(replica.index),
                    "replica_head": replica.head.name,
                    "role": "head" if replica.head.name == node.name else "pipeline-worker",
                    # serving.mode disaggregated: prefill or decode (the KV alerts read it).
                    **({"pool": cluster.serving.pool_of(node.name)} if cluster.disaggregated else {}),
                },
            }
        )
    return targets


def prometheus_config(
    cluster,
    *,
    rules_path: str = "rules.yml",
    cluster_name: str = "qwen-cluster",
    password_file: str | None = None,
    ca_file: str | None = None,
) -> str:
    """`rules_path` relative to the config file's directory (Prometheus resolves it there), so
    the pair can be moved together (the lab runs them from its own directory).

    With `password_file`, Prometheus logs in to itself and to Alertmanager (both behind the web
    config, webconfig.py) as webconfig.USER, reading the password from that file on every request
    (prometheus/common config/http_config.go basicAuthRoundTripper.RoundTrip reads passwordFile
    each time), so a rotated password needs no reload. The nodes' endpoints (8000) stay open.

    With `ca_file` (monitoring.tls), it reaches both over https and verifies them against that CA
    alone. No `server_name`: the targets are the monitoring node's address, which the certificate
    names (subjectAltName IP), and Go verifies an IP target against the IP SANs. prometheus/common
    v0.39 (config/http_config.go `tlsRoundTripper.RoundTrip`) hashes the CA file on every request
    and, when it changed, builds a new transport and closes the idle connections: a new CA needs
    no reload."""
    times = timing(cluster)
    am_port = alertmanager_port(cluster)
    here = server_address(cluster)
    auth: dict = (
        {"basic_auth": {"username": webconfig.USER, "password_file": password_file}} if password_file else {}
    )
    if ca_file:
        auth = {"scheme": "https", "tls_config": {"ca_file": ca_file}, **auth}
    config = {
        "global": {
            "scrape_interval": duration(times.scrape),
            "scrape_timeout": duration(times.scrape_timeout),
            "evaluation_interval": duration(times.scrape),
            "external_labels": {"cluster": cluster_name},
        },
        "rule_files": [rules_path],
        "alerting": {"alertmanagers": [{**auth, "static_configs": [{"targets": [f"{here}:{am_port}"]}]}]},
        "scrape_configs": [
            {"job_name": JOB, "static_configs": scrape_targets(cluster)},
            {
                "job_name": "prometheus",
                **auth,
                "static_configs": [{"targets": [f"{here}:{prometheus_port(cluster)}"]}],
            },
            {"job_name": "alertmanager", **auth, "static_configs": [{"targets": [f"{here}:{am_port}"]}]},
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def prometheus_args(
    cluster, *, config_path: str, data_path: str, web_config_path: str | None = None
) -> list[str]:
    """With `web_config_path`, every route (the health probes too) asks for the credentials."""
    return [
        *([f"--web.config.file={web_config_path}"] if web_config_path else []),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={data_path}",
        f"--web.listen-address={server_address(cluster)}:{prometheus_port(cluster)}",
        # No --web.enable-lifecycle: without it POST /-/reload and /-/quit answer 403, so no host
        # that reaches the port (monitoringCidrs, every member) can stop Prometheus. The config
        # and rules are re-read on SIGHUP (containers.server_files_script), which needs the
        # docker socket on this host (prometheus/prometheus web/web.go: the lifecycle handlers
        # refuse with 403 "Lifecycle API is not enabled." unless the flag is set).
    ]
