"""The rendered Prometheus config and rules, checked and unit-tested by the real promtool:
every alert once firing and once not, on the series a cluster's :8000 endpoints expose."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from qwen_cluster.render.monitoring import alertmanager, alerts, clock, endpoint, prometheus
from tests.helpers import tools
from tooling import stackfile

ONPREM = stackfile.load("onprem")
TARGETS = {
    t["labels"]["node"]: {"instance": t["targets"][0], "job": prometheus.JOB, **t["labels"]}
    for t in prometheus.scrape_targets(ONPREM)
}
NODES = list(TARGETS)


def series(name: str, labels: dict[str, str], values: str) -> dict:
    text = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def on(node: str, **labels: str) -> dict[str, str]:
    return {**TARGETS[node], **labels}


def healthy() -> list[dict]:
    """A healthy cluster: every node scraped, vLLM up on every head, every peer pinged."""
    result = []
    for node in NODES:
        result.append(series("up", on(node), "1x40"))
        result.append(series("qwen_source_up", on(node, qwen_source="vllm"), "1x40"))
        for peer in NODES:
            if peer != node:
                result.append(
                    series("probe_success", on(node, qwen_source="probe", module="icmp", peer=peer), "1x40")
                )
    return result


def replace(base: list[dict], extra: list[dict]) -> list[dict]:
    """`base` with the series of `extra` overriding those with the same name and labels."""
    override = {item["series"]: item for item in extra}
    kept = [item for item in base if item["series"] not in override]
    return kept + extra


ANNOTATION = re.compile(r"\{\{\s*(\$labels\.(\w+)|\$value(\s*\|\s*(\w+))?)\s*\}\}")


def expected(alert_name: str, labels: dict[str, str], values: dict[str, str]) -> dict:
    """The alert as promtool reports it: labels plus its annotations, templates expanded
    (`values` gives the text of `$value` per pipe function, "" for plain)."""
    alert = next(a for a in alerts.alerts(ONPREM) if a.name == alert_name)

    def expand(text: str) -> str:
        def one(match: re.Match) -> str:
            if match.group(2):
                return labels[match.group(2)]
            return values[match.group(4) or ""]

        return ANNOTATION.sub(one, text)

    return {
        "exp_labels": {**labels, "severity": alert.severity},
        "exp_annotations": {key: expand(getattr(alert, key)) for key in ("summary", "cause", "fix")},
    }


def run_promtool(tmp_path: Path, tests: list[dict]) -> subprocess.CompletedProcess:
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(ONPREM))
    spec = {"rule_files": [str(rules)], "evaluation_interval": "15s", "tests": tests}
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)


def case(input_series: list[dict], alert: str, eval_time: str, exp: list[dict]) -> dict:
    return {
        "interval": "15s",
        "input_series": input_series,
        "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": exp}],
    }


@tools.needs("promtool")
def test_prometheus_config_and_rules_pass_promtool_check(tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(ONPREM))
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus.prometheus_config(ONPREM))
    checked = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts.alerts(ONPREM)) + 3} rules found" in checked.stdout


def lab_clock(seconds: float = 1):
    return ONPREM.model_copy(
        update={"monitoring": ONPREM.monitoring.model_copy(update={"scrape_interval_seconds": seconds})}
    )


@pytest.mark.parametrize("scrape", [15, 1, 60])
@tools.needs("promtool")
def test_rules_pass_promtool_check_on_every_clock(tmp_path, scrape):
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(lab_clock(scrape)))
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@tools.needs("amtool")
def test_alertmanager_config_passes_amtool(tmp_path):
    webhook = ONPREM.monitoring.model_copy(update={"webhook_url": "http://10.20.0.5:9095/hook"})
    for cluster in (ONPREM, ONPREM.model_copy(update={"monitoring": webhook})):
        path = tmp_path / "alertmanager.yml"
        path.write_text(alertmanager.alertmanager_config(cluster))
        checked = subprocess.run(["amtool", "check-config", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    names = {alert.name for alert in alerts.alerts(ONPREM)}
    tested_firing = {name for name, exp in CASES if exp}
    tested_quiet = {name for name, exp in CASES if not exp}
    assert names == tested_firing == tested_quiet


def _cases() -> list[tuple[str, dict]]:
    """(alert, promtool test case); a case with exp_alerts fires, one without stays quiet."""
    cases: list[tuple[str, dict]] = []
    add = cases.append

    # A replica is down when its head's vLLM stops answering.
    down = replace(healthy(), [series("qwen_source_up", on("worker-2", qwen_source="vllm"), "1 1 0x38")])
    add(
        (
            "QwenReplicaDown",
            case(
                down,
                "QwenReplicaDown",
                "3m",
                [
                    expected("QwenReplicaDown", {"replica": "2", "replica_head": "worker-2"}, {}),
                ],
            ),
        )
    )
    add(("QwenReplicaDown", case(healthy(), "QwenReplicaDown", "3m", [])))
    # ... or when its node cannot be scraped at all (no vLLM series then).
    gone = [item for item in healthy() if "worker-3" not in item["series"] or "peer=" in item["series"]]
    gone.append(series("up", on("worker-3"), "0x40"))
    add(
        (
            "QwenReplicaDown",
            case(
                gone,
                "QwenReplicaDown",
                "3m",
                [
                    expected("QwenReplicaDown", {"replica": "3", "replica_head": "worker-3"}, {}),
                ],
            ),
        )
    )

    all_down = replace(
        healthy(), [series("qwen_source_up", on(n, qwen_source="vllm"), "0x40") for n in NODES]
    )
    add(
        (
            "QwenAllReplicasDown",
            case(
                all_down,
                "QwenAllReplicasDown",
                "3m",
                [
                    expected("QwenAllReplicasDown", {}, {}),
                ],
            ),
        )
    )
    add(("QwenAllReplicasDown", case(down, "QwenAllReplicasDown", "3m", [])))

    cut = replace(
        healthy(),
        [
            series("probe_success", on(n, qwen_source="probe", module="icmp", peer="worker-2"), "0x40")
            for n in NODES
            if n != "worker-2"
        ],
    )
    add(
        (
            "QwenNodeUnreachable",
            case(
                cut,
                "QwenNodeUnreachable",
                "3m",
                [
                    expected("QwenNodeUnreachable", {"node": "worker-2", "peer": "worker-2"}, {}),
                ],
            ),
        )
    )
    # One member still reaches it: not unreachable (a path problem, the port alerts say more).
    partly = replace(
        cut,
        [series("probe_success", on("master", qwen_source="probe", module="icmp", peer="worker-2"), "1x40")],
    )
    add(("QwenNodeUnreachable", case(partly, "QwenNodeUnreachable", "3m", [])))

    rtt = {"qwen_source": "probe", "module": "icmp", "peer": "worker-1", "phase": "rtt"}
    slow = [series("probe_icmp_duration_seconds", on("master", **rtt), "0.0023x40")]
    add(
        (
            "QwenNodeLatencyHigh",
            case(
                slow,
                "QwenNodeLatencyHigh",
                "3m",
                [
                    expected(
                        "QwenNodeLatencyHigh",
                        {"node": "master", "peer": "worker-1"},
                        {"humanizeDuration": "2.3ms"},
                    ),
                ],
            ),
        )
    )
    fast = [series("probe_icmp_duration_seconds", on("master", **rtt), "0.0004x40")]
    add(("QwenNodeLatencyHigh", case(fast, "QwenNodeLatencyHigh", "3m", [])))

    tcp = {
        "qwen_source": "probe",
        "module": "tcp_connect",
        "peer": "worker-1",
        "peer_ip": "192.168.1.101",
        "port": "5000",
        "port_name": "model-service",
    }
    closed = [*healthy(), series("probe_success", on("master", **tcp), "0x40")]
    labels = {k: v for k, v in on("master", **tcp).items()}
    add(
        (
            "QwenInterNodePortUnreachable",
            case(
                closed,
                "QwenInterNodePortUnreachable",
                "3m",
                [
                    expected("QwenInterNodePortUnreachable", labels, {}),
                ],
            ),
        )
    )
    # The peer answers no ping either: that is QwenNodeUnreachable, not a firewall port.
    unreachable = replace(
        closed,
        [
            series("probe_success", on(n, qwen_source="probe", module="icmp", peer="worker-1"), "0x40")
            for n in NODES
            if n != "worker-1"
        ],
    )
    add(("QwenInterNodePortUnreachable", case(unreachable, "QwenInterNodePortUnreachable", "3m", [])))

    nic = {"device": "eth0"}
    nic_series = lambda speed: [  # noqa: E731
        series("node_network_speed_bytes", on("worker-3", qwen_source="node", **nic), f"{speed}x40"),
        series(
            "qwen_node_nic_info",
            on("worker-3", qwen_source="nodemetrics", address="192.168.1.103", **nic),
            "1x40",
        ),
    ]
    labels = on("worker-3", qwen_source="node", **nic)
    add(
        (
            "QwenNicBelowFloor",
            case(
                nic_series(125000000),
                "QwenNicBelowFloor",
                "6m",
                [
                    expected("QwenNicBelowFloor", labels, {"": "1"}),
                ],
            ),
        )
    )
    add(("QwenNicBelowFloor", case(nic_series(1250000000), "QwenNicBelowFloor", "6m", [])))

    def kv(values):
        return [
            series(
                "vllm:kv_cache_usage_perc",
                on("worker-1", qwen_source="vllm", model_name="Qwen/Qwen3-32B"),
                values,
            )
        ]  # noqa: E731

    add(
        (
            "QwenKvCacheFull",
            case(
                kv("0.97x40"),
                "QwenKvCacheFull",
                "6m",
                [
                    expected(
                        "QwenKvCacheFull", {"node": "worker-1", "replica": "1"}, {"humanizePercentage": "97%"}
                    ),
                ],
            ),
        )
    )
    # Over 95 % for four minutes only: not yet.
    add(("QwenKvCacheFull", case(kv("0.5x8 0.97x32"), "QwenKvCacheFull", "6m", [])))

    def waiting(n):
        return [
            series(
                "vllm:num_requests_waiting",
                on("master", qwen_source="vllm", model_name="Qwen/Qwen3-32B"),
                f"{n}x40",
            )
        ]  # noqa: E731

    add(
        (
            "QwenRequestsWaiting",
            case(
                waiting(60),
                "QwenRequestsWaiting",
                "3m",
                [
                    expected("QwenRequestsWaiting", {"node": "master", "replica": "0"}, {"": "60"}),
                ],
            ),
        )
    )
    add(("QwenRequestsWaiting", case(waiting(50), "QwenRequestsWaiting", "3m", [])))

    def ttft(slow_per_step: int, fast_per_step: int) -> list[dict]:
        base = on("worker-2", qwen_source="vllm", model_name="Qwen/Qwen3-32B")
        total = slow_per_step + fast_per_step
        return [
            series("vllm:time_to_first_token_seconds_bucket", {**base, "le": "1"}, f"0+{fast_per_step}x40"),
            series("vllm:time_to_first_token_seconds_bucket", {**base, "le": "20"}, f"0+{total}x40"),
            series("vllm:time_to_first_token_seconds_bucket", {**base, "le": "+Inf"}, f"0+{total}x40"),
        ]

    add(
        (
            "QwenTtftP99High",
            case(
                ttft(10, 0),
                "QwenTtftP99High",
                "8m",
                [
                    expected(
                        "QwenTtftP99High",
                        {"node": "worker-2", "replica": "2"},
                        {"humanizeDuration": "19.81s"},
                    ),
                ],
            ),
        )
    )
    add(("QwenTtftP99High", case(ttft(0, 10), "QwenTtftP99High", "8m", [])))

    xid = on("worker-1", qwen_source="gpu", gpu="3", xid="79", UUID="GPU-x")
    # One XID 79 in the exporter's window, gone from the gauge a minute later: still counted.
    add(
        (
            "QwenGpuXidErrors",
            case(
                [series("DCGM_EXP_XID_ERRORS_COUNT", xid, "0 0 1 1 1 0x35")],
                "QwenGpuXidErrors",
                "5m",
                [
                    expected("QwenGpuXidErrors", {"node": "worker-1", "gpu": "3", "xid": "79"}, {"": "1"}),
                ],
            ),
        )
    )
    add(
        (
            "QwenGpuXidErrors",
            case([series("DCGM_EXP_XID_ERRORS_COUNT", xid, "0x40")], "QwenGpuXidErrors", "5m", []),
        )
    )

    endpoint = replace(healthy(), [series("up", on("worker-3"), "0x40")])
    add(
        (
            "QwenMonitoringEndpointDown",
            case(
                endpoint,
                "QwenMonitoringEndpointDown",
                "3m",
                [
                    expected("QwenMonitoringEndpointDown", dict(on("worker-3")), {}),
                ],
            ),
        )
    )
    add(
        (
            "QwenMonitoringEndpointDown",
            case(
                replace(
                    endpoint,
                    [
                        series(
                            "probe_success",
                            on(n, qwen_source="probe", module="icmp", peer="worker-3"),
                            "0x40",
                        )
                        for n in NODES
                        if n != "worker-3"
                    ],
                ),
                "QwenMonitoringEndpointDown",
                "3m",
                [],
            ),
        )
    )

    gpu_down = [series("qwen_source_up", on("master", qwen_source="gpu"), "1 1 0x38")]
    add(
        (
            "QwenMonitoringSourceDown",
            case(
                gpu_down,
                "QwenMonitoringSourceDown",
                "3m",
                [
                    expected("QwenMonitoringSourceDown", on("master", qwen_source="gpu"), {}),
                ],
            ),
        )
    )
    add(
        (
            "QwenMonitoringSourceDown",
            case(
                [series("qwen_source_up", on("master", qwen_source="gpu"), "1x40")],
                "QwenMonitoringSourceDown",
                "3m",
                [],
            ),
        )
    )
    return [(name, test) for name, test in cases]


CASES = [(name, test["alert_rule_test"][0]["exp_alerts"]) for name, test in _cases()]


@tools.needs("promtool")
def test_promtool_unit_tests_for_every_alert(tmp_path):
    tests = [test for _, test in _cases()]
    done = run_promtool(tmp_path, tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_a_new_alert_bound_changes_the_rule_and_nothing_else():
    changed = ONPREM.monitoring.model_copy(update={"max_requests_waiting": 7})
    other = ONPREM.model_copy(update={"monitoring": changed})
    before = {a.name: a.expr for a in alerts.alerts(ONPREM)}
    after = {a.name: a.expr for a in alerts.alerts(other)}
    assert {name for name in before if before[name] != after[name]} == {"QwenRequestsWaiting"}
    assert "> 7" in after["QwenRequestsWaiting"]
    assert prometheus.prometheus_config(ONPREM, rules_path="r") == prometheus.prometheus_config(
        other, rules_path="r"
    )
    assert all(
        endpoint.aggregator_config(ONPREM, n) == endpoint.aggregator_config(other, n) for n in NODES
    )


def test_the_latency_budget_and_bandwidth_floor_come_from_the_network_section():
    network = ONPREM.network.model_copy(update={"max_latency_ms": 0.25, "min_bandwidth_gbps": 25})
    exprs = {a.name: a.expr for a in alerts.alerts(ONPREM.model_copy(update={"network": network}))}
    assert exprs["QwenNodeLatencyHigh"].endswith("> 0.00025")
    assert exprs["QwenNicBelowFloor"].endswith("< 25")


def test_durations_follow_the_scrape_interval():
    text = alerts.rules(lab_clock(1))
    loaded = yaml.safe_load(text)["groups"][1]["rules"]
    fors = {rule["alert"]: rule.get("for") for rule in loaded}
    assert fors["QwenReplicaDown"] == "4s" and fors["QwenKvCacheFull"] == "20s"
    assert "[20s]" in next(r["expr"] for r in loaded if r["alert"] == "QwenTtftP99High")
    assert clock.duration(15, 1 / 30) == "500ms" and clock.duration(600) == "10m"
    settings = yaml.safe_load(prometheus.prometheus_config(lab_clock(1)))["global"]
    assert settings["scrape_interval"] == "1s" and settings["scrape_timeout"] == "800ms"


@tools.needs("promtool")
def test_the_grafana_dashboards_queries_parse(tmp_path):
    """Every panel query of dashboards/qwen-cluster.json, parsed by promtool as a recording rule."""
    import json

    dashboard = json.loads(
        (Path(__file__).resolve().parents[1] / "dashboards" / "qwen-cluster.json").read_text()
    )
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs and all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
    rules = [{"record": f"dashboard:query{index}", "expr": expr} for index, expr in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("scrape", [1, 15, 60])
def test_a_failed_probe_ends_before_the_endpoint_stops_waiting_and_that_before_the_scrape(scrape):
    """Otherwise a peer that is gone shows as a silent blackbox instead of probe_success 0."""
    cluster = lab_clock(scrape)
    times = clock.timing(cluster)
    blackbox = yaml.safe_load(endpoint.blackbox_config(cluster))["modules"]["icmp"]["timeout"]
    endpoint_waits = endpoint.aggregator_config(cluster, "master")["timeout"]
    scrape_timeout = yaml.safe_load(prometheus.prometheus_config(cluster))["global"]["scrape_timeout"]
    assert blackbox == clock.duration(times.probe_timeout)
    assert times.probe_timeout < endpoint_waits < times.scrape_timeout
    assert scrape_timeout == clock.duration(times.scrape_timeout)


@pytest.mark.parametrize("stack", ["dev", "prod", "onprem", "onprem-pipeline", "onprem-disaggregated"])
def test_each_nodes_endpoint_file_is_exactly_its_config_as_json(stack):
    """aggregator_json splices each peer's probes, encoded once per cluster, into every
    node's file: the bytes must be json.dumps of aggregator_config, whatever the node (a
    disaggregated node's side-channel probes depend on its own pool: only the other pool's)."""
    import json

    from qwen_cluster import config
    from tests.helpers.baremetal import ONPREM_DISAGGREGATED

    if stack == "onprem-pipeline":  # Ray's ports join the probes; replicas of two nodes
        raw = stackfile.read("onprem")
        raw["qwen-cluster:model"] = {**raw["qwen-cluster:model"], "pipelineParallel": 2}
        cluster = config.validate(stackfile.cluster_keys(raw))
    elif stack == "onprem-disaggregated":  # two pools of two
        cluster = ONPREM_DISAGGREGATED
    else:
        cluster = stackfile.load(stack)
    for node in cluster.nodes:
        for gpu in (None, False):
            expected = json.dumps(
                endpoint.aggregator_config(cluster, node.name, gpu=gpu), indent=2, sort_keys=True
            )
            assert endpoint.aggregator_json(cluster, node.name, gpu=gpu) == expected + "\n"
    heads = {head.name for head in cluster.topology.heads}
    assert any(node.name not in heads for node in cluster.nodes) == (stack == "onprem-pipeline")
