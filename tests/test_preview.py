"""A preview registers what an update registers.

In `pulumi preview` of a new stack the engine answers each registration without an id and
with the provider's computed outputs unknown (ARNs, DNS names, auto names); whatever the program
derives from them is unknown too. `offline.render(..., preview=True)` answers the same way
(`RecordingMocks(preview=True)`, `set_mocks(preview=True)`). The program must register the same
resources with the same inputs, except where an input comes from an unknown output, and the
policy pack must judge the preview as it judges the update.
"""

from __future__ import annotations

from typing import Any

import pytest
from pulumi.runtime.rpc import UNKNOWN

from qwen_cluster import config
from tests.helpers.aws_stacks import render, variant
from tests.helpers.policy_fixtures import mutation_cases, previewed
from tooling import offline, policy_harness, stackfile

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dev": ("dev", stackfile.read("dev")),
    "prod": ("prod", stackfile.read("prod")),
    "onprem": ("onprem", stackfile.read("onprem")),
    "dev, existing VPC": ("dev", variant("dev", aws={"vpcId": "vpc-0123456789abcdef0"})),
    "dev, internet-facing, no EFA": (
        "dev",
        variant("dev", loadBalancer={"scheme": "internet-facing"}, aws={"efa": False}),
    ),
    "prod, two nodes per replica": ("prod", variant("prod", model={"pipelineParallel": 2})),
}
_PREVIEWS: dict[str, offline.Render] = {}


def preview_of(label: str) -> offline.Render:
    if label in stackfile.STACKS:
        return previewed(label)
    if label not in _PREVIEWS:
        stack, config = VARIANTS[label]
        _PREVIEWS[label] = offline.render(config, stack, preview=True)
    return _PREVIEWS[label]


def update_of(label: str) -> offline.Render:
    stack, config = VARIANTS[label]
    return render(config, stack)


def disagreements(previewed: Any, updated: Any, path: str) -> list[str]:
    """Where a preview's input differs from the update's, other than by being unknown."""
    if previewed == UNKNOWN:
        return []
    if isinstance(previewed, dict) and isinstance(updated, dict):
        found = (
            [f"{path}: keys {sorted(set(previewed) ^ set(updated))}"]
            if set(previewed) != set(updated)
            else []
        )
        for key in set(previewed) & set(updated):
            found += disagreements(previewed[key], updated[key], f"{path}.{key}")
        return found
    if isinstance(previewed, list) and isinstance(updated, list) and len(previewed) == len(updated):
        return [
            d
            for i, (p, u) in enumerate(zip(previewed, updated, strict=True))
            for d in disagreements(p, u, f"{path}[{i}]")
        ]
    return [] if previewed == updated else [f"{path}: {str(previewed)[:80]!r} != {str(updated)[:80]!r}"]


def identities(rendered: offline.Render) -> list[tuple[str, str, str | None]]:
    return sorted((r.type, r.name, r.parent or "") for r in rendered.resources)


@pytest.mark.parametrize("label", VARIANTS)
def test_a_preview_registers_the_same_resources_as_an_update(label):
    preview = preview_of(label)
    assert preview.error is None
    assert identities(preview) == identities(update_of(label))


@pytest.mark.parametrize("label", VARIANTS)
def test_a_preview_knows_every_input_an_update_knows_but_what_comes_from_unknown_outputs(label):
    updated = {(r.type, r.name): r for r in update_of(label).resources}
    found = []
    for resource in preview_of(label).resources:
        found += disagreements(resource.inputs, updated[(resource.type, resource.name)].inputs, resource.name)
    assert found == []


def test_in_a_preview_ids_and_computed_outputs_are_unknown():
    preview = preview_of("dev")
    rule = preview.named("security-nodes-in-model-service")
    assert rule.inputs["securityGroupId"] == UNKNOWN
    assert rule.inputs["referencedSecurityGroupId"] == UNKNOWN
    assert preview.named("model-lb-nlb").outputs["dnsName"] == UNKNOWN
    # What the program sets itself stays known.
    assert rule.inputs["fromPort"] == 5000


def test_in_a_preview_the_render_keeps_the_property_dependencies_the_engine_gets():
    rule = preview_of("dev").named("security-nodes-in-model-service")
    assert rule.property_dependencies == {
        "referencedSecurityGroupId": ["security-load-balancer"],
        "securityGroupId": ["security-nodes"],
    }


def test_an_existing_vpc_too_small_is_refused_in_preview_too():
    small_vpc = {
        "aws:ec2/getVpc:getVpc": {
            "id": "vpc-0123456789abcdef0",
            "cidrBlock": "10.42.1.0/24",
            "cidrBlockAssociations": [{"cidrBlock": "10.42.1.0/24"}],
        }
    }
    config = variant("dev", aws={"vpcId": "vpc-0123456789abcdef0"})
    result = offline.render(config, "dev", invoke_results=small_vpc, preview=True)
    assert result.error is not None and "cannot hold public subnet 10.42.0.0/26" in result.error


@pytest.mark.parametrize("label", VARIANTS)
def test_the_pack_judges_a_preview_as_it_judges_the_update(label):
    _, stack_config = VARIANTS[label]
    cluster = config.validate(stackfile.cluster_keys(stack_config), aws_region=stack_config.get("aws:region"))
    in_preview = policy_harness.analyze_render(preview_of(label), cluster=cluster)
    assert in_preview == policy_harness.analyze_render(update_of(label), cluster=cluster)


@pytest.mark.parametrize(
    ("stack", "label", "mutate", "policy"),
    [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in mutation_cases(stackfile.STACKS)],
)
def test_a_mutated_preview_is_refused_by_the_named_policy(stack, label, mutate, policy):
    violations = policy_harness.analyze(
        mutate(preview_of(stack).resources), stack=stack, cluster=stackfile.load(stack)
    )
    assert policy in {v.policy for v in policy_harness.mandatory(violations)}


def test_the_deploy_order_follows_the_property_dependencies_the_sdk_sends():
    """Values the mocks cannot mark (a placement group's computed name, an image reference)
    still order the deploy, as the engine orders it."""
    dev = update_of("dev").dependencies()
    assert "gpu-nodes-placement" in dev["gpu-nodes-master-template"]
    onprem = update_of("onprem").dependencies()
    assert "master-model-image" in onprem["master-model-vllm"]


@pytest.mark.parametrize("label", VARIANTS)
def test_a_preview_orders_the_deploy_as_the_update_does(label):
    assert preview_of(label).dependencies() == update_of(label).dependencies()
