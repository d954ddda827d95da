"""A disaggregated stack under monitoring: its targets carry their pool, each node probes NIXL's
side channel on the other pool's nodes, and the KV alerts fire (and stay quiet) under the real
promtool on the series vLLM's NIXL connector exposes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from qwen_cluster.config import validate
from qwen_cluster.render.monitoring import alerts, endpoint, prometheus
from tests.helpers import tools
from tests.helpers.baremetal import ONPREM, ONPREM_DISAGGREGATED
from tests.helpers.configs import disaggregated

CLUSTER = ONPREM_DISAGGREGATED
TARGETS = {t["labels"]["node"]: t for t in prometheus.scrape_targets(CLUSTER)}
ANNOTATIONS = ("summary", "cause", "fix")


def labels_of(node: str) -> dict[str, str]:
    return {"instance": TARGETS[node]["targets"][0], "job": prometheus.JOB, **TARGETS[node]["labels"]}


def test_every_target_names_its_pool():
    assert {node: target["labels"]["pool"] for node, target in TARGETS.items()} == {
        "master": "prefill",
        "worker-1": "prefill",
        "worker-2": "decode",
        "worker-3": "decode",
    }
    assert all("pool" not in t["labels"] for t in prometheus.scrape_targets(ONPREM))


def test_each_node_probes_the_side_channel_of_the_other_pool_only():
    probed = {
        probe.peer
        for probe in endpoint.probes(CLUSTER, "worker-2")
        if probe.port_name == "kv-side-channel"
    }
    assert probed == {"master", "worker-1"}


def test_the_probe_goes_to_the_advertised_side_channel_host(bare_metal_raw):
    raw = disaggregated(bare_metal_raw, kvTransfer={"sideChannelHosts": {"master": "10.9.0.1"}})
    found = [p for p in endpoint.probes(validate(raw), "worker-3") if p.port_name == "kv-side-channel"]
    assert {(p.peer, p.peer_ip) for p in found} == {("master", "10.9.0.1"), ("worker-1", "192.168.1.101")}


def series(name: str, node: str, values: str, **labels: str) -> dict:
    text = ",".join(f'{key}="{value}"' for key, value in sorted({**labels_of(node), **labels}.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def run(tmp_path: Path, alert: str, input_series: list[dict], labels: list[dict], values: str = "") -> bool:
    """promtool: `alert` fires at 10m with exactly `labels` (each alert's), annotations expanded."""
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(CLUSTER))
    rule = next(a for a in alerts.alerts(CLUSTER) if a.name == alert)

    def expand(text: str, found: dict) -> str:
        for key, value in found.items():
            text = text.replace("{{ $labels." + key + " }}", value)
        return text.replace("{{ $value | humanizePercentage }}", values)

    expected = [
        {
            "exp_labels": {**found, "severity": rule.severity},
            "exp_annotations": {key: expand(getattr(rule, key), found) for key in ANNOTATIONS},
        }
        for found in labels
    ]
    test = {
        "interval": "15s",
        "input_series": input_series,
        "alert_rule_test": [{"eval_time": "10m", "alertname": alert, "exp_alerts": expected}],
    }
    path = tmp_path / f"{alert}-{len(labels)}.yml"
    spec = {"rule_files": [str(rules)], "evaluation_interval": "15s", "tests": [test]}
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return True


@tools.needs("promtool")
def test_a_failed_transfer_fires_on_the_node_that_counted_it(tmp_path):
    failing = [series("vllm:nixl_num_failed_transfers_total", "worker-2", "0x20 1x20")]
    quiet = [series("vllm:nixl_num_failed_transfers_total", "worker-2", "0x40")]
    assert run(tmp_path, "QwenKvTransferFailed", failing, [{"node": "worker-2"}])
    assert run(tmp_path, "QwenKvTransferFailed", quiet, [])


@tools.needs("promtool")
def test_a_decode_node_that_prefills_its_prompts_itself_fires(tmp_path):
    def decode(step: int) -> list[dict]:
        return [
            series("vllm:prompt_tokens_by_source_total", "worker-3", f"0+{step}x40", source="local_compute"),
            # What vLLM's request_prefill_kv_computed_tokens says on a decode node that pulled every
            # prompt (the prefill node's own cache hits subtracted, not the pulled tokens): not read.
            series("vllm:request_prefill_kv_computed_tokens_sum", "worker-3", "0+100x40"),
            series("vllm:prompt_tokens_total", "worker-3", "0+100x40"),
        ]

    assert run(tmp_path, "QwenKvRecomputed", decode(75), [{"node": "worker-3"}], values="75%")
    # Pulled: only each prompt's tail that fills no block is computed.
    assert run(tmp_path, "QwenKvRecomputed", decode(5), [])


@tools.needs("promtool")
def test_a_prefill_node_computing_its_prompts_is_not_recomputing(tmp_path):
    prefill = [
        series("vllm:prompt_tokens_by_source_total", "master", "0+100x40", source="local_compute"),
        series("vllm:prompt_tokens_total", "master", "0+100x40"),
    ]
    assert run(tmp_path, "QwenKvRecomputed", prefill, [])


@tools.needs("promtool")
def test_expired_leases_and_reads_after_them_fire_on_the_prefill_node(tmp_path):
    expired = [series("vllm:nixl_num_kv_expired_reqs_total", "master", "0x20 2x20")]
    late = [series("vllm:nixl_num_notifications_after_expiry_total", "master", "0x20 1x20")]
    assert run(tmp_path, "QwenKvLeaseExpired", expired, [{"node": "master"}])
    assert run(tmp_path, "QwenKvReadAfterLeaseExpired", late, [{"node": "master"}])
    assert run(tmp_path, "QwenKvReadAfterLeaseExpired", expired, [])


@tools.needs("promtool")
def test_a_blocked_side_channel_fires_its_own_alert_not_the_generic_one(tmp_path):
    probe = {
        "qwen_source": "probe",
        "module": "tcp_connect",
        "peer": "master",
        "peer_ip": "192.168.1.100",
        "port": "5600",
        "port_name": "kv-side-channel",
    }
    reachable = {"qwen_source": "probe", "module": "icmp", "peer": "master"}
    blocked = [
        series("probe_success", "worker-2", "0x40", **probe),
        series("probe_success", "worker-2", "1x40", **reachable),
    ]
    found = {**labels_of("worker-2"), **probe}
    assert run(tmp_path, "QwenKvSideChannelUnreachable", blocked, [found])
    assert run(tmp_path, "QwenInterNodePortUnreachable", blocked, [])
