"""The pack over the real stacks, rendered under mocks, Checkov style: for each stack as rendered
and under each mutation, the exact set of policies that fail and the exact set that pass.

The same mutations run over the fixture stacks (shaped like what the targets build) and over
the real renders of dev, prod (components/aws) and onprem (components/baremetal), with the
stack config and without it (as `pulumi policy analyze` starts the pack).
"""

import pytest

from policies import guard
from tests.helpers.policy_fixtures import aws_stack, bare_metal_stack, mutation_cases, rendered
from tooling import policy_harness, stackfile

# Every policy of the pack, spelled out: one dropped from the registry, or added to it, changes
# what passes.
PACK = {
    "bandwidth-class",
    "bandwidth-recommended",
    "port-exposure",
    "required-paths",
    "efa-placement",
    "node-count",
    "baseline-imdsv2",
    "baseline-ebs-encryption",
    "baseline-no-public-ip",
    "baseline-rule-descriptions",
    "baseline-health-check",
    "baseline-idle-timeout",
    "baseline-selinux",
    "baseline-tls-policy",
    "container-host-network",
    "keys-in-clear",
    "certificate-expiring",
    "monitoring-open",
    "monitoring-inside-clients",
    "stack-config",
}
ADVISORY = {
    "bandwidth-recommended",
    "baseline-idle-timeout",
    "keys-in-clear",
    "certificate-expiring",
    "monitoring-open",
    "monitoring-inside-clients",
    "stack-config",
}
AS_RENDERED = "as rendered"

_AWS = {
    AS_RENDERED: (set(), {"stack-config"}),
    "6000-6100 open to the world": ({"port-exposure"}, {"port-exposure", "stack-config"}),
    "5000 open to the world": ({"port-exposure"}, {"port-exposure", "stack-config"}),
    "SSH from the world": ({"port-exposure"}, {"port-exposure", "stack-config"}),
    "SSH from the world in two halves": ({"port-exposure"}, {"port-exposure", "stack-config"}),
    # t3.large has no EFA, which the stack config (and the launch template) asks for.
    "t3.large nodes": (
        {"bandwidth-class", "efa-placement"},
        {"bandwidth-class", "efa-placement", "stack-config"},
    ),
    "one node": ({"node-count"}, {"node-count", "stack-config"}),
    "spread placement group": ({"efa-placement"}, {"efa-placement", "stack-config"}),
    "IMDSv1": ({"baseline-imdsv2"}, {"baseline-imdsv2", "stack-config"}),
    "egress self-rule missing": ({"required-paths"}, {"required-paths", "stack-config"}),
}
# (stack, mutation) -> the policies that fail with the stack config, and without it; every other
# policy of the pack passes. Without the config the stack-config advisory names what was relaxed.
FAILING: dict[tuple[str, str], tuple[set[str], set[str]]] = {
    **{("dev", label): failing for label, failing in _AWS.items()},
    **{("prod", label): failing for label, failing in _AWS.items()},
    ("onprem", AS_RENDERED): (set(), {"stack-config"}),
    ("onprem", "6000-6100 open to the world"): ({"port-exposure"}, {"port-exposure", "stack-config"}),
    ("onprem", "5000 open to the world"): ({"port-exposure"}, {"port-exposure", "stack-config"}),
    ("onprem", "SSH from the world"): ({"port-exposure"}, {"port-exposure", "stack-config"}),
    ("onprem", "SSH from the world in two halves"): ({"port-exposure"}, {"port-exposure", "stack-config"}),
    ("onprem", "a container publishing a port"): (
        {"container-host-network"},
        {"container-host-network", "stack-config"},
    ),
    ("onprem", "t3.large nodes"): ({"bandwidth-class"}, {"bandwidth-class", "stack-config"}),
    # Without the config the members are the hosts that remain: the master's firewall still
    # admits the dropped hosts' addresses to all traffic.
    ("onprem", "one node"): ({"node-count"}, {"node-count", "port-exposure", "stack-config"}),
}


def real_cases():
    for stack in stackfile.STACKS:
        yield stack, AS_RENDERED, None, None
    yield from mutation_cases(stackfile.STACKS)


def case_params(cases):
    return [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in cases]


CASE = ("stack", "label", "mutate", "policy")


def verdict(violations: list[policy_harness.Violation]) -> dict[str, set[str]]:
    """Which policies pass and which fail (report anything, advisories included), and which of
    the failing ones fail the stack (mandatory)."""
    failing = {v.policy for v in violations}
    return {
        "passing": {policy.name for policy in guard.POLICIES} - failing,
        "failing": failing,
        "mandatory": {v.policy for v in policy_harness.mandatory(violations)},
    }


# The committed stacks serve API keys (set with `pulumi config set --secret`; offline the
# throwaway one) without loadBalancer.tls, and their monitoringCidrs (10.20.0.0/16) lie inside
# clientCidrs (10.0.0.0/8): the pack says both whenever it has their config.
IN_CLEAR = {"keys-in-clear", "monitoring-inside-clients"}


def expected(failing: set[str]) -> dict[str, set[str]]:
    return {"passing": PACK - failing, "failing": failing, "mandatory": failing - ADVISORY}


def resources_of(stack: str, mutate) -> list:
    render, _ = rendered(stack)
    assert render.error is None
    return mutate(render.resources) if mutate else render.resources


def test_the_table_covers_every_case_and_each_mutation_fails_its_policy():
    cases = list(real_cases())
    assert {(stack, label) for stack, label, _, _ in cases} == set(FAILING)
    for stack, label, _, policy in cases:
        with_config, without_config = FAILING[(stack, label)]
        assert policy is None or policy in with_config & without_config, (stack, label)


@pytest.mark.parametrize(CASE, case_params(real_cases()))
def test_a_real_stack_fails_exactly_the_expected_policies(stack, label, mutate, policy):
    resources = resources_of(stack, mutate)
    violations = policy_harness.analyze(resources, stack=stack, cluster=stackfile.load(stack))
    assert verdict(violations) == expected(FAILING[(stack, label)][0] | IN_CLEAR)


@pytest.mark.parametrize(CASE, case_params(real_cases()))
def test_without_a_stack_config_a_real_stack_fails_exactly_the_expected_policies(
    stack, label, mutate, policy
):
    """World exposure, the EFA self rules and the baseline need no stack config."""
    resources = resources_of(stack, mutate)
    violations = policy_harness.analyze(resources, stack=stack, cluster=None)
    assert verdict(violations) == expected(FAILING[(stack, label)][1])


def fixture_cases():
    for stack in ("dev", "onprem"):
        yield stack, AS_RENDERED, None, None
    yield from mutation_cases(("dev", "onprem"))


@pytest.mark.parametrize(CASE, case_params(fixture_cases()))
def test_a_fixture_stack_fails_exactly_what_the_real_stack_fails(stack, label, mutate, policy):
    resources = aws_stack() if stack == "dev" else bare_metal_stack()
    resources = mutate(resources) if mutate else resources
    violations = policy_harness.analyze(resources, stack=stack, cluster=stackfile.load(stack))
    assert verdict(violations) == expected(FAILING[(stack, label)][0] | IN_CLEAR)


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_check_config_renders_a_stack_config_and_every_policy_passes(stack):
    """Every policy passes but the advisories on keys without TLS and on monitoring hosts that are
    clients too."""
    violations = policy_harness.check_config(stackfile.read(stack), stack)
    assert verdict(violations) == expected(IN_CLEAR)
