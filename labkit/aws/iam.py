"""IAM policy evaluation for the calls the GPU nodes make, as AWS evaluates an identity policy:
an explicit Deny wins, else any matching Allow, else an implicit deny (AccessDenied).

The policies are the node role's as the program registers them (every inline
`aws:iam/rolePolicy:RolePolicy` on the role, every attached managed policy), read from the
render with the lab's identities (labkit/aws/model.py `identities`) in place of the mocks' values.
Rules followed (IAM User Guide, "Policy evaluation logic" and "IAM JSON policy elements"):
actions match case-insensitively with `*` and `?`; resources case-sensitively with the same
wildcards; every condition block must hold (operators used by this project: StringEquals,
StringLike, StringNotEquals, StringNotLike, ArnEquals, ArnLike, with `...IfExists`); a key
missing from the request fails a condition unless the operator ends with IfExists.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# AmazonSSMManagedInstanceCore, version v2 (the default since 2019-05-23), as AWS publishes it:
# https://docs.aws.amazon.com/aws-managed-policy/latest/reference/AmazonSSMManagedInstanceCore.html
MANAGED_POLICIES: dict[str, dict[str, Any]] = {
    "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore": {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": [
                    "ssm:DescribeAssociation",
                    "ssm:GetDeployablePatchSnapshotForInstance",
                    "ssm:GetDocument",
                    "ssm:DescribeDocument",
                    "ssm:GetManifest",
                    "ssm:GetParameter",
                    "ssm:GetParameters",
                    "ssm:ListAssociations",
                    "ssm:ListInstanceAssociations",
                    "ssm:PutInventory",
                    "ssm:PutComplianceItems",
                    "ssm:PutConfigurePackageResult",
                    "ssm:UpdateAssociationStatus",
                    "ssm:UpdateInstanceAssociationStatus",
                    "ssm:UpdateInstanceInformation",
                ],
                "Resource": "*",
            },
            {
                "Effect": "Allow",
                "Action": [
                    "ssmmessages:CreateControlChannel",
                    "ssmmessages:CreateDataChannel",
                    "ssmmessages:OpenControlChannel",
                    "ssmmessages:OpenDataChannel",
                ],
                "Resource": "*",
            },
            {
                "Effect": "Allow",
                "Action": [
                    "ec2messages:AcknowledgeMessage",
                    "ec2messages:DeleteMessage",
                    "ec2messages:FailMessage",
                    "ec2messages:GetEndpoint",
                    "ec2messages:GetMessages",
                    "ec2messages:SendReply",
                ],
                "Resource": "*",
            },
        ],
    }
}


@dataclass(frozen=True)
class Request:
    """One API call as IAM sees it: the action, the resource ARNs it touches, its context keys."""

    action: str  # service:Operation
    resources: tuple[str, ...] = ("*",)
    context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def _listed(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(item) for item in value] if isinstance(value, list) else [str(value)]


def _wildcard(pattern: str, value: str, *, case: bool) -> bool:
    regex = "".join(".*" if ch == "*" else "." if ch == "?" else re.escape(ch) for ch in pattern)
    return re.fullmatch(regex, value, 0 if case else re.IGNORECASE) is not None


def _condition_holds(operator: str, key: str, wanted: list[str], context: dict[str, str]) -> bool:
    if_exists = operator.endswith("IfExists")
    base = operator[: -len("IfExists")] if if_exists else operator
    if key not in context:
        return if_exists or base.startswith(("StringNot", "ArnNot"))
    value = context[key]
    if base in ("StringEquals", "ArnEquals"):
        return value in wanted
    if base in ("StringLike", "ArnLike"):
        return any(_wildcard(pattern, value, case=True) for pattern in wanted)
    if base == "StringNotEquals":
        return value not in wanted
    if base == "StringNotLike":
        return not any(_wildcard(pattern, value, case=True) for pattern in wanted)
    if base == "StringEqualsIgnoreCase":
        return value.lower() in [item.lower() for item in wanted]
    raise ValueError(f"condition operator {operator} is not modelled by the lab (labkit/aws/iam.py)")


def _matches(statement: dict[str, Any], request: Request, resource: str) -> bool:
    if "Action" in statement:
        if not any(_wildcard(p, request.action, case=False) for p in _listed(statement["Action"])):
            return False
    elif any(_wildcard(p, request.action, case=False) for p in _listed(statement.get("NotAction"))):
        return False
    if "Resource" in statement:
        if not any(_wildcard(p, resource, case=True) for p in _listed(statement["Resource"])):
            return False
    elif any(_wildcard(p, resource, case=True) for p in _listed(statement.get("NotResource"))):
        return False
    for operator, keys in (statement.get("Condition") or {}).items():
        for key, wanted in keys.items():
            if not _condition_holds(operator, key, _listed(wanted), request.context):
                return False
    return True


@dataclass
class Principal:
    """An identity and the policy documents attached to it (inline and managed)."""

    name: str
    documents: list[dict[str, Any]]

    def evaluate(self, request: Request) -> Decision:
        """Every resource of the request must be allowed, none denied."""
        for resource in request.resources:
            allowed = False
            for document in self.documents:
                statements = document.get("Statement", [])
                for statement in statements if isinstance(statements, list) else [statements]:
                    if not _matches(statement, request, resource):
                        continue
                    if statement.get("Effect") == "Deny":
                        return Decision(False, f"explicitly denied on {resource}")
                    allowed = True
            if not allowed:
                return Decision(
                    False,
                    f"User: {self.name} is not authorized to perform: {request.action} on resource: "
                    f"{resource} because no identity-based policy allows the {request.action} action",
                )
        return Decision(True, "allowed")


def documents_of_role(role_name: str, inline: list[str], attached: list[str]) -> list[dict[str, Any]]:
    """The role's policy documents: inline policy texts (JSON) and attached managed policy ARNs."""
    documents = [json.loads(text) for text in inline]
    for arn in attached:
        if arn not in MANAGED_POLICIES:
            raise ValueError(f"{role_name}: managed policy {arn} is not known to the lab (labkit/aws/iam.py)")
        documents.append(MANAGED_POLICIES[arn])
    return documents
