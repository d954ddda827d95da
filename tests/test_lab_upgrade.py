"""Day 2 rehearsed: the lab applies a changed stack config while clients use it (root).

One lab for the module (its own label); the rehearsals run in order on it, each starting
from what the previous one left, as successive `pulumi up`s would. Three of the stack's four
nodes: a rollout that takes one replica out at a time still has one on either side of it
(test_lab_namespaces rehearses the stack's four).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request

import pytest

from labkit import cli as lab_cli
from labkit.cluster import blueprint, lifecycle, upgrade
from labkit.engine import executor
from labkit.hosts import dockerd, netns
from labkit.images import standins
from qwen_cluster import ports as port_table
from tests.helpers.wait import wait_until

LABEL = f"u{os.getpid() % 100000}"
BINARIES = ("ip", "nginx", "ufw")
MISSING = netns.missing_requirements() + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")

NODES = 3
NEW_NODE = {"name": "worker-4", "ip": "192.168.1.104"}  # not one of the stack file's nodes


@pytest.fixture(scope="module")
def running():
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=NODES, label=LABEL)
    options = lifecycle.Options()
    try:
        report = lifecycle.up(lab_plan, options)
        assert report.ok, [(s.resource, s.detail[-300:]) for s in report.steps if not s.ok]
        yield lab_plan, options
    finally:
        lifecycle.down(LABEL)


def _ran(result) -> dict[str, set[str]]:
    ran: dict[str, set[str]] = {}
    for step in result.steps:
        ran.setdefault(step.resource, set()).add(step.op)
    return ran


def _nodes(lab_plan) -> list[dict]:
    """The lab's nodes as its stack config lists them (what `nodes=` changes)."""
    return lab_plan.stack_config["qwen-cluster:nodes"]


def _sysctl(namespace: str, key: str) -> str:
    return netns.exec_in(namespace, ["sysctl", "-n", key]).stdout.strip()


def test_an_upgrade_of_a_lab_that_is_not_up_applies_nothing(capsys):
    status = lab_cli.main(["upgrade", "onprem", "--label", f"{LABEL}n", "--change", "model.image=x:1"])
    assert status == 2 and "is not up (no applied state)" in capsys.readouterr().out


def test_a_sysctl_change_updates_the_drop_in_in_place_and_restarts_nothing(running, capsys):
    lab_plan, _ = running
    sysctl = {**lab_plan.cluster.tuning.sysctl, "net.ipv4.tcp_fastopen": 1}
    status = lab_cli.main(
        ["upgrade", "onprem", "--label", LABEL, "--json", "--change", f"tuning.sysctl={json.dumps(sysctl)}"]
    )
    document = json.loads(capsys.readouterr().out)
    assert {"requests", "failed", "streamsCut", "maxReplicasDown", "seconds", "steps"} <= set(document)
    assert status == 0, document
    assert document["failed"] == 0 and document["streamsCut"] == 0 and document["maxReplicasDown"] == 0
    assert 0 < document["requests"] <= upgrade.LoadSettings.max_requests
    ran = {(step["resource"], step["op"]) for step in document["steps"]}
    assert {(f"{member.node}-sysctl", "update") for member in lab_plan.nodes} <= ran
    assert not [name for name, op in ran if name.endswith("-vllm") or name.endswith("-nginx")]
    assert {_sysctl(member.namespace, "net.ipv4.tcp_fastopen") for member in lab_plan.nodes} == {"1"}


def test_a_node_added_leaves_the_running_containers_alone_and_no_closed_port_opens(running):
    lab_plan, options = running
    nodes = [*_nodes(lab_plan), NEW_NODE]
    result = upgrade.run(LABEL, [f"nodes={json.dumps(nodes)}"], options, probe_matrix=True)
    ran = _ran(result)
    assert result.ok, [(s.resource, s.detail[-300:]) for s in result.steps if not s.ok]
    assert result.failed == 0 and result.streams_cut == 0, result.failures
    assert result.probe_sweeps and result.probe_sweeps >= 1
    assert result.opened == []
    untouched = [f"{m.node}-model-vllm" for m in lab_plan.nodes] + ["load-balancer-nginx"]
    assert not [name for name in untouched if name in ran], ran
    assert ran["worker-4-model-vllm"] == {"create"}
    assert ran["worker-1-firewall"] == {"update"}


def test_a_node_removed_is_deleted_without_a_failed_request(running):
    lab_plan, options = running
    result = upgrade.run(LABEL, [f"nodes={json.dumps(_nodes(lab_plan))}"], options)
    ran = _ran(result)
    assert result.ok, [(s.resource, s.detail[-300:]) for s in result.steps if not s.ok]
    assert result.failed == 0 and result.streams_cut == 0, result.failures
    assert ran["worker-4-model-vllm"] == {"delete"}
    assert not [name for name in ran if name.endswith("-vllm") and not name.startswith("worker-4")]
    assert not [name for name in lifecycle.lab_namespaces(LABEL) if name.endswith("node-worker-4")]


def test_an_image_bump_rolls_one_replica_at_a_time_without_a_failure(running):
    lab_plan, options = running
    result = upgrade.run(LABEL, ["model.image=vllm/vllm-openai:v0.33.1"], options)
    assert result.ok, [(s.resource, s.detail[-300:]) for s in result.steps if not s.ok]
    assert result.failed == 0 and result.streams_cut == 0, result.failures
    assert result.max_replicas_down == 1, result.down_at_max
    replaced = [s.resource for s in result.steps if s.resource.endswith("-model-vllm") and s.op == "create"]
    assert sorted(replaced) == sorted(f"{m.node}-model-vllm" for m in lab_plan.heads)
    assert result.images == {head.node: "vllm/vllm-openai:v0.33.1" for head in lab_plan.heads}


def test_a_container_that_cannot_start_stops_its_lane_and_the_next_change_converges(running):
    """The image pulls but its container cannot start (no /bin/bash: standins.NO_START_TAG_SUFFIX).
    docker created the container, then refused to start it: the step fails, the rollout stops at
    that replica with the rest serving; the state keeps the container by its id (a partial
    create), so the next good change replaces it with no hand cleanup and no name conflict."""
    lab_plan, options = running
    broken = upgrade.run(
        LABEL, [f"model.image=vllm/vllm-openai:v0.33.3{standins.NO_START_TAG_SUFFIX}"], options
    )
    assert not broken.ok
    failed = {s.resource: s.detail for s in broken.steps if not s.ok}
    assert list(failed) == ["master-model-vllm"], failed
    assert "Unable to start container" in failed["master-model-vllm"]
    assert broken.failed == 0 and broken.streams_cut == 0, broken.failures
    assert broken.max_replicas_down == 1, broken.down_at_max
    # Where it stopped, as `lab.py upgrade --json` reports it (stoppedAt, replicasNotReached,
    # replicasLeftOut): the master's lane, the rest never drained. A release that never becomes
    # healthy stops the same way at its health gate: `make bench` (labkit/bench.py LANE_CHANGES).
    document = broken.as_json()
    assert [where.split(":")[0] for where in document["stoppedAt"]] == ["master-model-vllm on master"]
    assert document["replicasNotReached"] == [head.node for head in lab_plan.heads if head.node != "master"]
    assert document["replicasLeftOut"] == ["master"]
    kept = executor.load_state(lifecycle.state_file(lab_plan)).render.named("master-model-vllm")
    assert kept.outputs["initErrors"] and kept.outputs["id"]
    assert kept.outputs["id"] in {
        c["Id"] for c in lifecycle.containers(lab_plan, lab_plan.node("master")).values()
    }

    fixed = upgrade.run(LABEL, ["model.image=vllm/vllm-openai:v0.33.4"], options)
    assert fixed.ok, [(s.resource, s.detail[-300:]) for s in fixed.steps if not s.ok]
    assert fixed.failed == 0 and fixed.streams_cut == 0, fixed.failures
    assert fixed.images == {head.node: "vllm/vllm-openai:v0.33.4" for head in lab_plan.heads}
    running_models = lifecycle.containers(lab_plan, lab_plan.node("master"), "model")
    assert [c["State"]["Running"] for c in running_models.values()] == [True]


def _router_requests(lab_plan) -> float:
    """vllm_router_requests_total, summed, from the router's own metrics listener (loopback on
    the load-balancer node, src/metrics.rs)."""
    where = lab_plan.node(lab_plan.cluster.load_balancer_node.name)
    url = f"http://127.0.0.1:{port_table.ROUTER_METRICS_PORT}/metrics"
    text = netns.call_in(where.namespace, lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm_router_requests_total")
    )


def _router_requests_or_none(lab_plan) -> float | None:
    try:
        return _router_requests(lab_plan)
    except OSError:  # refused: not listening yet
        return None


def test_with_cache_aware_routing_an_image_bump_takes_each_replica_out_of_the_router_first(running):
    """The rollout and the router agree: the real router (vllm-router 0.1.17, the program's
    container) in front of the replicas; each lane's drain removes its head from the router's
    worker set before the replica stops, its ready step adds it back after the health gate, and
    the requests through the router all answer."""
    lab_plan, options = running
    switched = upgrade.run(LABEL, ["loadBalancer.routing=cache-aware"], options)
    assert switched.ok, [(s.resource, s.detail[-300:]) for s in switched.steps if not s.ok]
    assert switched.failed == 0 and switched.streams_cut == 0, switched.failures
    assert {"router-router"} <= {s.resource for s in switched.steps if s.op == "create"}
    lb = lab_plan.node(lab_plan.cluster.load_balancer_node.name)
    engine = lifecycle.daemon(lab_plan, lb)
    since = dockerd.docker(
        engine, "inspect", "--format", "{{.State.StartedAt}}", "qwen-router"
    ).stdout.strip()
    # The router listens (its API and its metrics) only once every worker answered /health, which
    # may come after its container started: a clean-clone run found its metrics refused here.
    before = wait_until(
        lambda: _router_requests_or_none(lab_plan),
        what="the router's metrics listener",
        timeout=120,
        interval=0.5,
        done=lambda count: count is not None,
    )

    result = upgrade.run(LABEL, ["model.image=vllm/vllm-openai:v0.33.5"], options)
    assert result.ok, [(s.resource, s.detail[-300:]) for s in result.steps if not s.ok]
    assert result.failed == 0 and result.streams_cut == 0, result.failures
    assert result.max_replicas_down == 1, result.down_at_max
    assert result.images == {head.node: "vllm/vllm-openai:v0.33.5" for head in lab_plan.heads}
    # The router sent the load (nginx's backup servers would have answered too, router or not).
    assert _router_requests(lab_plan) - before >= result.requests / 2
    # Its own log (src/routers/http/router.rs): each head out, then in again, one lane at a time.
    logs = dockerd.docker(engine, "logs", "--since", since, "qwen-router").stdout
    logs += dockerd.docker(engine, "logs", "--since", since, "qwen-router").stderr
    events = re.findall(r"(Removed|Added) worker: http://([\d.]+):", logs)
    assert events == [
        (verb, head.ip) for head in _in_lane_order(lab_plan, result) for verb in ("Removed", "Added")
    ], events


def _in_lane_order(lab_plan, result):
    """The heads in the order their replacement ran."""
    order = [
        s.resource.removesuffix("-model-vllm") for s in result.steps if s.resource.endswith("-model-vllm")
    ]
    return [lab_plan.node(name) for name in dict.fromkeys(order)]
