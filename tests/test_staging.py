"""Stage before drain, as the program registers it: one staging step per node on both targets,
changed exactly when the image or the weights change, before that node's model server."""

from __future__ import annotations

import json

import pytest

from qwen_cluster import config
from qwen_cluster.render import ssm, weights
from tests.helpers.aws_stacks import render, render_stack, variant
from tooling import changes, offline, stackfile

COMMAND = "command:remote:Command"
ASSOCIATION = "aws:ssm/association:Association"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ONPREM = stackfile.read("onprem")
NODES = [node["name"] for node in ONPREM["qwen-cluster:nodes"]]
PREFIX = "s3://qwen-weights-example/Qwen/Qwen3-32B/"


def onprem(*change: str) -> offline.Render:
    result = offline.render(changes.apply_changes(ONPREM, list(change)), "onprem")
    assert result.error is None, result.error
    return result


@pytest.fixture(scope="module")
def bare_metal() -> offline.Render:
    return onprem()


def test_every_bare_metal_node_has_one_stage_command_keyed_by_its_address(bare_metal):
    stages = {r.name: r for r in bare_metal.of_type(COMMAND) if r.name.endswith("-model-stage")}
    assert sorted(stages) == sorted(f"{node}-model-stage" for node in NODES)
    cluster = stackfile.load("onprem")
    for node in cluster.nodes:
        stage = stages[f"{node.name}-model-stage"]
        assert stage.inputs["triggers"] == [str(node.ip)]
        connection = stage.inputs["connection"]
        assert connection.get("value", connection)["host"] == str(node.ip)  # a secret: the key
        assert weights.stage_script(cluster, cluster.bare_metal.weights_cache) in stage.inputs["create"]
        assert "delete" not in stage.inputs  # the cache outlives the containers


def test_a_bare_metal_container_starts_only_after_its_own_node_staged(bare_metal):
    for node in NODES:
        assert f"{node}-model-stage" in bare_metal.named(f"{node}-model-vllm").depends_on
        assert f"{node}-model-stage" in bare_metal.named(f"{node}-model-image").depends_on


def test_staging_waits_for_host_setup_and_for_no_other_replica(bare_metal):
    # Host setup through the one barrier that waits for every host (connection.barrier).
    assert bare_metal.named("worker-3-model-stage").depends_on == ["cluster-set-up"]


@pytest.mark.parametrize(
    "change",
    [
        "model.image=vllm/vllm-openai:v0.33.1",
        'model.weights={"source": "mirror", "uri": "https://m.internal"}',
    ],
)
def test_an_image_or_weights_change_reruns_every_nodes_staging_in_place(bare_metal, change):
    moved = {c.name: c for c in changes.diff(bare_metal, onprem(change)) if c.name.endswith("-model-stage")}
    assert sorted(moved) == sorted(f"{node}-model-stage" for node in NODES)
    assert {c.action for c in moved.values()} == {"update"}  # `create` runs again, nothing replaced


@pytest.mark.parametrize("change", ["rollout.drainTimeoutSeconds=60", "bareMetal.firewall=nftables"])
def test_other_changes_leave_staging_alone(bare_metal, change):
    assert not [
        c
        for c in changes.diff(bare_metal, onprem(change))
        if c.name.endswith("-model-stage") and c.action != "same"
    ]


def test_the_host_cache_is_what_the_model_container_mounts():
    result = onprem('bareMetal.weightsCache="/srv/models/hf"')
    volume = result.named("master-model-vllm").inputs["volumes"][0]
    assert (volume["hostPath"], volume["containerPath"]) == ("/srv/models/hf", weights.CONTAINER_CACHE)
    assert "install -d -m 0755 /srv/models/hf" in result.named("master-model-stage").inputs["create"]


# --- AWS ------------------------------------------------------------------------------------


def test_every_aws_node_has_a_staging_association_waited_for_before_its_server():
    result = render_stack("prod")
    cluster = stackfile.load("prod")
    for node in cluster.nodes:
        stage = result.named(f"gpu-nodes-{node.name}-stage")
        assert stage.type == ASSOCIATION
        assert stage.inputs["name"].startswith("model-server-stage-document")  # the mock's name
        assert stage.inputs["targets"] == [{"key": "InstanceIds", "values": [f"gpu-nodes-{node.name}-id"]}]
        script = ssm.decoded(stage.inputs["parameters"]["StageScript"])
        assert script == weights.stage_script(cluster, ssm.HF_CACHE)
        assert stage.inputs["waitForSuccessTimeoutSeconds"] == ssm.STAGE_TIMEOUT_SECONDS
        assert set(stage.replace_on_changes) == {"parameters", "targets"}
        assert stage.name in result.named(f"gpu-nodes-{node.name}-server").depends_on
        # Its instance and the permissions only (prod reads its weights from S3): on a change
        # every node stages at once.
        assert stage.depends_on == ["model-server-drain", "model-server-weights"]


def test_the_aws_staging_changes_with_the_image_and_replaces_without_gating_a_replica():
    before = render_stack("dev")
    after = render(variant("dev", model={"image": "vllm/vllm-openai:v0.33.1"}))
    moved = {c.name: c.action for c in changes.diff(before, after) if c.name.endswith("-stage")}
    assert moved == {"gpu-nodes-master-stage": "replace", "gpu-nodes-worker-1-stage": "replace"}
    assert changes.rollout(before, after).steps == [["master"], ["worker-1"]]


def test_s3_weights_give_the_node_role_read_on_exactly_the_prefix():
    result = render(variant("dev", model={"weights": {"source": "s3", "uri": PREFIX}}))
    policy = result.named("model-server-weights")
    assert policy.type == ROLE_POLICY and policy.inputs["role"].startswith("gpu-node-role-role")
    cluster = config.validate(
        stackfile.cluster_keys(variant("dev", model={"weights": {"source": "s3", "uri": PREFIX}}))
    )
    assert json.loads(policy.inputs["policy"]) == weights.s3_read_policy(cluster.model.weights)
    # In place before the first staging runs, which reads the prefix.
    assert "model-server-weights" in result.named("gpu-nodes-master-stage").depends_on


def test_prod_reads_its_weights_from_its_s3_prefix():
    result = render_stack("prod")
    policy = json.loads(result.named("model-server-weights").inputs["policy"])
    assert policy["Statement"][0]["Resource"] == "arn:aws:s3:::qwen-cluster-weights-example/Qwen/Qwen3-32B/*"
    script = ssm.decoded(result.named("gpu-nodes-master-stage").inputs["parameters"]["StageScript"])
    assert "aws s3 sync" in script and "export AWS_DEFAULT_REGION=us-east-1" in script


def test_hub_weights_give_the_node_role_no_s3_read():
    assert not [r for r in render_stack("dev").of_type(ROLE_POLICY) if r.name == "model-server-weights"]
