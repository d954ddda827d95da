"""Monitoring on AWS: one SSM document, one association per node running the same
ContainerSpecs as bare metal; a new alert bound updates the monitoring node's association only."""

from __future__ import annotations

import subprocess

from qwen_cluster.node import NODEMETRICS_SCRIPT
from qwen_cluster.render import monitoring_ssm
from qwen_cluster.render.monitoring import containers
from tooling import changes, offline, stackfile

NODEMETRICS = NODEMETRICS_SCRIPT.read_text()
ASSOCIATION = "aws:ssm/association:Association"


def render(stack: str, *edits: str) -> offline.Render:
    result = offline.render(changes.apply_changes(stackfile.read(stack), list(edits)), stack)
    assert result.error is None, result.error
    return result


def test_every_node_gets_its_monitoring_association_and_the_master_the_servers():
    dev = render("dev")
    associations = {r.name: r.inputs for r in dev.of_type(ASSOCIATION) if r.name.startswith("monitoring-")}
    assert set(associations) == {"monitoring-master", "monitoring-worker-1"}
    master = monitoring_ssm.unpack(associations["monitoring-master"]["parameters"]["Containers"])
    worker = monitoring_ssm.unpack(associations["monitoring-worker-1"]["parameters"]["Containers"])
    for name in ("qwen-node-exporter", "qwen-blackbox-exporter", "qwen-dcgm-exporter", "qwen-nodemetrics"):
        assert f"--name={name}" in master and f"--name={name}" in worker
    assert "--name=qwen-prometheus" in master and "--name=qwen-prometheus" not in worker
    assert associations["monitoring-worker-1"]["parameters"]["ServerFiles"] == ""
    assert "--gpus=all" in worker and containers.DCGM_EXPORTER_IMAGE in worker
    assert dev.outputs["prometheus"] == "http://10.42.1.100:9090"


def test_a_new_alert_bound_updates_the_monitoring_nodes_association_only():
    before, after = render("prod"), render("prod", "monitoring.maxRequestsWaiting=5")
    moved = [(c.name, c.action) for c in changes.diff(before, after) if c.action != "same"]
    assert moved == [("monitoring-master", "update")]
    summary = changes.rollout(before, after)
    assert summary.servers_restarted == [] and summary.nodes_replaced == []


def test_the_scripts_pass_shellcheck(tmp_path):
    cluster = stackfile.load("prod")
    scripts = {
        "run.sh": monitoring_ssm.shell_check_text(),
        "containers.sh": monitoring_ssm.unpack(
            monitoring_ssm.parameters(cluster, "master", NODEMETRICS)["Containers"]
        ),
        "files.sh": monitoring_ssm.unpack(
            monitoring_ssm.parameters(cluster, "master", NODEMETRICS)["ServerFiles"]
        ),
    }
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        checked = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, name + checked.stdout


def test_an_unchanged_container_is_kept_a_changed_one_replaced():
    """The run replaces a container only when its spec hash (a label) differs."""
    cluster = stackfile.load("dev")
    specs = containers.node_containers(cluster, "worker-1", NODEMETRICS)
    text = monitoring_ssm.containers_script(specs)
    for spec in specs:
        assert f"label={monitoring_ssm.CONFIG_LABEL}={monitoring_ssm.spec_hash(spec)}" in text
    other = stackfile.load("prod")
    changed = {
        s.name: monitoring_ssm.spec_hash(s)
        for s in containers.node_containers(other, "worker-1", NODEMETRICS)
    }
    same = {s.name: monitoring_ssm.spec_hash(s) for s in specs}
    assert changed["qwen-node-exporter"] == same["qwen-node-exporter"]  # nothing of the stack in it
    assert changed["qwen-nodemetrics"] != same["qwen-nodemetrics"]  # other peers to probe
