"""IAM's evaluation of identity policies (tooling/iampolicy.py), the one the deploy policy's checks
and the AWS lab's endpoints both decide with: as the IAM User Guide describes it."""

from __future__ import annotations

import pytest

from tooling import iampolicy
from tooling.iampolicy import Principal, Request


def _allow(condition: dict | None = None, action: str = "ssm:GetParameter", resource: str = "*") -> dict:
    statement = {"Effect": "Allow", "Action": action, "Resource": resource}
    if condition:
        statement["Condition"] = condition
    return {"Statement": [statement]}


def test_an_explicit_deny_wins_and_conditions_must_hold():
    principal = Principal(
        "p",
        [
            {"Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]},
            {"Statement": [{"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "arn:aws:s3:::b/*"}]},
            _allow({"StringEquals": {"aws:RequestedRegion": "us-west-2"}}),
        ],
    )
    assert not principal.evaluate(Request("s3:DeleteObject", ("arn:aws:s3:::b/k",))).allowed
    assert principal.evaluate(Request("s3:GetObject", ("arn:aws:s3:::b/k",))).allowed
    assert not principal.evaluate(Request("ssm:GetParameter", ("x",))).allowed
    assert principal.evaluate(
        Request("ssm:GetParameter", ("x",), {"aws:RequestedRegion": "us-west-2"})
    ).allowed


def test_an_explicit_deny_wins_over_the_allow_of_the_same_document():
    document = {
        "Statement": [
            {"Effect": "Allow", "Action": "ec2:*", "Resource": "*"},
            {"Effect": "Deny", "Action": "ec2:TerminateInstances", "Resource": "*"},
        ]
    }
    assert iampolicy.allows(document, "ec2:RunInstances", "arn:aws:ec2:us-west-2:1:instance/i-1", {})
    assert not iampolicy.allows(
        document, "ec2:TerminateInstances", "arn:aws:ec2:us-west-2:1:instance/i-1", {}
    )


def test_actions_match_whatever_their_case_and_resources_only_in_theirs():
    document = _allow(action="ssm:getparameter", resource="arn:aws:ssm:*:*:parameter/Team/*")
    assert iampolicy.allows(document, "ssm:GetParameter", "arn:aws:ssm:us-west-2:1:parameter/Team/x", {})
    assert not iampolicy.allows(document, "ssm:GetParameter", "arn:aws:ssm:us-west-2:1:parameter/team/x", {})


def test_wildcards_are_star_and_question_mark_and_nothing_else():
    document = _allow(resource="arn:aws:s3:::b/[a].?")
    assert iampolicy.allows(document, "ssm:GetParameter", "arn:aws:s3:::b/[a].x", {})
    assert not iampolicy.allows(document, "ssm:GetParameter", "arn:aws:s3:::b/a.x", {})
    assert not iampolicy.allows(document, "ssm:GetParameter", "arn:aws:s3:::b/[a]xx", {})


def test_arn_equals_matches_wildcards_as_arn_like_does():
    """The IAM User Guide's condition operators: ArnEquals and ArnLike alike."""
    document = _allow({"ArnEquals": {"iam:PolicyARN": "arn:aws:iam::aws:policy/AmazonSSM*"}})
    held = {"iam:PolicyARN": "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"}
    assert iampolicy.allows(document, "ssm:GetParameter", "x", held)
    assert not iampolicy.allows(
        document, "ssm:GetParameter", "x", {"iam:PolicyARN": "arn:aws:iam::aws:policy/Admin"}
    )


@pytest.mark.parametrize(
    ("operator", "holds"),
    [
        ("StringEquals", False),
        ("StringEqualsIfExists", True),
        ("StringNotEquals", True),
        ("ArnNotLike", True),
    ],
)
def test_a_key_missing_from_the_request_fails_a_condition_unless_ifexists_or_negated(operator, holds):
    document = _allow({operator: {"aws:ResourceTag/team": "a"}})
    assert iampolicy.allows(document, "ssm:GetParameter", "x", {}) is holds


def test_an_operator_it_does_not_model_is_refused_not_guessed():
    document = _allow({"NumericLessThan": {"s3:max-keys": "10"}})
    with pytest.raises(ValueError, match="NumericLessThan is not modelled"):
        iampolicy.allows(document, "ssm:GetParameter", "x", {"s3:max-keys": "5"})


def test_condition_key_names_match_whatever_their_case():
    """IAM User Guide, "IAM JSON policy elements: Condition": context key names are not
    case-sensitive (aws:SourceIP is AWS:SourceIp); values keep their operator's rule."""
    document = _allow({"StringEquals": {"AWS:RequestedRegion": "us-west-2"}})
    assert iampolicy.allows(document, "ssm:GetParameter", "x", {"aws:requestedregion": "us-west-2"})
    assert not iampolicy.allows(document, "ssm:GetParameter", "x", {"aws:RequestedRegion": "US-WEST-2"})
    negated = _allow({"StringNotEquals": {"ec2:ResourceTag/Role": "master"}})
    assert not iampolicy.allows(negated, "ssm:GetParameter", "x", {"EC2:resourcetag/role": "master"})


def test_a_resource_wildcard_stays_in_its_arn_segment_unless_it_ends_the_segment():
    """IAM User Guide, "IAM JSON policy elements: Resource", Using wildcards in resource ARNs: `*`
    and `?` work within a segment (the parts between colons); a `*` that is the last character of
    a segment can expand beyond the colon."""
    inside = _allow(resource="arn:aws:logs:us-west-2:1:log-group:qwen-*-app")
    assert iampolicy.allows(inside, "ssm:GetParameter", "arn:aws:logs:us-west-2:1:log-group:qwen-x-app", {})
    assert not iampolicy.allows(
        inside, "ssm:GetParameter", "arn:aws:logs:us-west-2:1:log-group:qwen-x:log-stream:y-app", {}
    )
    one = _allow(resource="arn:aws:logs:us-west-2:1:log-group:a?b")
    assert not iampolicy.allows(one, "ssm:GetParameter", "arn:aws:logs:us-west-2:1:log-group:a:b", {})
    ending = _allow(resource="arn:aws:logs:us-west-2:1:log-group:qwen-*")
    assert iampolicy.allows(
        ending, "ssm:GetParameter", "arn:aws:logs:us-west-2:1:log-group:qwen-x:log-stream:y", {}
    )
    region = _allow(resource="arn:aws:ssm:*:1:parameter/x")
    assert iampolicy.allows(region, "ssm:GetParameter", "arn:aws:ssm:us-west-2:1:parameter/x", {})
    assert iampolicy.allows(_allow(), "ssm:GetParameter", "arn:aws:logs:us-west-2:1:log-group:g:x", {})


def test_arn_like_checks_each_of_the_six_components_apart():
    """IAM User Guide, condition operators, ARN condition operators: each of the six colon-delimited
    components of the ARN is checked separately."""
    document = _allow({"ArnLike": {"aws:SourceArn": "arn:aws:ec2:*:1:instance/*"}})
    assert iampolicy.allows(
        document, "ssm:GetParameter", "x", {"aws:SourceArn": "arn:aws:ec2:us-west-2:1:instance/i-1"}
    )
    assert not iampolicy.allows(
        document, "ssm:GetParameter", "x", {"aws:SourceArn": "arn:aws:ec2:us-west-2:2:1:instance/i"}
    )
