"""Day 2 on bare metal, decided offline: two renders of onprem compared with the replacement
rules of tooling/changes/ (the engine's update / replace / delete-before-replace), and
the rollout chain's shape in the dependency graph."""

from __future__ import annotations

import json

import pytest

from tests.helpers.baremetal import shellcheck
from tooling import changes, offline, stackfile

COMMAND = "command:remote:Command"
CONTAINER = "docker:index/container:Container"
NODES = ["master", "worker-1", "worker-2", "worker-3"]
BASE = stackfile.read("onprem")


def render_with(*change: str, nodes: list[dict] | None = None) -> offline.Render:
    """onprem with `change`s; `nodes` also pins a host key for each new node, as
    scripts/hostkeys.py would before `pulumi up`."""
    base = BASE if nodes is None else stackfile.with_nodes(BASE, nodes)
    result = offline.render(changes.apply_changes(base, list(change)), "onprem")
    assert result.error is None, result.error
    return result


@pytest.fixture(scope="module")
def before() -> offline.Render:
    return render_with()


def moved(old: offline.Render, new: offline.Render) -> dict[str, changes.Change]:
    """What changes, monitoring aside (its own component, judged by tests/test_baremetal_monitoring.py)."""
    return {
        c.name: c
        for c in changes.diff(old, new)
        if c.action != "same" and "-monitoring" not in c.name and not c.name.startswith("monitoring")
    }


def test_an_image_bump_replaces_exactly_the_model_containers_one_replica_at_a_time(before):
    after = render_with("model.image=vllm/vllm-openai:v0.33.1")
    diff = moved(before, after)
    replaced = {name for name, c in diff.items() if c.action == "replace" and c.type == CONTAINER}
    assert replaced == {f"{n}-model-vllm" for n in NODES}
    assert {diff[name].strategy for name in replaced} == {"delete-before-replace"}
    assert "load-balancer-nginx" not in diff and "load-balancer-config" not in diff
    # Every node stages the image, then the drain and the gate of every replica run (update), and
    # each node's verify runs again (its checks compare the running container's image with
    # model.image, qwen_cluster/render/nodecheck.py); nothing else of the chain moves.
    commands = {name for name, c in diff.items() if c.type == COMMAND}
    assert commands == {f"{n}-{step}" for n in NODES for step in ("model-stage", "drain", "ready", "verify")}
    assert {diff[name].action for name in commands} == {"update"}
    summary = changes.rollout(before, after)
    assert summary.max_replicas_out_of_service == 1
    assert summary.steps == [["master"], ["worker-1"], ["worker-2"], ["worker-3"]]
    assert summary.endpoint_stays_up and not summary.collisions


def test_vllm_flags_roll_the_same_way(before):
    after = render_with('model.vllmFlags={"--max-num-seqs": 64}')
    replaced = {n for n, c in moved(before, after).items() if c.action == "replace"}
    assert replaced == {f"{n}-model-vllm" for n in NODES}
    assert changes.rollout(before, after).max_replicas_out_of_service == 1


def test_the_chain_orders_drain_container_gate_then_the_next_replica(before):
    graph = before.dependencies()
    previous = None
    for node in NODES:
        drain, container, ready = f"{node}-drain", f"{node}-model-vllm", f"{node}-ready"
        assert drain in graph[container]
        assert container in graph[ready]
        if previous is not None:
            assert previous in graph[drain]
        assert {"load-balancer-config", "load-balancer-nginx"} <= graph[drain]
        previous = ready


def test_day_0_runs_no_drain_and_no_wait_for_a_model_load(before):
    """Nothing is drained on create; a gate waits only for a server marked down, and on the
    first install no server is. The cost of the chain on day 0 is one container creation and
    one short command per replica, in sequence."""
    for node in NODES:
        drain = before.named(f"{node}-drain").inputs
        assert "create" not in drain and "drain" in drain["update"]
        ready = before.named(f"{node}-ready").inputs
        assert 'if ! server_flag "$address" "$upstream" down; then' in ready["create"]
        assert 'if ! server_flag "$address" "$upstream" down; then' not in ready["update"]
        assert (
            drain["triggers"] == ready["triggers"] == [before.named(f"{node}-verify").inputs["triggers"][0]]
        )
    chain = before.critical_path()
    assert chain[-1] == "master-verify"


def test_adding_a_node_touches_no_running_container(before):
    nodes = [*BASE["qwen-cluster:nodes"], {"name": "worker-4", "ip": "192.168.1.104"}]
    after = render_with(nodes=nodes)
    diff = moved(before, after)
    assert not [n for n, c in diff.items() if c.type == CONTAINER and c.action != "create"]
    assert {n for n, c in diff.items() if c.action in ("replace", "delete")} == set()
    everything = {c.name: c for c in changes.diff(before, after)}
    for name in [*(f"{n}-model-vllm" for n in NODES), "load-balancer-nginx"]:
        assert everything[name].action == "same", name
    # Firewalls and the load balancer's upstream change in place; the new node's chain is new.
    assert {n for n, c in diff.items() if c.action == "update"} == {
        *(f"{n}-firewall" for n in NODES),
        *(f"{n}-verify" for n in NODES),
        "load-balancer-config",
    }
    assert {diff[f"{n}-firewall"].keys[0] for n in NODES} == {"create"}
    assert {"worker-4-drain", "worker-4-model-vllm", "worker-4-ready"} <= {
        n for n, c in diff.items() if c.action == "create"
    }
    assert "worker-3-ready" in after.dependencies()["worker-4-drain"]
    summary = changes.rollout(before, after)
    assert summary.max_replicas_out_of_service == 0 and summary.endpoint_stays_up


def test_adding_a_node_leaves_the_barriers_unchanged(before):
    """A barrier's new dependency edge is not an input: the engine sees no change (pulumi/pulumi
    step_generator.go diffs inputs only), so nothing behind it re-runs."""
    nodes = [*BASE["qwen-cluster:nodes"], {"name": "worker-4", "ip": "192.168.1.104"}]
    after = render_with(nodes=nodes)
    everything = {c.name: c for c in changes.diff(before, after)}
    assert everything["cluster-set-up"].action == everything["cluster-started"].action == "same"
    assert "worker-4-selinux" in after.dependencies()["cluster-set-up"]


def test_removing_a_node_deletes_only_its_own_resources(before):
    nodes = [n for n in BASE["qwen-cluster:nodes"] if n["name"] != "worker-3"]
    after = render_with(nodes=nodes)
    diff = moved(before, after)
    deleted = {n for n, c in diff.items() if c.action == "delete"}
    assert deleted and all(n.startswith("worker-3-") for n in deleted)
    assert {"worker-3-ready", "worker-3-model-vllm", "worker-3-drain", "worker-3-firewall"} <= deleted
    assert not [n for n, c in diff.items() if c.action == "replace"]
    # The gate's delete drains the leaving replica before its container goes.
    assert "drain" in before.named("worker-3-ready").inputs["delete"]
    assert changes.rollout(before, after).max_replicas_out_of_service == 0


def test_a_sysctl_change_updates_the_sysctl_steps_in_place_only(before):
    values = {"net.core.rmem_max": 33554432, "net.core.wmem_max": 16777216, "net.ipv4.tcp_fastopen": 3}
    after = render_with(f"tuning.sysctl={json.dumps(values)}")
    diff = moved(before, after)
    assert set(diff) == {f"{n}-sysctl" for n in NODES}
    assert {c.action for c in diff.values()} == {"update"}


def test_a_firewall_flavour_change_replaces_create_before_delete(before):
    after = render_with("bareMetal.firewall=nftables")
    diff = moved(before, after)
    firewalls = {n: diff[f"{n}-firewall"] for n in NODES}
    assert {(c.action, c.strategy) for c in firewalls.values()} == {("replace", "create-before-delete")}
    assert not [n for n, c in diff.items() if c.type == CONTAINER]


def test_a_pipeline_parallel_replica_is_drained_and_gated_as_one():
    after = render_with("model.pipelineParallel=2")
    graph = after.dependencies()
    assert {r.name for r in after.of_type(COMMAND) if r.name.endswith("-drain")} == {
        "master-drain",
        "worker-2-drain",
    }
    assert "master-drain" in graph["worker-1-model-vllm"] and "master-drain" in graph["master-model-vllm"]
    assert {"master-model-vllm", "worker-1-model-vllm"} <= graph["master-ready"]
    assert "master-ready" in graph["worker-2-drain"]
    bumped = offline.render(
        changes.apply_changes(BASE, ["model.pipelineParallel=2", "model.image=vllm/vllm-openai:v0.33.1"]),
        "onprem",
    )
    summary = changes.rollout(after, bumped)
    assert summary.max_replicas_out_of_service == 1
    assert summary.steps == [["master+worker-1"], ["worker-2+worker-3"]]


def test_registered_rollout_and_load_balancer_scripts_are_shellcheck_clean(before, tmp_path):
    for name, keys in (
        ("master-drain", ("update",)),
        ("worker-2-ready", ("create", "update", "delete")),
        ("load-balancer-config", ("create", "delete")),
    ):
        for key in keys:
            shellcheck(before.named(name).inputs[key], tmp_path)


def test_with_pipeline_parallel_a_new_replica_leaves_the_others_containers_alone():
    """Ray and peer addresses are per replica (the head's), so two nodes joining as a new
    replica change no existing container."""
    before = render_with("model.pipelineParallel=2")
    nodes = [
        *BASE["qwen-cluster:nodes"],
        {"name": "worker-4", "ip": "192.168.1.104"},
        {"name": "worker-5", "ip": "192.168.1.105"},
    ]
    after = render_with("model.pipelineParallel=2", nodes=nodes)
    diff = {c.name: c for c in changes.diff(before, after)}
    assert {diff[f"{n}-model-vllm"].action for n in NODES} == {"same"}
    assert diff["worker-4-model-vllm"].action == diff["worker-5-model-vllm"].action == "create"
    assert "worker-4-drain" in after.dependencies()["worker-5-model-vllm"]
