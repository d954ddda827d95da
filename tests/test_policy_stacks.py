"""The pack over the real stacks, rendered under mocks: they pass, and each mutation is refused.

The same mutations run over the fixture stacks (shaped like what the targets build) and over
the real renders of dev, prod (qwen_cluster/aws) and onprem (qwen_cluster/baremetal).
"""

import pytest

from policies import guard
from tests.helpers.policy_fixtures import aws_stack, bare_metal_stack, mutation_cases, rendered
from tooling import policy_harness, stackfile


def mandatory_policies(resources, stack: str) -> set[str]:
    violations = policy_harness.analyze(resources, stack=stack, cluster=stackfile.load(stack))
    return {v.policy for v in policy_harness.mandatory(violations)}


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_the_real_stacks_produce_no_mandatory_violation(stack):
    render, violations = rendered(stack)
    assert render.error is None
    assert policy_harness.mandatory(violations) == []


@pytest.mark.parametrize(
    ("stack", "label", "mutate", "policy"),
    [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in mutation_cases(stackfile.STACKS)],
)
def test_a_mutated_real_stack_is_refused_by_the_named_policy(stack, label, mutate, policy):
    render, _ = rendered(stack)
    assert policy not in mandatory_policies(render.resources, stack)
    assert policy in mandatory_policies(mutate(render.resources), stack)


@pytest.mark.parametrize(
    ("stack", "label", "mutate", "policy"),
    [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in mutation_cases(("dev", "onprem"))],
)
def test_a_mutated_fixture_stack_is_refused_by_the_named_policy(stack, label, mutate, policy):
    resources = aws_stack() if stack == "dev" else bare_metal_stack()
    assert mandatory_policies(resources, stack) == set()
    assert policy in mandatory_policies(mutate(resources), stack)


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_without_a_stack_config_the_real_stacks_pass_with_one_advisory(stack):
    render, _ = rendered(stack)
    violations = policy_harness.analyze_render(render, cluster=None)
    assert policy_harness.mandatory(violations) == []
    assert [v.policy for v in violations if v.enforcement == "advisory"] == ["stack-config"]


@pytest.mark.parametrize(
    ("stack", "label", "mutate", "policy"),
    [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in mutation_cases(stackfile.STACKS)],
)
def test_without_a_stack_config_a_mutated_real_stack_is_still_refused(stack, label, mutate, policy):
    """World exposure, the EFA self rules and the baseline need no stack config."""
    render, _ = rendered(stack)
    violations = policy_harness.analyze(mutate(render.resources), stack=stack, cluster=None)
    assert policy in {v.policy for v in policy_harness.mandatory(violations)}


def test_check_config_renders_and_analyzes_a_stack_config():
    violations = policy_harness.check_config(stackfile.read("dev"), "dev")
    assert {v.policy for v in violations} <= {policy.name for policy in guard.POLICIES}
