"""scripts/plan.py's change plan: --change and --against, the printed and JSON reports, exit codes."""

from __future__ import annotations

import json
import subprocess

from tests.helpers.baremetal import cache_aware_stack
from tooling import changes, offline, preview, stackfile

IMAGE_BUMP = "model.image=vllm/vllm-openai:v0.33.1"


def run(capsys, *argv: str) -> tuple[int, str]:
    code = preview.main(list(argv))
    return code, capsys.readouterr().out


def test_done_criterion_an_image_bump_on_dev_replaces_no_node_and_takes_one_replica_out(capsys):
    code, out = run(capsys, "dev", "--change", "model.image=vllm/vllm-openai:v0.33.1", "--json")
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0
    assert report["rollout"]["nodesReplaced"] == []
    assert report["rollout"]["maxReplicasOutOfService"] == 1
    assert report["rollout"]["replicas"] == 2
    changed = [c for c in report["changes"] if c["action"] != "same"]
    assert {(c["type"], c["action"]) for c in changed} == {("aws:ssm/association:Association", "replace")}
    assert set(changed[0]) >= {"type", "name", "action", "strategy", "keys"}


def test_a_drain_timeout_change_on_bare_metal_shows_the_replicas_each_drain_takes_out(capsys):
    """rollout.drainTimeoutSeconds is in every drain script, so every drain re-runs: each
    replica leaves the load balancer in turn, none restarts."""
    code, out = run(capsys, "onprem", "--change", "rollout.drainTimeoutSeconds=600", "--json")
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0
    rollout = report["rollout"]
    assert rollout["replicasDrained"] == ["master", "worker-1", "worker-2", "worker-3"]
    assert rollout["serversRestarted"] == [] and rollout["nodesReplaced"] == []
    assert rollout["steps"] == [["master"], ["worker-1"], ["worker-2"], ["worker-3"]]
    assert rollout["maxReplicasOutOfService"] == 1 and rollout["endpointStaysUp"]
    code, out = run(capsys, "onprem", "--change", "rollout.drainTimeoutSeconds=600")
    assert code == 0 and "replicas drained: master, worker-1, worker-2, worker-3" in out


def test_the_printed_plan_names_actions_keys_and_the_rollout(capsys):
    code, out = run(capsys, "prod", "--change", "aws.amiId=ami-0fedcba9876543210")
    assert code == 0
    assert "delete-before-replace" in out and "gpu-nodes-worker-3" in out and "launchTemplate" in out
    assert "nodes replaced: master, worker-1, worker-2, worker-3" in out
    assert "steps: master -> worker-1 -> worker-2 -> worker-3" in out
    assert "AMI: ami-0fedcba9876543210 (aws.amiId)" in out
    assert "endpoint stays up" in out


def test_replacing_the_load_balancer_is_an_outage_and_exits_three(capsys):
    # internal is ForceNew on aws_lb (elbv2/load_balancer.go): the endpoint itself is replaced.
    code, out = run(capsys, "dev", "--change", "loadBalancer.scheme=internet-facing", "--json")
    report = json.loads(out)
    assert code == 3 and report["rollout"]["endpointStaysUp"] is False
    assert "model-lb-nlb (replace)" in report["rollout"]["endpointChanges"]
    code, out = run(capsys, "dev", "--change", "loadBalancer.scheme=internet-facing")
    assert code == 3 and "OUTAGE" in out


def test_an_invalid_change_or_config_exits_two_naming_it(capsys):
    code, out = run(capsys, "dev", "--change", "model.tensorParallel=3")
    assert code == 2 and "model.tensorParallel 3 does not divide" in out
    code, out = run(capsys, "dev", "--change", "model.image")
    assert code == 2 and "is not KEY=VALUE" in out
    code, out = run(capsys, "dev", "--change", 'model.vllmFlags={"--port": 8080}')
    assert code == 2 and "model.vllmFlags --port 8080 is set by the program" in out


def test_a_change_plan_takes_exactly_one_stack(capsys):
    code, out = run(capsys, "dev", "prod", "--change", "model.image=vllm/vllm-openai:v0.33.1")
    assert code == 2 and "plan one stack" in out


def test_plain_string_values_and_whole_node_lists(capsys):
    nodes = stackfile.read("dev")["qwen-cluster:nodes"] + [{"name": "worker-2", "ip": "10.42.1.102"}]
    code, out = run(capsys, "dev", "--change", f"nodes={json.dumps(nodes)}", "--json")
    report = json.loads(out)
    created = sorted(c["name"] for c in report["changes"] if c["action"] == "create")
    assert code == 0 and created == [
        "gpu-nodes-worker-2",
        "gpu-nodes-worker-2-server",
        "gpu-nodes-worker-2-stage",
        "gpu-nodes-worker-2-template",
        "model-lb-worker-2",
        "model-lb-worker-2-drained",
        "monitoring-worker-2",
        "node-proxy-worker-2",
    ]
    # Without aws.amiId the new node launches from that day's DLAMI: the plan says so.
    assert report["notes"] and "pin aws.amiId" in report["notes"][0]


def test_against_a_git_ref_compares_the_program_and_stack_file_there(capsys):
    root = stackfile.PROJECT_ROOT
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        import pytest

        pytest.skip("not a git checkout")
    code, out = run(capsys, "dev", "--against", "HEAD", "--json")
    report = json.loads(out)
    assert report["valid"], report.get("errors")
    assert report["against"] == "HEAD"
    # The working tree may differ from HEAD while this runs; the committed program against
    # itself would be all `same`, so assert the shape and that the chain order is known.
    assert report["rollout"]["replicas"] == 2 and code in (0, 3)
    code, out = run(capsys, "dev", "--against", "no-such-ref-xyz")
    assert code == 2 and "--against no-such-ref-xyz" in out


def test_the_json_plan_lists_the_lanes_the_most_out_at_once_and_a_bound_on_the_duration(capsys):
    code, out = run(
        capsys, "onprem", "--change", "rollout.maxUnavailable=2", "--change", IMAGE_BUMP, "--json"
    )
    lanes = json.loads(out)["lanes"]
    assert code == 0
    assert lanes["lanes"] == [["master", "worker-2"], ["worker-1", "worker-3"]]
    assert lanes["mostOutOfServiceAtOnce"] == 2
    # A new image is on every node before either lane drains.
    nodes = ("master", "worker-1", "worker-2", "worker-3")
    assert lanes["stagedFirst"] == [f"{node}-model-stage" for node in nodes]
    assert lanes["atMostSeconds"] == 2 * (300 + 1800) == 2 * lanes["replicaBoundSeconds"]


def test_the_printed_plan_shows_the_lanes_and_the_estimate(capsys):
    code, out = run(capsys, "prod", "--change", IMAGE_BUMP)
    assert "lanes (1, at most 1 replica(s) out at once): master -> worker-1 -> worker-2 -> worker-3" in out
    assert "at most 5 h 20 min after staging" in out  # 4 x (1800 + 300 + 1800 + 900) s


def test_switching_to_cache_aware_routing_restarts_each_replica_in_turn_and_adds_the_router(capsys):
    """The heads need `--enable-scale-out` (render/vllm.py scale_out_flags): a routine rolling
    restart, one lane at a time; the router and nginx's files come with it."""
    code, out = run(capsys, "onprem", "--change", "loadBalancer.routing=cache-aware", "--json")
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0
    changed = {(c["name"], c["action"]) for c in report["changes"] if c["action"] != "same"}
    assert {
        ("router-image", "create"),
        ("router-router", "create"),
        ("load-balancer-config", "update"),
    } <= changed
    rollout = report["rollout"]
    heads = ["master", "worker-1", "worker-2", "worker-3"]
    assert rollout["replicasDrained"] == heads and rollout["serversRestarted"] == heads
    assert rollout["maxReplicasOutOfService"] == 1 and rollout["nodesReplaced"] == []
    assert rollout["endpointStaysUp"]


def test_a_router_replaced_is_no_outage():
    """The router's command follows rollout.healthTimeoutSeconds (its worker start wait): a new
    value replaces its container (command is ForceNew), delete-before-replace; nginx sends to
    the replicas directly meanwhile, so the endpoint stays up."""
    before = offline.render(cache_aware_stack(), "onprem")
    after = offline.render(
        {**cache_aware_stack(), "qwen-cluster:rollout": {"healthTimeoutSeconds": 2400}}, "onprem"
    )
    found = changes.diff(before, after)
    router_change = next(c for c in found if c.name == "router-router")
    assert (router_change.action, router_change.strategy) == ("replace", "delete-before-replace")
    assert "command" in router_change.keys
    assert changes.rollout(before, after, found).as_dict()["endpointStaysUp"]


PD_SERVING = (
    'serving={"mode":"disaggregated","prefill":{"nodes":["master","worker-1"]},'
    '"decode":{"nodes":["worker-2","worker-3"]}}'
)


def test_switching_onprem_to_disaggregated_restarts_each_replica_in_its_lane_and_replaces_no_host(capsys):
    code, out = run(
        capsys, "onprem", "--change", "bareMetal.nicSpeedGbps=3200", "--change", "bareMetal.gpuModel=H100",
        "--change", PD_SERVING, "--json",
    )  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0
    rollout = report["rollout"]
    assert rollout["nodesReplaced"] == [] and rollout["endpointStaysUp"]
    assert rollout["serversRestarted"] == ["master", "worker-1", "worker-2", "worker-3"]
    assert rollout["maxReplicasOutOfService"] == 1
    created = {c["name"] for c in report["changes"] if c["action"] == "create"}
    assert created == {"router-image", "router-router"}


def test_a_disaggregated_prod_changes_only_documents_and_associations(capsys):
    code, out = run(capsys, "prod", "--change", PD_SERVING, "--json")
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0 and report["rollout"]["nodesReplaced"] == []
    changed = {c["type"] for c in report["changes"] if c["action"] != "same"}
    assert changed == {"aws:ssm/document:Document", "aws:ssm/association:Association"}
