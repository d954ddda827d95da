"""The model-server run (qwen_cluster/render/ssm.py) on a node, against stand-in docker and aws
commands (tests/helpers/ssm_run.py): a new stack's replicas start without waiting for a model
load; a replica that served is drained first, only once every other registered target is in
service, and gates its lane on /health; a pipeline worker drains its replica's head before it
restarts."""

from __future__ import annotations

import pytest

from qwen_cluster.render import ssm
from tests.helpers.ssm_run import Node
from tooling import stackfile

TARGET_GROUP = "arn:aws:elasticloadbalancing:tg/heads"
TARGET = "Id=i-0head,Port=5000"
REGISTER = f"elbv2 register-targets --target-group-arn {TARGET_GROUP} --targets {TARGET}"
DEREGISTER = "elbv2 de" + REGISTER.removeprefix("elbv2 ")


def parameters(node_name: str = "master", pipeline: int = 1) -> dict[str, str]:
    from qwen_cluster import config
    from tests.helpers.aws_stacks import variant

    cluster = config.validate(stackfile.cluster_keys(variant("prod", model={"pipelineParallel": pipeline})))
    values = ssm.parameters(
        cluster, node_name, target_group_arn=TARGET_GROUP, target_id="i-0head"
    )
    return {name: str(value) for name, value in values.items()}


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def test_on_a_new_stack_the_head_starts_registers_and_returns_without_waiting_for_health(node):
    run = node.run(parameters())
    assert run.returncode == 0, run.output
    assert run.called("docker run") and run.called(REGISTER)
    assert not (run.called("curl") or run.called("deregister-targets") or run.called("target-in-service"))


def test_a_head_that_served_is_drained_before_its_container_goes_and_waits_for_health(node):
    node.runs("an-older-configuration")
    node.serving()
    run = node.run(parameters(), health_seconds=60)
    assert run.returncode == 0, run.output
    assert run.index("deregister-targets") < run.index("wait target-deregistered") < run.index("docker rm")
    assert run.index("docker run") < run.index("curl") < run.index("elbv2 register-targets") < run.index(
        "target-in-service"
    )


def test_a_head_that_served_drains_only_once_every_other_target_is_in_service(node):
    # The other replica still loads (its target `initial`, as after a day 0 that did not wait),
    # then it is in service: only then may this one leave (rollout.maxUnavailable 1).
    node.runs("an-older-configuration")
    node.serving()
    node.out_of_service("i-0other", "i-0other", "")
    run = node.run(parameters(), health_seconds=60)
    assert run.returncode == 0, run.output
    asked = [n for n, call in enumerate(run.calls) if "describe-target-health" in call and "initial" in call]
    assert len(asked) == 3 and all("i-0head" in run.calls[n] for n in asked)
    assert asked[-1] < run.index("deregister-targets") < run.index("docker stop")


def test_a_head_whose_other_targets_stay_out_of_service_fails_and_keeps_serving(node):
    node.runs("an-older-configuration")
    node.serving()
    node.out_of_service("i-0other")
    run = node.run(parameters(), health_seconds=0)
    assert run.returncode == 1
    assert "i-0other" in run.output and "rollout.maxUnavailable" in run.output, run.output
    assert not (run.called("deregister-targets") or run.called("docker stop") or run.called("docker run"))


def test_a_new_head_joining_a_serving_cluster_waits_for_health(node):
    node.healthy_targets(3)
    node.serving()
    run = node.run(parameters(), health_seconds=60)
    assert run.returncode == 0 and run.called("curl") and run.called("target-in-service"), run.output
    assert not run.called("deregister-targets")


def test_a_head_that_never_answers_health_fails_the_run_and_stays_out(node):
    node.runs("an-older-configuration")
    run = node.run(parameters(), health_seconds=0)
    assert run.returncode == 1
    assert "rollout.healthTimeoutSeconds" in run.output and "its lane stops here" in run.output
    assert run.called("deregister-targets") and not run.called("elbv2 register-targets")


def test_an_unchanged_serving_head_is_not_restarted_or_drained(node):
    values = parameters()
    node.runs(values["ConfigHash"])
    node.serving()
    run = node.run(values, health_seconds=60)
    assert run.returncode == 0, run.output
    assert not run.called("docker run") and not run.called("deregister-targets")


def test_a_pipeline_worker_drains_its_replicas_head_before_it_restarts(node):
    node.runs("an-older-configuration")
    run = node.run(parameters("worker-1", pipeline=2))
    assert run.returncode == 0, run.output
    assert run.called(DEREGISTER)
    assert run.index("deregister-targets") < run.index("docker rm") < run.index("docker run")
    assert not run.called("curl") and not run.called("elbv2 register-targets")


def test_a_replicas_members_share_one_hash_so_a_worker_change_restarts_its_head():
    assert parameters("worker-1", pipeline=2)["ConfigHash"] == parameters("master", pipeline=2)["ConfigHash"]
