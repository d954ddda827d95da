"""Staging (qwen_cluster/render/weights.py): the script that puts the image and the weights on a
node before any drain, what the model server loads, and the node role's read on the S3 prefix."""

from __future__ import annotations

import json
import shlex

import pytest

from qwen_cluster import config
from qwen_cluster.render import ssm, vllm, weights
from tests.helpers.aws_stacks import variant
from tests.helpers.baremetal import shellcheck
from tooling import stackfile

PREFIX = "s3://qwen-weights-example/Qwen/Qwen3-32B/"
CACHE = "/var/cache/qwen-cluster/huggingface"


def cluster(stack: str = "onprem", **weights_section) -> config.ClusterConfig:
    raw = variant(stack, model={"weights": weights_section}) if weights_section else stackfile.read(stack)
    return config.validate(stackfile.cluster_keys(raw))


def lines(script: str) -> list[list[str]]:
    return [shlex.split(line) for line in script.splitlines() if line and not line.startswith("#")]


def command(script: str, program: str, verb: str) -> list[str]:
    return next(words for words in lines(script) if words[:2] == [program, verb])


SCRIPTS = {
    "hub": lambda: weights.stage_script(cluster(), CACHE),
    "mirror": lambda: weights.stage_script(cluster(source="mirror", uri="https://hf-mirror.internal"), CACHE),
    "s3": lambda: weights.stage_script(cluster("dev", source="s3", uri=PREFIX), ssm.HF_CACHE),
    "aws-run": lambda: ssm.shell_check_text(ssm.stage_run_script(), ssm.STAGE_PARAMETERS),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_stage_scripts_are_shellcheck_clean(name, tmp_path):
    shellcheck(SCRIPTS[name](), tmp_path)


def test_staging_pulls_the_image_before_it_fetches_the_weights():
    script = SCRIPTS["hub"]()
    pull = command(script, "docker", "pull")
    assert pull[-1] == "vllm/vllm-openai:v0.33.0"
    assert script.index("docker pull") < script.index("docker run")


def test_hub_weights_are_fetched_by_the_staged_image_into_the_host_cache():
    run = command(SCRIPTS["hub"](), "docker", "run")
    assert "--rm" in run and f"--volume={CACHE}:{weights.CONTAINER_CACHE}:z" in run
    assert f"--env=HF_HOME={weights.CONTAINER_CACHE}" in run
    assert not any(word.startswith("--env=HF_ENDPOINT") for word in run)
    image = run.index("vllm/vllm-openai:v0.33.0")
    assert run[image - 1] == "--entrypoint=python3" and run[image + 1] == "-c"
    assert "snapshot_download" in run[image + 2] and run[image + 3] == "Qwen/Qwen3-32B"


def test_a_mirror_is_the_fetchs_hf_endpoint():
    run = command(SCRIPTS["mirror"](), "docker", "run")
    assert "--env=HF_ENDPOINT=https://hf-mirror.internal" in run


def test_s3_weights_are_synced_from_the_prefix_in_the_stacks_region():
    script = SCRIPTS["s3"]()
    sync = command(script, "aws", "s3")
    target = f"{ssm.HF_CACHE}/{weights.S3_COPY_DIR}/Qwen/Qwen3-32B"
    assert sync[2:] == ["sync", "--only-show-errors", "--no-progress", PREFIX, target]
    assert "export AWS_DEFAULT_REGION=us-west-2" in script
    assert "docker run" not in script


def test_the_stage_script_changes_exactly_with_the_image_or_the_weights():
    base = weights.stage_script(cluster(), CACHE)
    assert weights.stage_script(cluster(), CACHE) == base
    other_image = config.validate(
        stackfile.cluster_keys(variant("onprem", model={"image": "vllm/vllm-openai:v0.33.1"}))
    )
    assert weights.stage_script(other_image, CACHE) != base
    assert weights.stage_script(cluster(source="mirror", uri="https://m.internal"), CACHE) != base
    sysctl = variant(
        "onprem", tuning={"sysctl": {"net.core.rmem_max": 1}}, rollout={"drainTimeoutSeconds": 60}
    )
    assert weights.stage_script(config.validate(stackfile.cluster_keys(sysctl)), CACHE) == base


def test_the_server_loads_the_staged_copy_offline():
    assert weights.server_environment(cluster()) == {
        "HF_HOME": weights.CONTAINER_CACHE,
        "HF_HUB_OFFLINE": "1",
    }
    assert vllm.serve_argv(cluster())[2] == "Qwen/Qwen3-32B"  # resolved in the cache
    s3 = cluster("dev", source="s3", uri=PREFIX)
    argv = vllm.serve_argv(s3)
    assert argv[2] == f"{weights.CONTAINER_CACHE}/{weights.S3_COPY_DIR}/Qwen/Qwen3-32B"
    assert "--served-model-name=Qwen/Qwen3-32B" in argv  # clients still ask for model.name


def test_the_s3_read_policy_allows_exactly_the_prefix():
    policy = weights.s3_read_policy(cluster("dev", source="s3", uri=PREFIX).model.weights)
    get, listing = policy["Statement"]
    assert (get["Action"], get["Resource"]) == (
        "s3:GetObject",
        "arn:aws:s3:::qwen-weights-example/Qwen/Qwen3-32B/*",
    )
    assert (listing["Action"], listing["Resource"]) == ("s3:ListBucket", "arn:aws:s3:::qwen-weights-example")
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["Qwen/Qwen3-32B", "Qwen/Qwen3-32B/*"]}}
    assert {statement["Effect"] for statement in policy["Statement"]} == {"Allow"}
    assert (
        json.loads(weights.s3_read_policy_json(cluster("dev", source="s3", uri=PREFIX).model.weights))
        == policy
    )


def test_there_is_no_read_policy_without_an_s3_source():
    with pytest.raises(ValueError, match="not s3"):
        weights.s3_read_policy(cluster("dev").model.weights)
