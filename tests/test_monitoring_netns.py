"""The monitoring pieces for real, in two network namespaces joined by a veth: Debian's
node_exporter, blackbox_exporter, Prometheus and Alertmanager with the rendered configs,
the :8000 endpoint and the stand-in model server. A cut link fires QwenNodeUnreachable and
QwenReplicaDown, `doctor` names the node, and both resolve once the link is back.
Root and iproute2 only (run under the lab lock: flock /tmp/qcl-lab.lock)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from labkit.hosts import netns
from qwen_cluster import config
from qwen_cluster.node import NODEMETRICS_SCRIPT
from qwen_cluster.render.monitoring import alertmanager, containers, endpoint, prometheus
from tests.helpers import tools
from tests.helpers.baremetal import needs_netns, netns_pair
from tests.helpers.wait import WaitTimeout, wait_until
from tooling import doctor

ROOT = Path(__file__).resolve().parents[1]
MASTER_IP, WORKER_IP = "10.231.0.1", "10.231.0.2"


def cluster() -> config.ClusterConfig:
    return config.validate(
        {
            "target": "bare-metal",
            "nodes": [
                {"name": "master", "ip": MASTER_IP, "role": "master"},
                {"name": "worker-1", "ip": WORKER_IP},
            ],
            "network": {"cidr": "10.231.0.0/24", "minBandwidthGbps": 10, "maxLatencyMs": 1.0},
            # Monitoring only: no client goes through a load balancer here.
            "access": {
                "clientCidrs": ["10.0.0.0/8"],
                "adminCidrs": ["203.0.113.10/32"],
                "openEndpoint": True,
            },
            "monitoring": {"scrapeIntervalSeconds": 1, "openToMonitoringCidrs": True},
            "bareMetal": {"nicSpeedGbps": 10, "gpusPerNode": 8, "gpuMemoryGb": 80},
        }
    )


class Processes:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.running: list[subprocess.Popen] = []

    def start(self, namespace: str, name: str, argv: list[str]) -> None:
        log = open(self.tmp / f"{namespace}-{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        self.running.append(
            subprocess.Popen(
                ["ip", "netns", "exec", namespace, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        )

    def stop(self) -> None:
        for process in self.running:
            process.kill()
        for process in self.running:
            process.wait(timeout=10)


def start_node(procs: Processes, cluster: config.ClusterConfig, namespace: str, node: str) -> None:
    tmp = procs.tmp
    blackbox = tmp / f"{node}-blackbox.yml"
    blackbox.write_text(endpoint.blackbox_config(cluster))
    endpoint_config = tmp / f"{node}-nodemetrics.json"
    endpoint_config.write_text(endpoint.aggregator_json(cluster, node, gpu=False))
    procs.start(
        namespace, "node-exporter", ["prometheus-node-exporter", *endpoint.node_exporter_args(rootfs=None)]
    )
    procs.start(
        namespace, "blackbox", ["prometheus-blackbox-exporter", *endpoint.blackbox_args(str(blackbox))]
    )
    procs.start(
        namespace, "nodemetrics", [sys.executable, str(NODEMETRICS_SCRIPT), str(endpoint_config)]
    )
    procs.start(
        namespace,
        "model",
        [
            sys.executable,
            "-m",
            "labkit.models.modelserver",
            "--node",
            node,
            "--port",
            str(cluster.model_port),
        ],
    )


def start_servers(procs: Processes, cluster: config.ClusterConfig, namespace: str) -> None:
    directory = procs.tmp / "monitoring"
    (directory / "prometheus").mkdir(parents=True)
    (directory / "alertmanager").mkdir()
    for name, text in containers.server_files(cluster).items():
        (directory / name).write_text(text)
    procs.start(
        namespace,
        "prometheus",
        [
            "prometheus",
            *prometheus.prometheus_args(
                cluster,
                config_path=str(directory / "prometheus.yml"),
                data_path=str(directory / "prometheus"),
            ),
        ],
    )
    procs.start(
        namespace,
        "alertmanager",
        [
            "prometheus-alertmanager",
            *alertmanager.alertmanager_args(
                cluster,
                config_path=str(directory / "alertmanager.yml"),
                data_path=str(directory / "alertmanager"),
            ),
        ],
    )


# Debian's packages, run for real in the namespaces.
MONITORING_TOOLS = (
    "prometheus",
    "prometheus-alertmanager",
    "prometheus-node-exporter",
    "prometheus-blackbox-exporter",
)


def wait_for(what: str, check, timeout: float, procs: Processes, done=bool):
    """tests/helpers/wait.py's wait, failing with the processes' logs besides."""
    try:
        return wait_until(check, what=what, timeout=timeout, interval=0.5, done=done)
    except WaitTimeout as timed_out:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-800:]}" for p in sorted(procs.tmp.glob("*.log")))
        pytest.fail(f"{timed_out}\n{logs}")


@needs_netns
@tools.needs(*MONITORING_TOOLS)
def test_a_cut_link_fires_and_resolves_and_doctor_names_the_node(tmp_path):
    stack = cluster()
    procs = Processes(tmp_path)
    with netns_pair(MASTER_IP, WORKER_IP) as (master_ns, worker_ns):
        link = (
            netns.run(["ip", "-n", worker_ns, "-o", "link", "show", "type", "veth"])
            .stdout.split(":")[1]
            .strip()
        )
        link = link.split("@", 1)[0]
        try:
            start_node(procs, stack, master_ns, "master")
            start_node(procs, stack, worker_ns, "worker-1")
            start_servers(procs, stack, master_ns)
            url = f"http://{MASTER_IP}:{prometheus.prometheus_port(stack)}"
            ask = doctor.http_fetch(url, timeout=2)

            def fetch(path: str):
                return netns.call_in(master_ns, ask, path)

            def findings():
                try:
                    return doctor.findings(fetch, stack)
                except doctor.Unreachable:
                    return None

            def targets_up():
                data = fetch("/api/v1/targets")
                nodes = [t for t in data["activeTargets"] if t["labels"]["job"] == prometheus.JOB]
                return len(nodes) == 2 and all(t["health"] == "up" for t in nodes)

            def endpoint_text() -> str:
                with urllib.request.urlopen(f"http://{WORKER_IP}:8000/metrics", timeout=2) as answer:
                    return answer.read().decode()

            wait_for("Prometheus answering", lambda: findings() is not None, 30, procs)
            wait_for("both endpoints scraped", targets_up, 30, procs)
            text = netns.call_in(master_ns, endpoint_text)
            assert 'qwen_source_up{qwen_source="node"} 1' in text
            assert 'probe_success{qwen_source="probe",module="icmp",peer="master",' in text
            assert "vllm:kv_cache_usage_perc" in text
            # Healthy: every rule loaded, nothing firing (give the first evaluations a moment).
            wait_for("a healthy cluster", lambda: findings() == [], 30, procs)

            started = time.monotonic()
            netns.run(["ip", "-n", worker_ns, "link", "set", link, "down"])
            seen: list = []

            def cut_found():
                current = findings() or []
                seen[:] = [(finding.alert, finding.where) for finding in current]
                return current if {"QwenNodeUnreachable", "QwenReplicaDown"} <= _names(current) else seen

            found = wait_for("the cut to be found", cut_found, 60, procs, done=lambda r: r is not seen)
            took = time.monotonic() - started
            assert all("worker-1" in finding.where for finding in found), found
            assert took < 60

            netns.run(["ip", "-n", worker_ns, "link", "set", link, "up"])
            wait_for("the alerts to resolve", lambda: findings() == [], 60, procs)
        finally:
            procs.stop()


def _names(found: list[doctor.Finding]) -> set[str]:
    return {finding.alert for finding in found}
