"""Ray's own surfaces: the dashboard on loopback, token authentication with `rayAuthToken` as a
Pulumi secret end to end (bare metal: the container's environment inside the secret's apply;
AWS: an SSM SecureString the run script reads), required when replicas span nodes through Ray
(model.distributedBackend ray, with an image that carries Ray)."""

from __future__ import annotations

import json

import pulumi
import pytest

from qwen_cluster import config, topology
from qwen_cluster.render import ssm
from tests.helpers.aws_stacks import render, variant
from tests.helpers.secrets import SECRET_SIG, shown_in_clear
from tooling import offline, stackfile

TOKEN = offline.OFFLINE_RAY_TOKEN
# Ray runs only from an image that carries it (the official one does not since vLLM PR #36170).
RAY = {"pipelineParallel": 2, "distributedBackend": "ray", "image": "registry.example/vllm-with-ray:v0.33.0"}


@pytest.fixture(scope="module")
def onprem_pipeline() -> offline.Render:
    stack = stackfile.read("onprem")
    stack["qwen-cluster:model"] = {**stack["qwen-cluster:model"], **RAY}
    result = offline.render(stack, "onprem")
    assert result.error is None, result.error
    return result


@pytest.fixture(scope="module")
def prod_pipeline() -> offline.Render:
    return render(variant("prod", model=RAY), "prod")


def test_the_ray_dashboard_binds_loopback_on_the_head_only():
    pinned = topology.pin_ports(stackfile.load("onprem").ports[1])
    assert "--dashboard-host=127.0.0.1" in pinned.ray_start_args(head=True)
    assert not [a for a in pinned.ray_start_args(head=False, head_ip="10.0.0.1") if "dashboard-host" in a]


def test_a_pipeline_parallel_stack_without_a_ray_token_is_refused():
    cluster = stackfile.load("onprem")
    update = {"pipeline_parallel": 2, "distributed_backend": "ray"}
    two = cluster.model_copy(update={"model": cluster.model.model_copy(update=update)})
    pulumi.runtime.set_all_config({}, [])
    with pytest.raises(config.ConfigError) as refused:
        config.ray_auth_token(two)
    assert str(refused.value).endswith(
        "qwen-cluster:rayAuthToken is required when model.pipelineParallel is 2 with "
        "model.distributedBackend ray (Ray joins a replica's nodes and authenticates with it): "
        "pulumi config set --secret rayAuthToken $(openssl rand -hex 32)"
    )
    assert config.ray_auth_token(cluster) is None  # one node per replica: no Ray, no token
    mp = cluster.model_copy(update={"model": cluster.model.model_copy(update={"pipeline_parallel": 2})})
    assert config.ray_auth_token(mp) is None  # vLLM's own multi-node launch: no Ray, no token


def test_bare_metal_gives_every_ray_container_the_token_as_a_secret(onprem_pipeline):
    containers = [r for r in onprem_pipeline.resources if r.name.endswith("-model-vllm")]
    assert len(containers) == 4
    for container in containers:
        envs = container.inputs["envs"]
        assert SECRET_SIG in envs, container.name  # the whole list is secret
        assert "RAY_AUTH_MODE=token" in envs["value"]
        assert f"RAY_AUTH_TOKEN={TOKEN}" in envs["value"]
    assert shown_in_clear(onprem_pipeline.resources, TOKEN) == []


def test_without_ray_no_container_carries_a_token():
    result = offline.render_stack("onprem")
    envs = [r.inputs["envs"] for r in result.resources if r.name.endswith("-model-vllm")]
    assert envs and all(isinstance(e, list) and not [x for x in e if x.startswith("RAY_AUTH")] for e in envs)


def test_aws_keeps_the_token_in_a_securestring_the_nodes_alone_may_read(prod_pipeline):
    # (The endpoint's API keys are SecureStrings of their own: components/aws/proxy.py.)
    (parameter,) = [
        p for p in prod_pipeline.of_type("aws:ssm/parameter:Parameter") if p.name.endswith("ray-auth-token")
    ]
    assert parameter.inputs["type"] == "SecureString"
    assert parameter.inputs["name"] == "/qwen-cluster/prod/ray-auth-token"
    assert SECRET_SIG in parameter.inputs["value"]
    policy = json.loads(prod_pipeline.named("model-server-ray-auth-token-read").inputs["policy"])
    assert policy["Statement"] == [
        {"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": parameter.outputs["arn"]}
    ]
    assert shown_in_clear(prod_pipeline.resources, TOKEN) == []


def test_aws_associations_name_the_parameter_and_its_version_never_the_token(prod_pipeline):
    servers = [
        r for r in prod_pipeline.of_type("aws:ssm/association:Association") if r.name.endswith("-server")
    ]
    assert len(servers) == 4
    for server in servers:
        parameters = server.inputs["parameters"]
        assert parameters["RayTokenParameter"] == "/qwen-cluster/prod/ray-auth-token"
        assert parameters["RayTokenVersion"] != ""
        assert TOKEN not in json.dumps(parameters)


def test_the_run_script_reads_the_token_with_decryption_into_a_root_only_env_file():
    script = ssm.run_script()
    assert 'aws ssm get-parameter --name "$RAY_TOKEN_PARAMETER"' in script
    assert "--with-decryption" in script
    assert f"install -m 0600 /dev/null {ssm.ENV_FILE}" in script


def test_the_labs_ray_refuses_token_mode_without_a_token_as_ray_does(monkeypatch, capsys, tmp_path):
    from labkit.images import imagebin


    monkeypatch.setenv(imagebin.RAY_DIR_ENV, str(tmp_path))  # where its raylet's pid goes
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert imagebin.ray(["start", "--head"]) == 1
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    assert imagebin.ray(["start", "--head"]) == 0
    assert imagebin.ray(["stop"]) == 0


def _onprem_pipeline_with_token(token: str) -> offline.Render:
    stack = stackfile.read("onprem")
    stack["qwen-cluster:model"] = {**stack["qwen-cluster:model"], **RAY}
    stack["qwen-cluster:rayAuthToken"] = token
    result = offline.render(stack, "onprem")
    assert result.error is None, result.error
    return result


def test_a_new_ray_token_on_bare_metal_drains_each_replica_before_replacing_its_containers():
    from tooling import changes

    moved = changes.diff(_onprem_pipeline_with_token("a" * 64), _onprem_pipeline_with_token("b" * 64))
    actions = {(c.name, str(c.action)) for c in moved if str(c.action) != "same"}
    drains = {name for name, action in actions if name.endswith("-drain") and action == "update"}
    replaced = {name for name, action in actions if name.endswith("-model-vllm") and action == "replace"}
    assert drains == {"master-drain", "worker-2-drain"}  # both replica heads
    assert replaced == {f"{node}-model-vllm" for node in ("master", "worker-1", "worker-2", "worker-3")}
    assert shown_in_clear(_onprem_pipeline_with_token("a" * 64).resources, "a" * 64) == []
