"""The cluster's Alertmanager: its routes (grouping on the monitoring clock, one page for
"nothing serves") and its command line. Pure: text and data.
"""

from __future__ import annotations

import yaml

from qwen_cluster import ports as port_table
from qwen_cluster.render.monitoring.clock import clock, duration


def alertmanager_port(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.ALERTMANAGER)


def alertmanager_config(cluster) -> str:
    scale = clock(cluster)
    receiver: dict = {"name": "default"}
    if cluster.monitoring.webhook_url:
        receiver["webhook_configs"] = [{"url": cluster.monitoring.webhook_url, "send_resolved": True}]
    config = {
        "route": {
            "receiver": "default",
            "group_by": ["alertname", "node", "replica"],
            "group_wait": duration(30, scale),
            "group_interval": duration(300, scale),
            "repeat_interval": "4h",
        },
        "receivers": [receiver],
        "inhibit_rules": [
            {
                # One page for "nothing serves", not one per replica as well.
                "source_matchers": ['alertname="QwenAllReplicasDown"'],
                "target_matchers": ['alertname="QwenReplicaDown"'],
            }
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def alertmanager_args(
    cluster, *, config_path: str, data_path: str, web_config_path: str | None = None
) -> list[str]:
    """With `web_config_path`, every route (silences, the health probes) asks for the credentials."""
    return [
        *([f"--web.config.file={web_config_path}"] if web_config_path else []),
        f"--config.file={config_path}",
        f"--storage.path={data_path}",
        # The monitoring node's cluster address, as Prometheus (prometheus.server_address). Its
        # POST /-/reload has no switch (prometheus/alertmanager ui/web.go); the port is reached
        # only from monitoringCidrs and members, and reload re-reads the rendered file only.
        f"--web.listen-address={cluster.monitoring_node.ip}:{alertmanager_port(cluster)}",
        # One Alertmanager: no gossip listener on 9094 (a port that is in no table).
        "--cluster.listen-address=",
    ]
