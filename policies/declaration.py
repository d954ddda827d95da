"""How a policy of the pack is declared: once, its name, description, enforcement level, config
schema and validation function side by side (`@resource_policy` / `@stack_policy` over the
function). `policies.guard` lists the declarations and builds the pack's POLICIES from them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    Severity,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies import normalized as net

MANDATORY = EnforcementLevel.MANDATORY
ADVISORY = EnforcementLevel.ADVISORY

# A policy's config schema: property name -> JSON schema of the property (with its default).
Schema = Mapping[str, Mapping[str, Any]]
# A policy's config with the schema defaults filled in.
Settings = dict[str, Any]
# What a validation function is given: the engine's args, the report callback and its settings.
ResourceCheck = Callable[[ResourceValidationArgs, ReportViolation, Settings], None]
StackCheck = Callable[[StackValidationArgs, ReportViolation, Settings], None]


@dataclass(frozen=True, eq=False)
class Declared:
    """One policy as declared: everything the engine sees of it, and the function that judges."""

    kind: Literal["resource", "stack"]
    name: str
    description: str
    enforcement_level: EnforcementLevel
    severity: Severity
    remediation_steps: str
    check: ResourceCheck | StackCheck
    config_schema: Schema = field(default_factory=dict)

    @property
    def defaults(self) -> Settings:
        """The schema defaults: the CLI applies them, but a direct call (tests, the offline
        harness) does not, so the policy applies them itself."""
        return {key: spec["default"] for key, spec in self.config_schema.items() if "default" in spec}

    def settings(self, given: Mapping[str, Any] | None) -> Settings:
        """The policy's config with the schema defaults filled in. Configure delivers it as a
        protobuf Struct, so an integer property (minNodes: 3) arrives as 3.0: integers are made
        ints again."""
        merged = self.defaults
        for key, value in (given or {}).items():
            if key != "enforcementLevel":
                merged[key] = _as_schema_type(self.config_schema.get(key, {}), value)
        return merged

    def validate(self, args: Any, report: ReportViolation) -> None:
        self.check(args, report, self.settings(args.get_config()))  # type: ignore[arg-type]

    @functools.cached_property
    def policy(self) -> ResourceValidationPolicy | StackValidationPolicy:
        """The pulumi_policy object the pack serves."""
        kind = ResourceValidationPolicy if self.kind == "resource" else StackValidationPolicy
        return kind(
            name=self.name,
            description=self.description,
            validate=self.validate,
            enforcement_level=self.enforcement_level,
            config_schema=PolicyConfigSchema(properties=dict(self.config_schema)),
            severity=self.severity,
            remediation_steps=self.remediation_steps,
        )


def _as_schema_type(spec: Mapping[str, Any], value: Any) -> Any:
    if spec.get("type") == "integer" and net.integral(value) is not None:
        return net.integral(value)
    if spec.get("type") == "array" and net.is_list(value):
        return [_as_schema_type(spec.get("items", {}), item) for item in value]
    return value


def resource_policy(
    *,
    name: str,
    description: str,
    enforcement_level: EnforcementLevel,
    severity: Severity,
    remediation_steps: str,
    config_schema: Schema | None = None,
) -> Callable[[ResourceCheck], Declared]:
    """Declare the decorated function as a resource policy (it judges one resource's inputs)."""

    def declare(check: ResourceCheck) -> Declared:
        return Declared(
            "resource",
            name,
            description,
            enforcement_level,
            severity,
            remediation_steps,
            check,
            dict(config_schema or {}),
        )

    return declare


def stack_policy(
    *,
    name: str,
    description: str,
    enforcement_level: EnforcementLevel,
    severity: Severity,
    remediation_steps: str,
    config_schema: Schema | None = None,
) -> Callable[[StackCheck], Declared]:
    """Declare the decorated function as a stack policy (it judges every resource's outputs)."""

    def declare(check: StackCheck) -> Declared:
        return Declared(
            "stack",
            name,
            description,
            enforcement_level,
            severity,
            remediation_steps,
            check,
            dict(config_schema or {}),
        )

    return declare
