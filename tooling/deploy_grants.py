"""The deploy role's grants (tooling/deploy_grants.yaml): what terraform-provider-aws calls for
each resource type and lookup the program can register on AWS, loaded and validated once.

    from tooling.deploy_grants import GRANTS, grants_for
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SOURCE = Path(__file__).with_name("deploy_grants.yaml")
# Ids a stack may name in `aws` (ARN placeholder in the templates -> what the docs show for a variant).
ID_KEYS = {"vpcId": "VPC_ID", "capacityReservationId": "CAPACITY_RESERVATION_ID"}
# What an ARN template may hold besides `{<type token>}` (a name-scoped type's names).
PLACEHOLDERS = ("region", "account", "name", *ID_KEYS)

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Foreign(_Frozen):
    """A call on a resource that is not the stack's (an AMI, the volumes and interfaces
    RunInstances creates untagged, an existing VPC)."""

    action: str = Field(pattern=r"^[a-z0-9-]+:[A-Za-z0-9]+$")
    arn: str


class Grant(_Frozen):
    """What the provider calls for one resource type (or lookup), and on which resources.

    `scope`:
    - "tag": EC2; `arn_types` are the EC2 resource types it creates or changes, reached through
      the stack tag (aws:RequestTag on create, aws:ResourceTag after);
    - "name": `arns` are ARN templates (`{region}`, `{account}`, `{name}`: this resource's name
      pattern, `{<type token>}`: the name patterns of that type's resources in the same stack);
    - "lookup": an invoke; only account-wide reads.
    `listing`: reads IAM cannot narrow to a resource (Describe*/List* without resource types),
    granted on "*". `foreign`: calls on resources that are not the stack's.
    `condition`: an IAM condition on this row's statement (name scope). `sid`: the statement's
    name when a type has more than one row. `named_by`: the input holding an explicit name
    (None: Pulumi's auto-name)."""

    type: str = Field(pattern=r"^aws:[A-Za-z0-9]+/[A-Za-z0-9]+:[A-Za-z0-9]+$")
    source: str = Field(pattern=r"^internal/service/[a-z0-9]+/[a-z0-9_]+\.go$")
    scope: Literal["tag", "name", "lookup"]
    create: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    update: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    tag: tuple[str, ...] = ()
    listing: tuple[str, ...] = ()
    arn_types: tuple[str, ...] = ()
    arns: tuple[str, ...] = ()
    foreign: tuple[Foreign, ...] = ()
    condition: dict[str, dict[str, str]] | None = None
    sid: str = Field(default="", pattern=r"^[A-Za-z0-9]*$")
    named_by: str | None = None

    @field_validator("create", "read", "update", "delete", "tag", "listing")
    @classmethod
    def _actions(cls, actions: tuple[str, ...]) -> tuple[str, ...]:
        for action in actions:
            if not re.fullmatch(r"[a-z0-9-]+:[A-Za-z0-9]+", action):
                raise ValueError(f"{action!r} is not an IAM action (service:Operation)")
        return actions

    @model_validator(mode="after")
    def _scope_fields(self) -> Grant:
        wrong = {
            "tag": ("arns", "condition", "sid", "named_by"),
            "name": ("arn_types",),
            "lookup": ("create", "read", "update", "delete", "tag", "arn_types", "arns", "condition"),
        }[self.scope]
        present = [name for name in wrong if getattr(self, name)]
        if present:
            raise ValueError(f"a {self.scope}-scoped grant has no {', '.join(present)}")
        needed = {"tag": "arn_types", "name": "arns", "lookup": "listing"}[self.scope]
        if not getattr(self, needed):
            raise ValueError(f"a {self.scope}-scoped grant needs {needed}")
        return self

    @property
    def actions(self) -> tuple[str, ...]:
        """The calls on the stack's own resources (what the statement of its scope grants)."""
        return tuple(dict.fromkeys((*self.create, *self.read, *self.update, *self.delete, *self.tag)))


class GrantsFile(_Frozen):
    tag_calls: dict[str, tuple[str, ...]]
    grants: tuple[Grant, ...]

    @model_validator(mode="after")
    def _across_rows(self) -> GrantsFile:
        named = {grant.type for grant in self.grants if grant.scope == "name"}
        sids: dict[str, str] = {}
        for index, grant in enumerate(self.grants):
            templates = (*grant.arns, *(foreign.arn for foreign in grant.foreign))
            for key in {key for template in templates for key in _PLACEHOLDER.findall(template)}:
                if key not in PLACEHOLDERS and key not in named:
                    raise ValueError(
                        f"grants[{index}] ({grant.type}): {{{key}}} is neither one of "
                        f"{', '.join(PLACEHOLDERS)} nor a name-scoped type"
                    )
            if grant.scope == "name":
                sid = grant.sid or grant.type.rsplit(":", 1)[-1]
                if sid in sids:
                    raise ValueError(f"grants[{index}] ({grant.type}): statement {sid} is {sids[sid]}'s too")
                sids[sid] = grant.type
        return self


def load(path: Path = SOURCE) -> tuple[Grant, ...]:
    """The grants of `path`; a file that does not validate raises ValueError naming the row."""
    raw: Any = yaml.safe_load(path.read_text())
    try:
        return GrantsFile.model_validate(raw).grants
    except pydantic.ValidationError as error:
        rows = raw.get("grants") if isinstance(raw, dict) else None
        problems = [_problem(detail, rows) for detail in error.errors()]
        raise ValueError(f"{path.name} is not valid:\n" + "\n".join(problems)) from None


def _problem(detail: Any, rows: Any) -> str:
    """One validation error as `grants[3] (aws:ec2/vpc:Vpc) create: <why>`."""
    loc = list(detail["loc"])
    why = detail["msg"].removeprefix("Value error, ")
    if not loc:
        return f"  {why}"
    where = ".".join(map(str, loc))
    if loc[:1] == ["grants"] and len(loc) > 1 and isinstance(loc[1], int) and isinstance(rows, list):
        row = rows[loc[1]] if loc[1] < len(rows) and isinstance(rows[loc[1]], dict) else {}
        field = ".".join(map(str, loc[2:]))
        where = f"grants[{loc[1]}] ({row.get('type', '?')})" + (f" {field}" if field else "")
    return f"  {where}: {why}"


GRANTS = load()


def grants_for(type_: str) -> list[Grant]:
    return [grant for grant in GRANTS if grant.type == type_]


def covered_types() -> set[str]:
    return {grant.type for grant in GRANTS}
