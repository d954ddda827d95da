"""AWS's own counters of the failures in docs/monitoring.md ("The ten failures"), which the lab
cannot produce: the ENA allowance counters (node_exporter's ethtool collector) and EFA's error
counters (nodemetrics), on recorded inputs (tests/data/doctor/README.md), through the rendered
rules and the real promtool, and told by doctor in the guide's terms."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from qwen_cluster.node import nodemetrics
from qwen_cluster.render.monitoring import alerts, containers, endpoint, prometheus
from tooling import doctor, stackfile

DEV = stackfile.load("dev")  # AWS, g6e.12xlarge with EFA
ONPREM = stackfile.load("onprem")
DATA = Path(__file__).parent / "data" / "doctor"
TARGET = {
    "instance": prometheus.scrape_targets(DEV)[0]["targets"][0],
    "job": prometheus.JOB,
    **prometheus.scrape_targets(DEV)[0]["labels"],
}


def ethtool_counters(text: str) -> dict[str, int]:
    """`ethtool -S` output as {statistic: value}."""
    pairs = (line.split(":", 1) for line in text.splitlines()[1:] if ":" in line)
    return {name.strip(): int(value) for name, value in pairs}


def test_efa_error_counters_are_read_from_sysfs():
    found = nodemetrics.efa_errors(str(DATA / "efa-hw-counters"))
    assert [(labels["device"], labels["counter"], value) for labels, value in found] == [
        ("rdmap0s6", "rx_drops", 37),
        ("rdmap0s6", "rdma_read_wr_err", 2),
        ("rdmap0s6", "rdma_write_wr_err", 0),
    ]


def test_the_endpoint_serves_them_on_aws_with_efa_only():
    config = endpoint.aggregator_config(DEV, "master")
    assert config["efa_sysfs"] == "/sys/class/infiniband"
    assert "efa_sysfs" not in endpoint.aggregator_config(ONPREM, "master")
    collector = nodemetrics.Collector(
        {"node_ip": "", "sources": [], "probes": [], "efa_sysfs": str(DATA / "efa-hw-counters")}
    )
    text = collector.collect()
    assert "# TYPE qwen_efa_errors_total counter" in text
    assert (
        'qwen_efa_errors_total{qwen_source="nodemetrics",device="rdmap0s6",port="1",counter="rx_drops"} 37'
        in text
    )


def test_node_exporter_reads_the_ena_allowances_on_aws_only():
    def exporter(cluster):
        spec = next(s for s in containers.node_containers(cluster, "master", "") if s.role == "node-exporter")
        return " ".join(spec.command)

    assert "--collector.ethtool " in exporter(DEV) + " "
    assert "bw_in_allowance_exceeded|bw_out_allowance_exceeded|pps_allowance_exceeded" in exporter(DEV)
    assert "ethtool" not in exporter(ONPREM)


def _promtool(tmp_path: Path, series: list[dict], alert: str, exp: list[dict]) -> subprocess.CompletedProcess:
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(DEV))
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": series,
                "alert_rule_test": [{"eval_time": "4m", "alertname": alert, "exp_alerts": exp}],
            }
        ],
    }
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)


def _series(name: str, labels: dict[str, str], values: str) -> dict:
    text = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def _fired(alert: str, labels: dict[str, str], value: str) -> list[dict]:
    """The alert as promtool reports it, its annotations' templates filled in."""
    spec = next(a for a in alerts.alerts(DEV) if a.name == alert)

    def expand(text: str) -> str:
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        return text.replace("{{ $value }}", value)

    annotations = {key: expand(getattr(spec, key)) for key in ("summary", "cause", "fix")}
    return [{"exp_labels": {**labels, "severity": spec.severity}, "exp_annotations": annotations}]


def test_the_recorded_ena_shaping_fires_its_alert_and_a_steady_counter_does_not(tmp_path):
    shaped = ethtool_counters((DATA / "ena-ethtool.txt").read_text())["bw_in_allowance_exceeded"]
    labels = {**TARGET, "device": "ens5"}
    rising = [_series("node_ethtool_bw_in_allowance_exceeded", labels, f"0x8 {shaped}x12")]
    labels_out = {"node": TARGET["node"], "device": "ens5"}
    done = _promtool(
        tmp_path,
        rising,
        "QwenEnaAllowanceExceeded",
        _fired("QwenEnaAllowanceExceeded", labels_out, str(shaped)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steady = [_series("node_ethtool_bw_in_allowance_exceeded", labels, f"{shaped}x20")]
    done = _promtool(tmp_path, steady, "QwenEnaAllowanceExceeded", [])
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_recorded_efa_drops_fire_their_alert(tmp_path):
    (labels, value), *_ = nodemetrics.efa_errors(str(DATA / "efa-hw-counters"))
    series_labels = {**TARGET, "qwen_source": "nodemetrics", **labels}
    rising = [_series("qwen_efa_errors_total", series_labels, f"0x8 {value:g}x12")]
    expected = {"node": TARGET["node"], "device": labels["device"], "counter": labels["counter"]}
    done = _promtool(tmp_path, rising, "QwenEfaErrors", _fired("QwenEfaErrors", expected, f"{value:g}"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_doctor_tells_the_ena_alert_as_a_bandwidth_finding():
    answer = {
        "/api/v1/rules": {
            "groups": [
                {"rules": [{"name": a.name, "type": "alerting", "health": "ok"} for a in alerts.alerts(DEV)]}
            ]
        },
        "/api/v1/alerts": {
            "alerts": [
                {
                    "state": "firing",
                    "labels": {
                        "alertname": "QwenEnaAllowanceExceeded",
                        "severity": "warning",
                        "node": "worker-1",
                    },
                    "annotations": {"summary": "ENA on worker-1 shaped 18412 packets"},
                }
            ]
        },
    }
    (finding,) = doctor.findings(lambda path: answer[path], DEV)
    assert (finding.step, finding.where, finding.as_json()["check"]) == (
        "bandwidth",
        ["worker-1"],
        "QwenEnaAllowanceExceeded",
    )
