"""kv-aware routing under monitoring: the alert for a router whose KV index gets no events fires
(and stays quiet) under the real promtool, and the router's node check names the replica head
whose KV-event publisher does not accept a connection."""

from __future__ import annotations

import os
import socket
import subprocess

import yaml

from labkit.cluster import routinglab
from qwen_cluster.render import nodecheck
from qwen_cluster.render.monitoring import alerts, prometheus
from tests.helpers import tools
from tests.helpers.baremetal import ONPREM_CACHE_AWARE
from tooling import doctor, stackfile

KV_AWARE = stackfile.validate(
    {
        **stackfile.read("onprem"),
        "qwen-cluster:loadBalancer": {
            **(stackfile.read("onprem").get("qwen-cluster:loadBalancer") or {}),
            "routing": "kv-aware",
        },
    }
)
LB = KV_AWARE.load_balancer_node.name
TARGET = next(t for t in prometheus.scrape_targets(KV_AWARE) if t["labels"]["node"] == LB)
LABELS = {"instance": TARGET["targets"][0], "job": prometheus.JOB, **TARGET["labels"]}
ALERT = "QwenRouterKvEventsSilent"


def series(name: str, values: str, **labels: str) -> dict:
    text = ",".join(f'{key}="{value}"' for key, value in sorted({**LABELS, **labels}.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def fires(tmp_path, input_series: list[dict]) -> bool:
    """Whether the alert fires at 30 m under promtool (its expected alert set either way)."""
    rules = tmp_path / "rules.yml"
    rules.write_text(alerts.rules(KV_AWARE))
    rule = next(a for a in alerts.alerts(KV_AWARE) if a.name == ALERT)
    annotations = {
        key: getattr(rule, key).replace("{{ $labels.node }}", LB) for key in ("summary", "cause", "fix")
    }
    outcomes = []
    for expected in (
        [{"exp_labels": {"node": LB, "severity": "warning"}, "exp_annotations": annotations}],
        [],
    ):
        test = {
            "interval": "1m",
            "input_series": input_series,
            "alert_rule_test": [{"eval_time": "30m", "alertname": ALERT, "exp_alerts": expected}],
        }
        path = tmp_path / "case.yml"
        path.write_text(yaml.safe_dump({"rule_files": [str(rules)], "tests": [test]}, sort_keys=False))
        done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
        outcomes.append(done.returncode == 0 and "SUCCESS" in done.stdout)
    assert outcomes.count(True) == 1, f"neither or both expectations held: {outcomes}"
    return outcomes[0]


def lookups(result: str, values: str) -> dict:
    return series("vllm_router_kv_placement_lookups_total", values, qwen_source="router", result=result)


def replica_hits(values: str) -> dict:
    head = KV_AWARE.topology.heads[0].name
    return series("vllm:prefix_cache_hits_total", values, qwen_source="vllm", node=head)


@tools.needs("promtool")
def test_the_alert_fires_when_the_router_misses_every_prefix_the_replicas_hold(tmp_path):
    # The symptom: every lookup a miss while the replica counts its cached prefixes.
    assert fires(tmp_path, [lookups("miss", "0+2x40"), replica_hits("0+1000x40")])
    # Hits that stopped count too: the index went stale.
    assert fires(
        tmp_path, [lookups("miss", "0+2x40"), lookups("hit", "0+1x5 6x35"), replica_hits("0+1000x40")]
    )


@tools.needs("promtool")
def test_the_alert_stays_quiet_while_the_router_hits_or_nothing_is_cached(tmp_path):
    assert not fires(
        tmp_path, [lookups("miss", "0+2x40"), lookups("hit", "0+1x40"), replica_hits("0+1000x40")]
    )
    # No reuse at all: nothing for the router to find.
    assert not fires(tmp_path, [lookups("miss", "0+2x40"), replica_hits("0x40")])


def test_the_alert_is_kv_awares_only_and_doctor_knows_its_check():
    assert ALERT in {a.name for a in alerts.alerts(KV_AWARE)}
    assert ALERT not in {a.name for a in alerts.alerts(ONPREM_CACHE_AWARE)}
    assert doctor.CHECKS["kv-events"].severity == "warning"


def test_the_routers_node_names_the_head_whose_publisher_does_not_answer(tmp_path):
    # Replica heads on loopback addresses of this test: one publisher listening, one not.
    cluster = routinglab._loopback_cluster(f"127.81.{os.getpid() % 250}")
    router_node = cluster.router_node.name
    heads = [str(head.ip) for head in cluster.topology.heads]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/bash\necho running\n")  # the router's container runs
    (bin_dir / "docker").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    with socket.socket() as listening:
        listening.bind((heads[0], cluster.kv_events_port))
        listening.listen()
        text = f'warn() {{ echo "qwen|finding|$1|$2|$3|${{*:4}}"; }}\nnode={router_node}\n'
        text += nodecheck.router_section(cluster, router_node)
        done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    findings = [line for line in done.stdout.splitlines() if line.startswith("qwen|finding|")]
    assert findings == [
        f"qwen|finding|kv-events|{router_node}|{heads[1]}|the KV-event publisher at "
        f"{heads[1]}:{cluster.kv_events_port} does not accept a connection: vLLM's router gets no "
        "events from that replica and places its prompts by load"
    ]
    assert "kv-events" not in nodecheck.router_section(
        ONPREM_CACHE_AWARE, ONPREM_CACHE_AWARE.router_node.name
    )
