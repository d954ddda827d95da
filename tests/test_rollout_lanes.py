"""Changes roll in rollout.maxUnavailable independent lanes on both targets, and day 0 does not
wait on them: the dependency graph of the real program, rendered offline at 4 and 16 nodes."""

from __future__ import annotations

import functools
import json
import math

import pytest

from tooling import bench, changes, offline

IMAGE_BUMP = "model.image=vllm/vllm-openai:v0.33.1"
# On each target: the resource that gates a replica (by head name), and its first drain.
GATE = {"prod": "gpu-nodes-{}-server", "onprem": "{}-ready"}
FIRST = {"prod": "gpu-nodes-{}-server", "onprem": "{}-drain"}


@functools.lru_cache(maxsize=8)
def _render(stack: str, count: int, change: str | None) -> offline.Render:
    config = bench.scaled_stack(stack, count)
    if change:
        config = changes.apply_changes(config, [change])
    result = offline.render(json.loads(json.dumps(config)), stack)
    assert result.error is None, result.error
    return result


def render(stack: str, count: int, change: str | None = None) -> offline.Render:
    return _render(stack, count, change)


def heads(count: int) -> list[str]:
    return ["master" if index == 0 else f"worker-{index}" for index in range(count)]


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_replica_i_waits_for_the_gate_of_replica_i_minus_k_only(stack):
    graph = render(stack, 16).dependencies()
    names = heads(16)  # one replica per node, k = 25 % of 16 = 4
    for index in range(4, 16):
        first = FIRST[stack].format(names[index])
        assert GATE[stack].format(names[index - 4]) in graph[first]
        others = {GATE[stack].format(name) for name in names if name != names[index - 4]}
        assert not others & graph[first], first


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_a_lanes_first_replica_waits_for_no_other_replica(stack):
    graph = render(stack, 16).dependencies()
    gates = {GATE[stack].format(name) for name in heads(16)}
    for name in heads(16)[:4]:
        assert not gates & graph[FIRST[stack].format(name)]


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_the_day_0_critical_path_is_the_same_at_4_and_16_nodes(stack):
    assert len(render(stack, 4).critical_path()) == len(render(stack, 16).critical_path())


def test_on_aws_a_lanes_next_machine_waits_for_the_previous_replicas_health_gate():
    graph = render("prod", 16).dependencies()
    assert graph["gpu-nodes-worker-5"] == {"gpu-nodes-worker-5-template", "gpu-nodes-worker-1-server"}
    # The permissions only: draining (and, prod reading its weights from S3, the weights read).
    permissions = {"model-server-drain", "model-server-weights"}
    assert graph["gpu-nodes-worker-1"] == {"gpu-nodes-worker-1-template", *permissions}


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_an_image_bump_at_16_nodes_takes_4_replicas_out_at_most_in_4_turns(stack):
    summary = changes.rollout(render(stack, 16), render(stack, 16, IMAGE_BUMP))
    assert summary.max_replicas_out_of_service == 4 and summary.endpoint_stays_up
    assert len(summary.steps) == math.ceil(16 / 4)
    assert summary.steps[0] == sorted(heads(16)[:4])


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_a_count_of_two_makes_two_lanes_of_eight(stack):
    config = bench.scaled_stack(stack, 16)
    config["qwen-cluster:rollout"] = {"maxUnavailable": 2}
    before = offline.render(config, stack)
    after = offline.render(changes.apply_changes(config, [IMAGE_BUMP]), stack)
    summary = changes.rollout(before, after)
    assert summary.max_replicas_out_of_service == 2 and len(summary.steps) == 8
    assert before.outputs["rollout"]["lanes"][1] == heads(16)[1::2]


# What every lane's first drain waits for: the staging of every node, through one resource.
STAGED = {"prod": "gpu-nodes-stage", "onprem": "cluster-staged"}


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_every_lanes_first_drain_waits_for_the_staging_of_every_node(stack):
    graph = render(stack, 16).dependencies()
    waiting = {name for name, found in graph.items() if STAGED[stack] in found}
    assert waiting == {FIRST[stack].format(name) for name in heads(16)[:4]}


def test_on_bare_metal_the_staged_barrier_waits_for_every_nodes_stage():
    graph = render("onprem", 16).dependencies()
    assert graph["cluster-staged"] == {f"{name}-model-stage" for name in heads(16)}


def test_on_aws_staging_everywhere_targets_the_stacks_nodes_by_tag_and_waits_for_the_first_turn():
    result = render("prod", 16)
    stage = result.named("gpu-nodes-stage")
    assert {t["key"] for t in stage.inputs["targets"]} == {"tag:qwen-cluster:role", "tag:qwen-cluster:stack"}
    assert stage.inputs["maxConcurrency"] == "100%"
    machines = {name for name in result.dependencies()["gpu-nodes-stage"] if name.startswith("gpu-nodes-")}
    # The first replica of each lane: machines that wait for no gate, so no cycle.
    assert machines == {f"gpu-nodes-{name}" for name in heads(16)[:4]}


@pytest.mark.parametrize("stack", ["prod", "onprem"])
def test_the_plan_names_what_is_staged_before_the_first_lane_drains(stack):
    before, after = render(stack, 4), render(stack, 4, IMAGE_BUMP)
    expected = ["gpu-nodes-stage"] if stack == "prod" else sorted(f"{n}-model-stage" for n in heads(4))
    assert sorted(changes.rollout(before, after).staged_first) == expected
