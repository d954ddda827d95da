"""IAM's evaluation of identity policies, the project's one: whether a set of policy documents
allows a request. The deploy policy's checks (tooling/deploy_policy.py) and the AWS lab's API
endpoints (labkit/aws/service.py, for the node role's calls) both decide with it.

As AWS evaluates an identity policy (IAM User Guide, "Policy evaluation logic" and "IAM JSON
policy elements: Condition operators"): an explicit Deny wins, else any matching Allow, else an
implicit deny (AccessDenied). Actions match case-insensitively with `*` and `?`, resources
case-sensitively with the same wildcards, each within its ARN segment unless it ends the segment;
every condition block must hold, its key names matched whatever their case. Operators modelled:
StringEquals, StringNotEquals, StringEqualsIgnoreCase, StringLike, StringNotLike, ArnEquals and
ArnLike (alike: the guide gives both wildcard matching of the ARN, component by component), each
with `...IfExists`. A key missing from the request fails a condition, except with IfExists or a
negated operator, where it holds. Anything else raises rather than guess.

moto (pinned in requirements.txt for the lab's S3 and Parameter Store) has an evaluator too
(moto/iam/access_control.py, 5.2.5), but not one this project can use: its conditions know only
StringEquals, ignore every other operator (the statement then applies), have no IfExists, and a
condition that does not hold turns an Allow statement into a Deny; its wildcards are unescaped
regular expressions without `?`, and it matches actions case-sensitively. The lab's ELBv2 calls
never reach moto either (labkit/aws/elb.py answers them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Request:
    """One API call as IAM sees it: the action, the resource ARNs it touches, its context keys."""

    action: str  # service:Operation
    resources: tuple[str, ...] = ("*",)
    context: Mapping[str, str] = field(default_factory=dict)


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


def _resource_wildcard(pattern: str, arn: str) -> bool:
    """A Resource pattern against an ARN, as the IAM User Guide's "IAM JSON policy elements:
    Resource" (Using wildcards in resource ARNs) has it: `*` and `?` work within the segments
    between colons, except that a `*` that is the last character of a segment "can expand to match
    beyond the colon boundaries" (so `"*"` alone, or `.../*` at the end, covers everything)."""
    parts = []
    for index, ch in enumerate(pattern):
        if ch == "*":
            ends_segment = index + 1 == len(pattern) or pattern[index + 1] == ":"
            parts.append(".*" if ends_segment else "[^:]*")
        elif ch == "?":
            parts.append("[^:]")
        else:
            parts.append(re.escape(ch))
    return re.fullmatch("".join(parts), arn) is not None


# An ARN's components: arn:partition:service:region:account-id:resource (the resource may hold
# colons itself).
_ARN_COMPONENTS = 6


def _arn_like(pattern: str, arn: str) -> bool:
    """ArnLike (and ArnEquals, alike): the IAM User Guide's condition operators say that "each of
    the six colon-delimited components of the ARN is checked separately", each with `*` and `?`."""
    wanted, given = pattern.split(":", _ARN_COMPONENTS - 1), arn.split(":", _ARN_COMPONENTS - 1)
    if len(wanted) != _ARN_COMPONENTS or len(given) != _ARN_COMPONENTS:
        return False
    return all(_wildcard(w, g, case=True) for w, g in zip(wanted, given, strict=True))


def _condition_holds(operator: str, key: str, wanted: list[str], context: Mapping[str, str]) -> bool:
    if_exists = operator.endswith("IfExists")
    base = operator[: -len("IfExists")] if if_exists else operator
    # "Context key names are not case-sensitive" (IAM User Guide, "IAM JSON policy elements:
    # Condition": aws:SourceIP is AWS:SourceIp); their values keep the operator's rule.
    by_name = {name.lower(): value for name, value in context.items()}
    if key.lower() not in by_name:
        return if_exists or base.startswith(("StringNot", "ArnNot"))
    value = by_name[key.lower()]
    if base == "StringEquals":
        return value in wanted
    if base == "StringLike":
        return any(_wildcard(pattern, value, case=True) for pattern in wanted)
    if base in ("ArnEquals", "ArnLike"):
        return any(_arn_like(pattern, value) for pattern in wanted)
    if base == "StringNotEquals":
        return value not in wanted
    if base == "StringNotLike":
        return not any(_wildcard(pattern, value, case=True) for pattern in wanted)
    if base == "StringEqualsIgnoreCase":
        return value.lower() in [item.lower() for item in wanted]
    raise ValueError(f"condition operator {operator} is not modelled (tooling/iampolicy.py)")


def _matches(statement: Mapping[str, Any], request: Request, resource: str) -> bool:
    if "Action" in statement:
        if not any(_wildcard(p, request.action, case=False) for p in _listed(statement["Action"])):
            return False
    elif any(_wildcard(p, request.action, case=False) for p in _listed(statement.get("NotAction"))):
        return False
    if "Resource" in statement:
        if not any(_resource_wildcard(p, resource) for p in _listed(statement["Resource"])):
            return False
    elif any(_resource_wildcard(p, resource) for p in _listed(statement.get("NotResource"))):
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
    documents: Sequence[Mapping[str, Any]]

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


def allows(document: Mapping[str, Any], action: str, arn: str, context: Mapping[str, str]) -> bool:
    """Whether `document` alone allows `action` on `arn` under `context` (condition keys -> value)."""
    return Principal("caller", [document]).evaluate(Request(action, (arn,), context)).allowed
