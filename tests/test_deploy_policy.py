"""The deploy role's policy (docs/aws.md) is generated from what the program registers, covers
every committed AWS stack and its variants, and lints clean (tooling/deploy_policy.py)."""

from __future__ import annotations

import copy
import json

import pytest
from parliament import analyze_policy_string

from qwen_cluster.tags import STACK_TAG
from tooling import deploy_grants, deploy_policy, iampolicy, offline


@pytest.fixture(scope="module")
def found() -> deploy_policy.Registered:
    return deploy_policy.registered()


@pytest.fixture(scope="module")
def committed_policy() -> dict:
    """The policy as docs/aws.md holds it."""
    text = deploy_policy.OUTPUT.read_text()
    section = text[text.index(deploy_policy.BEGIN) : text.index(deploy_policy.END)]
    return json.loads(section[section.index("```json") + len("```json") : section.rindex("```")])


def test_the_policy_in_the_docs_is_what_the_program_renders(found):
    committed = deploy_policy.OUTPUT.read_text()
    assert committed == deploy_policy.render_docs(committed, found), (
        "docs/aws.md's deploy policy is stale: run `make docs` (python -m tooling.deploy_policy)"
    )


def test_every_registration_of_every_committed_stack_and_variant_is_covered(found, committed_policy):
    assert set(found.renders) == {"dev", "prod"}
    assert deploy_policy.uncovered(found, committed_policy) == []


def test_a_type_without_a_grant_is_reported(found, committed_policy):
    render = next(iter(found.all()))
    stray = offline.RecordedResource("aws:rds/instance:Instance", "database", {"tags": {}}, {}, True)
    extra = deploy_policy.Registered({"dev": [offline.Render("dev", [stray], {}, [])]}, {"dev": "us-west-2"})
    assert deploy_policy.uncovered(extra, committed_policy) == [
        "dev: aws:rds/instance:Instance database has no grant"
    ]
    with pytest.raises(KeyError, match="no grant for aws:rds/instance:Instance"):
        deploy_policy.policy(extra)
    assert render.custom_resources  # the real renders are not touched


def test_a_name_the_policy_does_not_know_is_reported(found, committed_policy):
    """A document the program would name differently (a new logical name) is not covered."""
    dev = found.renders["dev"][0]
    renamed = copy.deepcopy(dev)
    document = next(r for r in renamed.resources if r.type == "aws:ssm/document:Document")
    document.name = "renamed-document"
    extra = deploy_policy.Registered({"dev": [renamed]}, {"dev": "us-west-2"})
    problems = deploy_policy.uncovered(extra, committed_policy)
    assert "dev: aws:ssm/document:Document renamed-document: ssm:CreateDocument not allowed on " in "\n".join(
        problems
    )


def test_a_resource_without_the_stack_tag_is_reported(found, committed_policy):
    renamed = copy.deepcopy(found.renders["dev"][0])
    subnet = next(r for r in renamed.resources if r.type == "aws:ec2/subnet:Subnet")
    subnet.inputs["tags"] = {"Name": subnet.name}
    extra = deploy_policy.Registered({"dev": [renamed]}, {"dev": "us-west-2"})
    assert f"dev: aws:ec2/subnet:Subnet {subnet.name} is not tagged {STACK_TAG}=dev" in (
        deploy_policy.uncovered(extra, committed_policy)
    )


def test_another_stacks_name_is_not_covered(committed_policy):
    parameter = "arn:aws:ssm:us-west-2:ACCOUNT:parameter/qwen-cluster/staging/endpoint/api-keys"
    assert not iampolicy.allows(committed_policy, "ssm:PutParameter", parameter, {})
    own = "arn:aws:ssm:us-west-2:ACCOUNT:parameter/qwen-cluster/dev/endpoint/api-keys"
    assert iampolicy.allows(committed_policy, "ssm:PutParameter", own, {})


def test_what_the_old_hand_written_policy_lacked_is_granted(committed_policy):
    """SSM Parameter Store (the endpoint's keys, Ray's token) and the proxy's document."""
    for stack in ("dev", "prod"):
        region = {"dev": "us-west-2", "prod": "us-east-1"}[stack]
        for name in ("endpoint/api-keys", "endpoint/tls-certificate", "ray-auth-token"):
            arn = f"arn:aws:ssm:{region}:ACCOUNT:parameter/qwen-cluster/{stack}/{name}"
            for action in (
                "ssm:PutParameter",
                "ssm:GetParameter",
                "ssm:DeleteParameter",
                "ssm:AddTagsToResource",
            ):
                assert iampolicy.allows(committed_policy, action, arn, {}), (action, arn)
        document = f"arn:aws:ssm:{region}:ACCOUNT:document/node-proxy-document-1a2b3c4"
        for action in ("ssm:CreateDocument", "ssm:UpdateDocument", "ssm:DeleteDocument"):
            assert iampolicy.allows(committed_policy, action, document, {})


def test_ec2_calls_reach_only_resources_of_the_stacks(committed_policy):
    instance = "arn:aws:ec2:us-west-2:ACCOUNT:instance/i-0123456789abcdef0"
    ours = {f"aws:ResourceTag/{STACK_TAG}": "dev"}
    theirs = {f"aws:ResourceTag/{STACK_TAG}": "someone-else"}
    assert iampolicy.allows(committed_policy, "ec2:TerminateInstances", instance, ours)
    assert not iampolicy.allows(committed_policy, "ec2:TerminateInstances", instance, theirs)
    assert not iampolicy.allows(committed_policy, "ec2:TerminateInstances", instance, {})  # untagged
    assert not iampolicy.allows(
        committed_policy, "ec2:RunInstances", instance, {f"aws:RequestTag/{STACK_TAG}": "someone-else"}
    )


def test_pass_role_is_for_the_node_role_and_ec2_only(committed_policy):
    role = "arn:aws:iam::ACCOUNT:role/gpu-node-role-role-1a2b3c4"
    assert iampolicy.allows(
        committed_policy, "iam:PassRole", role, {"iam:PassedToService": "ec2.amazonaws.com"}
    )
    assert not iampolicy.allows(
        committed_policy, "iam:PassRole", role, {"iam:PassedToService": "lambda.amazonaws.com"}
    )
    admin = "arn:aws:iam::ACCOUNT:role/Admin"
    assert not iampolicy.allows(
        committed_policy, "iam:PassRole", admin, {"iam:PassedToService": "ec2.amazonaws.com"}
    )


def test_a_capacity_reservation_and_an_existing_vpc_are_named(found):
    document = deploy_policy.policy(found)
    resources = [arn for s in document["Statement"] for arn in _list(s["Resource"])]
    assert "arn:aws:ec2:us-west-2:ACCOUNT:capacity-reservation/CAPACITY_RESERVATION_ID" in resources
    assert "arn:aws:ec2:us-west-2:ACCOUNT:vpc/VPC_ID" in resources
    mine = deploy_policy.Registered()
    stack_config = deploy_policy.variant_config(
        "dev", {"aws": {"capacityReservationId": "cr-0aaaabbbbccccdddd"}}
    )
    mine.add("dev", stack_config, offline.render(stack_config, "dev"))
    own = deploy_policy.policy(mine)
    reservation = "arn:aws:ec2:us-west-2:ACCOUNT:capacity-reservation/cr-0aaaabbbbccccdddd"
    assert iampolicy.allows(own, "ec2:RunInstances", reservation, {})


def _list(value):
    return value if isinstance(value, list) else [value]


def _lint(document: dict, community: bool) -> list:
    text = json.dumps(document).replace(deploy_policy.ACCOUNT, "123456789012")
    return analyze_policy_string(text, include_community_auditors=community).findings


def test_parliament_reports_nothing(committed_policy):
    """parliament's default auditors, as `parliament --file` runs them."""
    assert [(f.issue, f.detail, f.location) for f in _lint(committed_policy, community=False)] == []


def test_parliaments_community_auditors_report_only_what_deploying_a_role_implies(committed_policy):
    """Creating the node role and starting instances with it: said in docs/aws.md."""
    findings = sorted(
        (f.issue, "CreateEC2WithExistingIP" in str(f.location)) for f in _lint(committed_policy, True)
    )
    assert findings == [("PERMISSIONS_MANAGEMENT_ACTIONS", False), ("PRIVILEGE_ESCALATION", True)]


def _grants_file(tmp_path, change) -> object:
    """tooling/deploy_grants.yaml with `change` applied to its parsed rows, written to tmp_path."""
    import yaml

    raw = yaml.safe_load(deploy_grants.SOURCE.read_text())
    change(raw["grants"])
    path = tmp_path / "deploy_grants.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _row(grants: list[dict], type_: str) -> dict:
    return next(row for row in grants if row["type"] == type_)


def test_the_grants_file_holds_every_row_with_its_citation():
    assert len(deploy_grants.GRANTS) == len(deploy_grants.load())
    assert all(grant.source.startswith("internal/service/") for grant in deploy_grants.GRANTS)
    assert deploy_grants.grants_for("aws:ec2/vpc:Vpc")[0].tag == ("ec2:CreateTags", "ec2:DeleteTags")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda rows: _row(rows, "aws:ec2/vpc:Vpc").update(arns=["arn:aws:ec2:{region}::vpc/*"]),
         "a tag-scoped grant has no arns"),
        (lambda rows: _row(rows, "aws:ssm/document:Document").update(arns=[]),
         "a name-scoped grant needs arns"),
        (lambda rows: _row(rows, "aws:ssm/document:Document").update(arn=["x"]),
         "Extra inputs are not permitted"),
        (lambda rows: _row(rows, "aws:ssm/document:Document").update(create=["CreateDocument"]),
         "(aws:ssm/document:Document) create: 'CreateDocument' is not an IAM action"),
        (lambda rows: _row(rows, "aws:ssm/document:Document").update(source="ssm/document.go"),
         "String should match pattern"),
        (lambda rows: _row(rows, "aws:ssm/document:Document").update(
            arns=["arn:aws:ssm:{region}:{account}:document/{aws:ssm/documents:Document}"]),
         "{aws:ssm/documents:Document} is neither one of region, account, name"),
        (lambda rows: _row(rows, "aws:iam/rolePolicyAttachment:RolePolicyAttachment").update(
            sid="RolePolicyAttachmentRead"),
         "statement RolePolicyAttachmentRead is aws:iam/rolePolicyAttachment:RolePolicyAttachment's too"),
    ],
    ids=["field-of-another-scope", "scope-without-arns", "unknown-field", "bad-action", "bad-source",
         "unknown-placeholder", "duplicate-sid"],
)  # fmt: skip
def test_a_grants_file_that_does_not_hold_is_refused_naming_what(tmp_path, change, message):
    with pytest.raises(ValueError, match="deploy_grants.yaml is not valid") as refused:
        deploy_grants.load(_grants_file(tmp_path, change))
    assert message in str(refused.value)


def test_a_cache_aware_stacks_router_is_covered(committed_policy):
    """loadBalancer.routing cache-aware registers the router's SSM document and association on
    aws (components/aws/router.py): the deploy role may create them."""
    from tests.helpers import aws_stacks

    config = deploy_policy.variant_config("dev", {"loadBalancer": {"routing": "cache-aware"}})
    render = aws_stacks.render(config)
    assert render.named("router-document")
    extra = deploy_policy.Registered({"dev": [render]}, {"dev": "us-west-2"})
    assert deploy_policy.uncovered(extra, committed_policy) == []
