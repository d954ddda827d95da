"""tooling/changes/: the replacement table, diff over two renders, the rollout summary and
the --change syntax. Synthetic renders keep each rule's behaviour visible on its own; the
stack-level changes (AWS, bare metal) are asserted in the targets' own tests."""

from __future__ import annotations

import textwrap

import pytest

from tooling import changes, offline, stackfile
from tooling.changes import ChangeSyntaxError, apply_changes, diff, rollout
from tooling.offline import RecordedResource, Render

INSTANCE = "aws:ec2/instance:Instance"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
ASSOCIATION = "aws:ssm/association:Association"
CONTAINER = "docker:index/container:Container"
COMMAND = "command:remote:Command"


def resource(type_: str, resource_name: str, depends_on=(), **inputs) -> RecordedResource:
    return RecordedResource(type_, resource_name, inputs, dict(inputs), True, depends_on=list(depends_on))


def render(*resources: RecordedResource, nodes=("master", "worker-1"), pipeline: int = 1) -> Render:
    summary = {
        "nodes": [
            {"name": n, "ip": f"10.0.0.{10 + i}", "role": "master" if i == 0 else "worker"}
            for i, n in enumerate(nodes)
        ],
        "topology": {"pipelineParallel": pipeline},
    }
    return Render("test", list(resources), {"summary": summary}, [])


def by_name(found):
    return {change.name: change for change in found}


# --- the table ------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_every_registered_type_has_a_rule_that_cites_its_source(stack):
    for item in offline.render_stack(stack).custom_resources:
        rule = changes.rule_for(item.type)
        assert rule is not None, item.type
        assert "/" in rule.source and ".go" in rule.source, rule


def test_a_type_without_a_rule_is_refused_by_name():
    old = render(resource("aws:ec2/flowLog:FlowLog", "logs", a=1))
    new = render(resource("aws:ec2/flowLog:FlowLog", "logs", a=2))
    with pytest.raises(changes.UnknownResourceType, match="aws:ec2/flowLog:FlowLog \\(logs\\) has no rule"):
        diff(old, new)


def test_unchanged_resources_are_same_and_numbers_compare_as_the_engine_sends_them():
    old = render(resource("aws:lb/listener:Listener", "listener", port=80, protocol="TCP"))
    new = render(resource("aws:lb/listener:Listener", "listener", port=80.0, protocol="TCP"))
    assert [c.action for c in diff(old, new)] == ["same"]


def test_update_in_place_for_keys_the_provider_updates():
    old = render(resource("aws:lb/listener:Listener", "listener", port=80, loadBalancerArn="arn:a"))
    new = render(resource("aws:lb/listener:Listener", "listener", port=8080, loadBalancerArn="arn:a"))
    (change,) = diff(old, new)
    assert (change.action, change.keys, change.strategy) == ("update", ["port"], None)


def test_forcenew_key_replaces_create_before_delete_by_default():
    old = render(resource("aws:lb/listener:Listener", "listener", loadBalancerArn="arn:a"))
    new = render(resource("aws:lb/listener:Listener", "listener", loadBalancerArn="arn:b"))
    (change,) = diff(old, new)
    assert (change.action, change.strategy, change.replace_keys) == (
        "replace",
        "create-before-delete",
        ["loadBalancerArn"],
    )


def test_docker_containers_replace_delete_before_replace_by_the_providers_own_rule():
    old = render(resource(CONTAINER, "vllm", name="qwen-head", image="vllm:1", restart="always"))
    new = render(resource(CONTAINER, "vllm", name="qwen-head", image="vllm:2", restart="always"))
    (change,) = diff(old, new)
    assert (change.action, change.strategy, change.collision) == ("replace", "delete-before-replace", None)
    # restart is one of the few fields resourceDockerContainerUpdate changes in place
    new = render(resource(CONTAINER, "vllm", name="qwen-head", image="vllm:1", restart="no"))
    assert diff(old, new)[0].action == "update"


def test_command_replaces_only_on_triggers_and_re_runs_otherwise():
    old = render(resource(COMMAND, "fw", create="ufw a", triggers=["1"]))
    assert diff(old, render(resource(COMMAND, "fw", create="ufw b", triggers=["1"])))[0].action == "update"
    assert diff(old, render(resource(COMMAND, "fw", create="ufw a", triggers=["2"])))[0].action == "replace"


def test_options_delete_before_replace_and_replace_on_changes_are_honoured():
    old = render(resource(ASSOCIATION, "a", name="doc", parameters={"X": "1"}))
    new_item = resource(ASSOCIATION, "a", name="doc", parameters={"X": "2"})
    assert diff(old, render(new_item))[0].action == "update"  # parameters update in place
    new_item.replace_on_changes = ["parameters"]
    new_item.delete_before_replace = True
    (change,) = diff(old, render(new_item))
    assert (change.action, change.strategy) == ("replace", "delete-before-replace")


def test_ignore_changes_hides_a_key():
    old = render(resource(TEMPLATE, "t", imageId="ami-1", userData="a"))
    new_item = resource(TEMPLATE, "t", imageId="ami-2", userData="a")
    new_item.ignore_changes = ["imageId"]
    assert diff(old, render(new_item))[0].action == "same"


def test_a_launch_template_update_replaces_the_instance_that_follows_its_version():
    template_old = resource(TEMPLATE, "t", userData="a")
    template_new = resource(TEMPLATE, "t", userData="b")
    instance = resource(INSTANCE, "node", launchTemplate={"id": "t-id", "version": "1"})
    found = by_name(diff(render(template_old, instance), render(template_new, instance)))
    assert found["t"].action == "update"
    assert (found["node"].action, found["node"].replace_keys) == ("replace", ["launchTemplate"])


def test_a_replacement_ripples_into_inputs_that_hold_its_id():
    attachment = resource("aws:lb/targetGroupAttachment:TargetGroupAttachment", "att", targetId="node-id")
    old = render(resource(INSTANCE, "node", subnetId="s1"), attachment)
    new = render(resource(INSTANCE, "node", subnetId="s2"), attachment)
    found = by_name(diff(old, new))
    assert found["node"].action == "replace" and found["att"].action == "replace"
    assert found["att"].keys == ["targetId"]


def test_create_before_delete_on_a_static_ip_is_a_collision():
    template = resource(TEMPLATE, "t", networkInterfaces=[{"privateIpAddress": "10.0.0.10"}])
    old = render(template, resource(INSTANCE, "node", launchTemplate={"id": "t-id"}, subnetId="a"))
    new = render(template, resource(INSTANCE, "node", launchTemplate={"id": "t-id"}, subnetId="b"))
    change = by_name(diff(old, new))["node"]
    assert change.collision == "static IP 10.0.0.10 (launch template t)"
    assert changes.verdict(rollout(old, new)) == 3


def test_created_and_deleted_resources():
    old = render(resource("aws:lb/listener:Listener", "gone", port=1))
    new = render(resource("aws:lb/listener:Listener", "fresh", port=1))
    assert [(c.name, c.action) for c in diff(old, new)] == [("fresh", "create"), ("gone", "delete")]


# --- rollout ----------------------------------------------------------------------------------


def servers(*depends, image="v1", wait=False):
    """Two model-server containers on master and worker-1 (docker providers over SSH)."""
    items = []
    for index, node in enumerate(("master", "worker-1")):
        provider = RecordedResource(
            "pulumi:providers:docker", f"{node}-docker", {"host": f"ssh://u@10.0.0.{10 + index}"}, {}, True
        )
        container = resource(
            CONTAINER,
            f"{node}-vllm",
            depends_on=depends[index] if depends else (),
            name="qwen-head",
            image=image,
            labels=[{"label": "qwen-cluster.role", "value": "head"}],
            **({"wait": True} if wait else {}),
        )
        container.provider = f"urn:pulumi:s::p::pulumi:providers:docker::{node}-docker::{node}-docker-id"
        items += [provider, container]
    return items


def test_restarting_every_server_at_once_takes_the_endpoint_down():
    old, new = render(*servers()), render(*servers(image="v2"))
    summary = rollout(old, new)
    assert summary.servers_restarted == ["master", "worker-1"]
    assert summary.max_replicas_out_of_service == 2 and not summary.endpoint_stays_up
    assert changes.verdict(summary) == 3


def test_a_health_gate_in_the_dependency_chain_rolls_one_replica_at_a_time():
    chain = ((), ("master-vllm",))
    old = render(*servers(*chain, wait=True))
    new = render(*servers(*chain, image="v2", wait=True))
    summary = rollout(old, new)
    assert summary.steps == [["master"], ["worker-1"]]
    assert summary.max_replicas_out_of_service == 1 and summary.endpoint_stays_up
    assert changes.verdict(summary) == 0


def test_a_dependency_without_a_health_gate_does_not_sequence():
    chain = ((), ("master-vllm",))
    summary = rollout(render(*servers(*chain)), render(*servers(*chain, image="v2")))
    assert summary.max_replicas_out_of_service == 2


def test_a_replaced_load_balancer_container_is_an_endpoint_outage():
    lb_old = resource(
        CONTAINER,
        "lb",
        name="nginx",
        image="nginx:1",
        labels=[{"label": "qwen-cluster.role", "value": "load-balancer"}],
    )
    lb_new = resource(
        CONTAINER,
        "lb",
        name="nginx",
        image="nginx:2",
        labels=[{"label": "qwen-cluster.role", "value": "load-balancer"}],
    )
    summary = rollout(render(lb_old), render(lb_new))
    assert summary.endpoint_changes == ["lb (replace)"] and not summary.endpoint_stays_up


def drain_chain(drain_timeout: int, *, triggers=("10.0.0.10",)):
    """A bare-metal rollout chain over two replicas, as components/baremetal/rollout.py
    registers it: `<head>-drain` (update only), then `<head>-ready` (the health gate), then the
    next replica's drain."""
    items = []
    previous: tuple[str, ...] = ()
    for index, node in enumerate(("master", "worker-1")):
        items.append(
            resource(
                COMMAND,
                f"{node}-drain",
                depends_on=previous,
                update=f"drain 10.0.0.{10 + index} --timeout {drain_timeout}",
                triggers=[f"10.0.0.{10 + index}"] if index else list(triggers),
            )
        )
        items.append(
            resource(
                COMMAND,
                f"{node}-ready",
                depends_on=(f"{node}-drain",),
                update="ready",
                delete=f"retire --timeout {drain_timeout}",
                triggers=[f"10.0.0.{10 + index}"],
            )
        )
        previous = (f"{node}-ready",)
    return items


def test_a_drain_that_re_runs_takes_its_replica_out_one_at_a_time_behind_the_gates():
    summary = rollout(render(*drain_chain(300)), render(*drain_chain(600)))
    assert summary.replicas_drained == ["master", "worker-1"]
    assert summary.servers_restarted == [] and summary.nodes_replaced == []
    assert summary.steps == [["master"], ["worker-1"]]
    assert summary.max_replicas_out_of_service == 1 and summary.endpoint_stays_up


def test_a_replaced_drain_runs_nothing_and_takes_nothing_out():
    # pulumi-command: a replacement runs the new command's `create` and the old one's `delete`;
    # a drain has neither.
    summary = rollout(render(*drain_chain(300)), render(*drain_chain(300, triggers=("10.0.0.99",))))
    assert summary.replicas_drained == [] and summary.max_replicas_out_of_service == 0


# --- --change ---------------------------------------------------------------------------------


def test_apply_changes_sets_dotted_paths_with_json_or_plain_values():
    base = {"qwen-cluster:model": {"image": "a:1", "tensorParallel": 4}, "aws:region": "us-west-2"}
    result = apply_changes(
        base,
        [
            "model.image=vllm/vllm-openai:v0.33.1",
            "model.tensorParallel=8",
            "model.vllmFlags.--enable-prefix-caching=true",
            'access.clientCidrs=["10.1.0.0/16"]',
            "aws:region=eu-west-1",
        ],
    )
    assert result["qwen-cluster:model"] == {
        "image": "vllm/vllm-openai:v0.33.1",
        "tensorParallel": 8,
        "vllmFlags": {"--enable-prefix-caching": True},
    }
    assert result["qwen-cluster:access"] == {"clientCidrs": ["10.1.0.0/16"]}
    assert result["aws:region"] == "eu-west-1"
    assert base["qwen-cluster:model"]["image"] == "a:1"  # the input is left alone


def test_nodes_takes_the_whole_list():
    result = apply_changes({}, ['nodes=[{"name": "a", "ip": "10.0.0.5", "role": "master"}]'])
    assert result["qwen-cluster:nodes"] == [{"name": "a", "ip": "10.0.0.5", "role": "master"}]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model.image", "--change 'model.image' is not KEY=VALUE"),
        ("=x", "--change '=x' is not KEY=VALUE"),
        ("model..image=x", "the key 'model..image' has an empty part"),
        ("model.image.tag=x", "image is not a section"),
    ],
)
def test_bad_changes_are_refused_naming_the_change(text, message):
    with pytest.raises(ChangeSyntaxError, match=message.replace("(", "\\(").replace(".", "\\.")):
        apply_changes({"qwen-cluster:model": {"image": "a:1"}}, [text])


# --- offline records the options ------------------------------------------------------------


def test_offline_render_records_the_resource_options(tmp_path):
    program = tmp_path / "__main__.py"
    program.write_text(
        textwrap.dedent(
            """
            import pulumi
            import pulumi_aws as aws

            aws.ec2.LaunchTemplate(
                "t",
                image_id="ami-1",
                opts=pulumi.ResourceOptions(
                    ignore_changes=["imageId"], delete_before_replace=True, replace_on_changes=["userData"]
                ),
            )
            """
        )
    )
    result = offline.render({}, "dev", program=program)
    assert result.error is None, result.error
    template = result.named("t")
    assert template.ignore_changes == ["imageId"]
    assert template.delete_before_replace is True
    assert template.replace_on_changes == ["userData"]
