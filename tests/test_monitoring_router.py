"""vLLM's router under monitoring (loadBalancer.routing cache-aware): its node's endpoint reads
its loopback metrics, and its two alerts fire (and stay quiet) under the real promtool; doctor
names a router that is down."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from qwen_cluster import ports
from qwen_cluster.render import nodecheck
from qwen_cluster.render.monitoring import alerts, endpoint, prometheus
from tests.helpers import tools
from tests.helpers.baremetal import ONPREM, ONPREM_CACHE_AWARE
from tooling import doctor

CLUSTER = ONPREM_CACHE_AWARE
LB = CLUSTER.load_balancer_node.name
TARGET = next(t for t in prometheus.scrape_targets(CLUSTER) if t["labels"]["node"] == LB)
LABELS = {"instance": TARGET["targets"][0], "job": prometheus.JOB, **TARGET["labels"]}


def test_the_load_balancer_nodes_endpoint_reads_the_routers_loopback_metrics():
    sources = {s["name"]: s["url"] for s in endpoint.aggregator_config(CLUSTER, LB)["sources"]}
    assert sources["router"] == f"http://127.0.0.1:{ports.ROUTER_METRICS_PORT}/metrics"
    others = [n.name for n in CLUSTER.nodes if n.name != LB]
    assert all(
        "router" not in {s["name"] for s in endpoint.aggregator_config(CLUSTER, n)["sources"]} for n in others
    )


def test_least_conn_has_no_router_source_and_no_router_alert():
    assert "router" not in {s["name"] for s in endpoint.aggregator_config(ONPREM, LB)["sources"]}
    assert not [a for a in alerts.alerts(ONPREM) if a.name.startswith("QwenRouter")]


def series(name: str, values: str, **labels: str) -> dict:
    text = ",".join(f'{key}="{value}"' for key, value in sorted({**LABELS, **labels}.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def run_case(
    tmp_path: Path, alert: str, input_series: list[dict], fires: bool
) -> subprocess.CompletedProcess:
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(CLUSTER))
    rule = next(a for a in alerts.alerts(CLUSTER) if a.name == alert)
    expected = []
    if fires:
        annotations = {
            key: getattr(rule, key).replace("{{ $labels.node }}", LB) for key in ("summary", "cause", "fix")
        }
        if alert == "QwenMonitoringSourceDown":
            annotations = {
                k: v.replace("{{ $labels.qwen_source }}", "router") for k, v in annotations.items()
            }
        expected = [
            {
                "exp_labels": {"node": LB, "severity": rule.severity, **_extra(alert)},
                "exp_annotations": annotations,
            }
        ]
    test = {
        "interval": "15s",
        "input_series": input_series,
        "alert_rule_test": [{"eval_time": "5m", "alertname": alert, "exp_alerts": expected}],
    }
    spec = {"rule_files": [str(rules)], "evaluation_interval": "15s", "tests": [test]}
    path = tmp_path / f"{alert}-{fires}.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)


def _extra(alert: str) -> dict[str, str]:
    # QwenRouterDown keeps the series' labels; QwenRouterLostWorkers aggregates by node.
    return {**LABELS, "qwen_source": "router"} if alert == "QwenRouterDown" else {}


def _promtool_passes(done: subprocess.CompletedProcess) -> bool:
    return done.returncode == 0 and "SUCCESS" in done.stdout


@tools.needs("promtool")
def test_router_down_fires_when_its_source_is_down_and_not_otherwise(tmp_path):
    down = [series("qwen_source_up", "1 1 0x38", qwen_source="router")]
    up = [series("qwen_source_up", "1x40", qwen_source="router")]
    assert _promtool_passes(run_case(tmp_path, "QwenRouterDown", down, fires=True))
    assert _promtool_passes(run_case(tmp_path, "QwenRouterDown", up, fires=False))
    # The generic source alert leaves the router to its own.
    assert _promtool_passes(run_case(tmp_path, "QwenMonitoringSourceDown", down, fires=False))


@tools.needs("promtool")
def test_lost_workers_fires_when_no_worker_is_healthy(tmp_path):
    workers = [f"http://192.168.1.10{i}:5000" for i in range(4)]
    lost = [series("vllm_router_worker_health", "1 1 0x38", qwen_source="router", worker=w) for w in workers]
    one_left = [
        series(
            "vllm_router_worker_health", "1x40" if w == workers[0] else "0x40", qwen_source="router", worker=w
        )
        for w in workers
    ]
    emptied = [series("vllm_router_active_workers", "4 4 0x38", qwen_source="router")]
    assert _promtool_passes(run_case(tmp_path, "QwenRouterLostWorkers", lost, fires=True))
    assert _promtool_passes(run_case(tmp_path, "QwenRouterLostWorkers", emptied, fires=True))
    assert _promtool_passes(run_case(tmp_path, "QwenRouterLostWorkers", one_left, fires=False))


def test_doctor_names_the_router_that_is_down():
    rule = next(a for a in alerts.alerts(CLUSTER) if a.name == "QwenRouterDown")
    summary = rule.summary.replace("{{ $labels.node }}", LB)

    def fetch(path: str):
        if path == "/api/v1/rules":
            return {
                "groups": [
                    {
                        "rules": [
                            {"type": "alerting", "name": a.name, "health": "ok"}
                            for a in alerts.alerts(CLUSTER)
                        ]
                    }
                ]
            }
        return {
            "alerts": [
                {
                    "state": "firing",
                    "labels": {"alertname": "QwenRouterDown", "severity": "warning", "node": LB},
                    "annotations": {"summary": summary, "cause": rule.cause, "fix": rule.fix},
                }
            ]
        }

    found = doctor.findings(fetch, CLUSTER)
    assert [(f.what, f.where) for f in found] == [(summary, [LB])]
    assert "qwen-router" in found[0].fix


def run_router_check(tmp_path, docker_body: str) -> list[str]:
    """The load-balancer node's router check with a `docker` that runs `docker_body`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(f"#!/bin/bash\n{docker_body}\n")
    (bin_dir / "docker").chmod(0o755)
    text = f'warn() {{ echo "qwen|finding|$1|$2|$3|${{*:4}}"; }}\nnode={LB}\n' + nodecheck.router_section(
        CLUSTER, LB
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.startswith("qwen|finding|")]


def test_the_host_check_names_a_router_that_is_not_running(tmp_path):
    assert run_router_check(tmp_path, "echo running") == []
    assert run_router_check(tmp_path, "echo exited") == [
        f"qwen|finding|router|{LB}|-|vLLM's router (qwen-router) is exited: "
        "nginx sends to the replicas directly"
    ]
    [absent] = run_router_check(tmp_path, 'echo "Error: No such container: qwen-router" >&2; exit 1')
    assert absent.startswith(
        f"qwen|finding|router|{LB}|-|vLLM's router (qwen-router) is absent (Error: No such"
    )
    assert doctor.CHECKS["router"].severity == "warning"


def test_only_the_routers_node_checks_it():
    others = [n.name for n in CLUSTER.nodes if n.name != LB]
    assert all(nodecheck.router_section(CLUSTER, name) == "" for name in others)
    assert nodecheck.router_section(ONPREM, LB) == ""
