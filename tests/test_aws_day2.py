"""Day 2 on AWS (docs/day2.md, "AWS"): every routine change, planned offline against the replacement table.

Each test renders the stack as it is and with one change, diffs the two
(tooling/changes/) and asserts what is replaced, in what order, and the rollout summary.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from qwen_cluster.render import ssm, vllm
from tests.helpers.aws_stacks import INSTANCE, render, render_stack
from tests.helpers.baremetal import shellcheck
from tooling import changes, offline, stackfile

NEW_DLAMI = {
    "aws:ec2/getAmi:getAmi": {
        "id": "ami-0aaaaaaaaaaaaaaa1",
        "name": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20270101",
        "architecture": "x86_64",
    }
}


def plan(stack: str, *change: str):
    old = render_stack(stack)
    new = render(changes.apply_changes(stackfile.read(stack), change), stack)
    found = changes.diff(old, new)
    return found, changes.rollout(old, new, found)


def touched(found) -> dict[str, tuple[str, str | None]]:
    return {c.name: (c.action, c.strategy) for c in found if c.action != "same"}


def assert_no_gpu_instance_replaced_create_before_delete(found):
    for change in found:
        if change.type == INSTANCE and change.action == "replace" and change.name.startswith("gpu-nodes-"):
            assert change.strategy == "delete-before-replace", change


# --- routine changes: no machine is replaced, one replica at a time --------------------------


def test_image_bump_restarts_the_servers_one_replica_at_a_time_and_replaces_no_node():
    found, summary = plan("dev", "model.image=vllm/vllm-openai:v0.33.1")
    assert touched(found) == {
        # Every node stages the new image first (one association on all of them, by tag, before
        # any lane drains; and each node's own, waited for before its server).
        "gpu-nodes-stage": ("replace", "create-before-delete"),
        "gpu-nodes-master-stage": ("replace", "create-before-delete"),
        "gpu-nodes-worker-1-stage": ("replace", "create-before-delete"),
        "gpu-nodes-master-server": ("replace", "create-before-delete"),
        "gpu-nodes-worker-1-server": ("replace", "create-before-delete"),
    }
    assert summary.nodes_replaced == []
    assert summary.servers_restarted == ["master", "worker-1"]
    assert summary.steps == [["master"], ["worker-1"]]
    assert summary.max_replicas_out_of_service == 1 and summary.endpoint_stays_up
    assert changes.verdict(summary) == 0


def test_a_vllm_flag_rolls_over_every_replica_in_the_chain_order():
    found, summary = plan("prod", 'model.vllmFlags={"--enable-prefix-caching": true}')
    assert set(touched(found)) == {
        f"gpu-nodes-{n}-server" for n in ("master", "worker-1", "worker-2", "worker-3")
    }
    assert summary.steps == [["master"], ["worker-1"], ["worker-2"], ["worker-3"]]
    assert (summary.max_replicas_out_of_service, summary.nodes_replaced) == (1, [])
    assert render_stack("prod").outputs["rollout"]["order"] == ["master", "worker-1", "worker-2", "worker-3"]


def test_a_sysctl_value_re_runs_the_document_without_restarting_a_server():
    found, summary = plan("dev", 'tuning.sysctl={"net.core.rmem_max": 33554432}')
    assert touched(found) == {
        "gpu-nodes-master-server": ("replace", "create-before-delete"),
        "gpu-nodes-worker-1-server": ("replace", "create-before-delete"),
    }
    # The container's configuration hash did not move: the run applies sysctl and keeps it.
    assert summary.servers_restarted == [] and summary.max_replicas_out_of_service == 0
    new = render(
        changes.apply_changes(stackfile.read("dev"), ['tuning.sysctl={"net.core.rmem_max": 33554432}'])
    )
    dropin = ssm.decoded(new.named("gpu-nodes-master-server").inputs["parameters"]["Sysctl"])
    assert "net.core.rmem_max = 33554432" in dropin


def test_a_new_dlami_release_changes_nothing():
    old = render_stack("dev")
    new = offline.render(stackfile.read("dev"), "dev", invoke_results=NEW_DLAMI)
    assert (
        new.named("gpu-nodes-master-template").inputs["imageId"] == "ami-0aaaaaaaaaaaaaaa1"
    )  # the lookup moved
    found = changes.diff(old, new)
    assert touched(found) == {}
    assert changes.rollout(old, new, found).max_replicas_out_of_service == 0


def test_the_looked_up_ami_is_kept_and_shown():
    result = render_stack("dev")
    template = result.named("gpu-nodes-master-template")
    assert template.ignore_changes == ["imageId"]
    assert result.outputs["ami"]["ids"] == {
        "master": "ami-0123456789abcdef0",
        "worker-1": "ami-0123456789abcdef0",
    }
    assert "kept" in result.outputs["ami"]["source"]
    pinned = render(changes.apply_changes(stackfile.read("dev"), ["aws.amiId=ami-0fedcba9876543210"]))
    assert pinned.named("gpu-nodes-master-template").ignore_changes == []
    assert pinned.outputs["ami"]["source"] == "aws.amiId"


def test_setting_aws_ami_id_replaces_every_node_one_at_a_time_delete_before_replace():
    found, summary = plan("prod", "aws.amiId=ami-0fedcba9876543210")
    nodes = ("master", "worker-1", "worker-2", "worker-3")
    expected = {}
    for node in nodes:
        expected[f"gpu-nodes-{node}-template"] = ("update", None)  # a new version
        expected[f"gpu-nodes-{node}"] = ("replace", "delete-before-replace")
        expected[f"model-lb-{node}"] = ("replace", "create-before-delete")
        expected[f"model-lb-{node}-drained"] = ("replace", "create-before-delete")  # its triggers
        expected[f"gpu-nodes-{node}-server"] = ("replace", "create-before-delete")
        expected[f"node-proxy-{node}"] = ("replace", "create-before-delete")  # the new instance's proxy
        expected[f"gpu-nodes-{node}-stage"] = ("replace", "create-before-delete")  # new targets
        expected[f"monitoring-{node}"] = ("update", None)  # its targets: the new instance id
    assert touched(found) == expected
    assert_no_gpu_instance_replaced_create_before_delete(found)
    assert summary.nodes_replaced == list(nodes)
    assert summary.steps == [[node] for node in nodes]
    assert summary.max_replicas_out_of_service == 1 and summary.collisions == []
    assert changes.verdict(summary) == 0


def test_an_instance_type_change_is_a_machine_change_and_rolls_too():
    found, summary = plan("dev", "aws.instanceType=g6e.24xlarge")
    assert_no_gpu_instance_replaced_create_before_delete(found)
    assert summary.nodes_replaced == ["master", "worker-1"] and summary.steps == [["master"], ["worker-1"]]


def test_adding_a_node_touches_only_that_node():
    nodes = stackfile.read("dev")["qwen-cluster:nodes"] + [{"name": "worker-2", "ip": "10.42.1.102"}]
    found, summary = plan("dev", f"nodes={json.dumps(nodes)}")
    assert touched(found) == {
        "gpu-nodes-worker-2-template": ("create", None),
        "gpu-nodes-worker-2": ("create", None),
        "model-lb-worker-2": ("create", None),
        "model-lb-worker-2-drained": ("create", None),
        "gpu-nodes-worker-2-server": ("create", None),
        "node-proxy-worker-2": ("create", None),
        "gpu-nodes-worker-2-stage": ("create", None),
        # Monitoring: the new node's, and the others' probes and scrape targets (docs/monitoring.md, "Day 2").
        "monitoring-worker-2": ("create", None),
        "monitoring-master": ("update", None),
        "monitoring-worker-1": ("update", None),
    }
    assert (summary.replicas, summary.max_replicas_out_of_service, summary.servers_restarted) == (3, 0, [])


def test_removing_a_node_touches_only_that_node():
    nodes = [n for n in stackfile.read("prod")["qwen-cluster:nodes"] if n["name"] != "worker-2"]
    found, summary = plan("prod", f"nodes={json.dumps(nodes)}")
    assert touched(found) == {
        "gpu-nodes-worker-2-template": ("delete", None),
        "gpu-nodes-worker-2": ("delete", None),
        "model-lb-worker-2": ("delete", None),
        "model-lb-worker-2-drained": ("delete", None),  # waits out the drain before the instance goes
        "gpu-nodes-worker-2-server": ("delete", None),
        "node-proxy-worker-2": ("delete", None),
        "gpu-nodes-worker-2-stage": ("delete", None),
        "monitoring-worker-2": ("delete", None),
        "monitoring-master": ("update", None),
        "monitoring-worker-1": ("update", None),
        "monitoring-worker-3": ("update", None),
    }
    assert (summary.replicas, summary.max_replicas_out_of_service, summary.nodes_replaced) == (3, 0, [])


def test_a_client_cidr_change_updates_the_load_balancer_rules_only():
    found, summary = plan("dev", 'access.clientCidrs=["10.1.0.0/16"]')
    assert touched(found) == {"security-load-balancer-in-listener-0": ("update", None)}
    assert next(c for c in found if c.action == "update").keys == ["cidrIpv4", "description"]
    assert summary.max_replicas_out_of_service == 0 and summary.endpoint_stays_up


# --- the mechanism --------------------------------------------------------------------------


def test_each_replica_waits_for_the_previous_replicas_health_gate():
    result = render_stack("prod")
    order = ["master", "worker-1", "worker-2", "worker-3"]
    for before, after in zip(order, order[1:], strict=False):
        gate = f"gpu-nodes-{before}-server"
        assert result.named(f"gpu-nodes-{after}").depends_on == [gate]
        # ... for its own node's staging, and for its proxy, through which the NLB checks it.
        assert result.named(f"gpu-nodes-{after}-server").depends_on == [
            gate,
            f"gpu-nodes-{after}-stage",
            f"node-proxy-{after}",
        ]
    first = result.named("gpu-nodes-master-server")
    # May drain, register and (prod's weights are in S3) read, once every node has staged, its
    # own node too, and its proxy answers.
    assert first.depends_on == [
        "model-server-drain",
        "model-server-weights",
        "gpu-nodes-stage",
        "gpu-nodes-master-stage",
        "node-proxy-master",
    ]


def test_associations_replace_on_any_change_and_wait_for_the_run():
    cluster = stackfile.load("dev")
    association = render_stack("dev").named("gpu-nodes-master-server").inputs
    options = render_stack("dev").named("gpu-nodes-master-server")
    assert options.replace_on_changes == ["parameters", "targets"]
    # The other targets back in service, the drain, the health gate, the pull.
    assert association["waitForSuccessTimeoutSeconds"] == 1800 + 300 + 1800 + ssm.PULL_MARGIN_SECONDS
    assert association["targets"] == [{"key": "InstanceIds", "values": ["gpu-nodes-master-id"]}]
    assert (association["maxConcurrency"], association["maxErrors"]) == ("1", "0")
    assert association["name"] == render_stack("dev").named("model-server-document").outputs["name"]
    parameters = association["parameters"]
    assert ssm.decoded(parameters["ServerScript"]) == vllm.server_script(cluster, "master")
    # vLLM's own /health on loopback, behind the node's proxy.
    assert parameters["HealthUrl"] == "http://127.0.0.1:5000/health"
    assert parameters["TargetGroupArn"] == "arn:aws:mock:::targetgroup/model-lb-heads"


def test_gpu_nodes_carry_the_ssm_instance_profile_and_replace_delete_before_replace():
    result = render_stack("dev")
    template = result.named("gpu-nodes-master-template").inputs
    assert template["iamInstanceProfile"] == {"name": result.named("gpu-node-role-profile").outputs["name"]}
    instance = result.named("gpu-nodes-master")
    assert instance.delete_before_replace is True
    assert instance.inputs["launchTemplate"] == {"id": "gpu-nodes-master-template-id", "version": "1"}
    attachment = result.named("gpu-node-role-ssm-core").inputs
    assert attachment["policyArn"] == "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"


def test_the_drain_permission_is_scoped_to_the_target_group():
    policy = json.loads(render_stack("dev").named("model-server-drain").inputs["policy"])
    scoped, describe = policy["Statement"]
    assert scoped["Resource"] == "arn:aws:mock:::targetgroup/model-lb-heads"
    assert set(scoped["Action"]) == {
        "elasticloadbalancing:DeregisterTargets",
        "elasticloadbalancing:RegisterTargets",
    }
    assert describe["Action"] == "elasticloadbalancing:DescribeTargetHealth"


def test_the_document_declares_every_parameter_and_the_values_fit_its_patterns():
    import re

    document = json.loads(ssm.document())
    assert document["schemaVersion"] == "2.2"
    assert set(document["parameters"]) == set(ssm.PARAMETERS)
    cluster = stackfile.load("prod")
    values = ssm.parameters(
        cluster, "worker-1", target_group_arn="arn:aws:elasticloadbalancing:x", target_id="i-0abc"
    )
    assert set(values) == set(ssm.PARAMETERS)
    for name, value in values.items():
        assert re.fullmatch(document["parameters"][name]["allowedPattern"].strip("^$"), value), (name, value)
    text = "\n".join(document["mainSteps"][0]["inputs"]["runCommand"])
    for name in ssm.PARAMETERS:
        assert "{{ " + name + " }}" in text


def test_the_run_script_is_valid_bash(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text(ssm.shell_check_text())
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_the_run_script_passes_shellcheck(tmp_path):
    shellcheck(ssm.shell_check_text(), tmp_path)


def test_the_config_hash_moves_with_what_the_container_runs_only():
    base = stackfile.load("dev")
    from tests.helpers.aws_stacks import variant

    def load(**sections):
        from qwen_cluster import config

        return config.validate(stackfile.cluster_keys(variant("dev", **sections)))

    same = ssm.config_hash(base, "master")
    assert ssm.config_hash(load(tuning={"sysctl": {"net.core.rmem_max": 1}}), "master") == same
    assert ssm.config_hash(load(rollout={"healthTimeoutSeconds": 600}), "master") == same
    assert ssm.config_hash(load(model={"image": "vllm/vllm-openai:v0.33.1"}), "master") != same
    assert ssm.config_hash(load(model={"vllmFlags": {"--max-model-len": 8192}}), "master") != same


@pytest.mark.parametrize("pipeline", [2])
def test_pipeline_workers_start_before_their_head_and_only_heads_wait(pipeline):
    from tests.helpers.aws_stacks import variant

    result = render(variant("prod", model={"pipelineParallel": pipeline}), "prod")
    worker = result.named("gpu-nodes-worker-1-server")
    head = result.named("gpu-nodes-master-server")
    assert "waitForSuccessTimeoutSeconds" not in worker.inputs and head.inputs["waitForSuccessTimeoutSeconds"]
    assert "gpu-nodes-worker-1-server" in head.depends_on
    assert worker.inputs["parameters"]["HealthUrl"] == ""
    assert result.outputs["rollout"]["order"] == ["worker-1", "master", "worker-3", "worker-2"]


def test_the_drain_timeout_is_the_target_groups_deregistration_delay_and_changes_in_place():
    found, summary = plan("dev", "rollout.drainTimeoutSeconds=120")
    changed = touched(found)
    assert changed["model-lb-heads"] == ("update", None)
    assert next(c for c in found if c.name == "model-lb-heads").keys == ["deregistrationDelay"]
    assert summary.servers_restarted == [] and summary.max_replicas_out_of_service == 0


def test_a_model_change_never_touches_the_machine():
    found, summary = plan("dev", "model.name=Qwen/Qwen3-32B-FP8")
    assert set(touched(found)) == {
        "gpu-nodes-stage",
        "gpu-nodes-master-stage",
        "gpu-nodes-worker-1-stage",
        "gpu-nodes-master-server",
        "gpu-nodes-worker-1-server",
    }
    assert summary.nodes_replaced == [] and summary.max_replicas_out_of_service == 1


# --- loadBalancer.routing cache-aware (docs/routing.md, "AWS", day 2) ----------------------


def test_switching_to_cache_aware_routing_rolls_the_replicas_and_adds_the_router():
    found, summary = plan("dev", "loadBalancer.routing=cache-aware")
    assert touched(found) == {
        # The routed run (the router calls): a new document version, in place.
        "model-server-document": ("update", None),
        "router-document": ("create", None),
        "router-master": ("create", None),
        # The master's endpoint scrapes the router (source `router`).
        "monitoring-master": ("update", None),
        # Each proxy's new nginx.conf (router upstream, backup, router listener): a reload.
        "node-proxy-master": ("replace", "create-before-delete"),
        "node-proxy-worker-1": ("replace", "create-before-delete"),
        # --enable-scale-out and the routed run: each replica drained, restarted and gated.
        "gpu-nodes-master-server": ("replace", "create-before-delete"),
        "gpu-nodes-worker-1-server": ("replace", "create-before-delete"),
    }
    assert summary.nodes_replaced == [] and summary.servers_restarted == ["master", "worker-1"]
    assert summary.max_replicas_out_of_service == 1 and summary.endpoint_stays_up


def _cache_aware(*change: str):
    base = changes.apply_changes(stackfile.read("dev"), ("loadBalancer.routing=cache-aware",))
    old = render(base, "dev")
    new = render(changes.apply_changes(base, change), "dev")
    found = changes.diff(old, new)
    return found, changes.rollout(old, new, found)


def test_a_new_router_setting_updates_its_association_in_place_and_restarts_no_model_server():
    """The router's association keeps the in-place update (association.go: parameters update
    with UpdateAssociation, which runs it again): nothing waits for the router's run."""
    render_cache_aware = render(
        changes.apply_changes(stackfile.read("dev"), ("loadBalancer.routing=cache-aware",)), "dev"
    )
    assert not render_cache_aware.named("router-master").replace_on_changes
    # A new balance bound (the replica count) or worker set changes the router's argv: here, a
    # longer idle timeout moves --request-timeout-secs.
    found, summary = _cache_aware("loadBalancer.idleTimeoutSeconds=4000")
    assert touched(found)["router-master"] == ("update", None)
    assert summary.servers_restarted == []


def test_the_routed_document_declares_its_parameters_and_the_values_fit_its_patterns():
    import re

    from qwen_cluster import config
    from tests.helpers.aws_stacks import variant

    document = json.loads(ssm.document(routed=True))
    cluster = config.validate(
        stackfile.cluster_keys(variant("prod", loadBalancer={"routing": "cache-aware"}))
    )
    values = ssm.parameters(
        cluster, "worker-1", target_group_arn="arn:aws:elasticloadbalancing:x", target_id="i-0"
    )
    assert set(values) == set(document["parameters"]) == set(ssm.PARAMETERS) | set(ssm.ROUTED_PARAMETERS)
    for name, value in values.items():
        assert re.fullmatch(document["parameters"][name]["allowedPattern"].strip("^$"), value), (name, value)


def test_a_heads_instance_is_deleted_only_after_the_wait_for_its_drain():
    """The attachment's delete only deregisters (terraform-provider-aws
    internal/service/elbv2/target_group_attachment.go resourceAttachmentDelete); the engine deletes
    dependents first, so the attachment -> drained -> instance chain puts the wait between them."""
    dev = render_stack("dev")
    deps = dev.dependencies()
    for node in ("master", "worker-1"):
        drained = dev.named(f"model-lb-{node}-drained")
        assert f"model-lb-{node}-drained" in deps[f"model-lb-{node}"]
        assert f"gpu-nodes-{node}" in deps[f"model-lb-{node}-drained"]
        assert "create" not in drained.inputs  # nothing to do until the node leaves
        assert drained.inputs["delete"].startswith("aws elbv2 wait target-deregistered ")
        assert f"Id=gpu-nodes-{node}-id,Port=5000" in drained.inputs["delete"]
        assert drained.inputs["triggers"] == [f"gpu-nodes-{node}-id"]
