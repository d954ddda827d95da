"""Run the policy pack offline: over a stack rendered under Pulumi's mocks, or over fixtures.

Resource policies see each resource's inputs, stack policies every resource's outputs, as the
engine hands them over (wrapped in pulumi_policy's unknown-checking proxies). The engine's
property dependencies are the ones the SDK sent with each registration, as the offline render
recorded them (in a preview, ids are unknown and only these tell which group a rule belongs
to); for hand-written fixtures they are rebuilt from the mock ids (`offline.references`): a
property holding `<name>-id`, another resource's ARN or DNS name depends on that resource.
Schema defaults are applied by the policies themselves (`guard.settings`), so a missing config
here means the defaults, as with the CLI without `--policy-pack-config`. The config CI hands the
CLI is POLICY_CONFIG (.github/workflows/preview.yml and up.yml, `policyPackConfigs`); the offline
preview reads the same file (`read_policy_config`), so both judge against one set of thresholds.

Numbers reach the policies as the engine sends them: properties and policy config travel as
protobuf Structs, whose numbers are doubles, so a port of 5000 is 5000.0 here too. Secrets are
unwrapped as pulumi_policy's analyzer unwraps them, and a policy that reads a value unknown in
a preview gets the analyzer's advisory in place of its verdict.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)
from pulumi_policy.deserialize import deserialize_properties
from pulumi_policy.proxy import UnknownValueError, unknown_checking_proxy

from policies import guard
from qwen_cluster import config
from tooling import offline, stackfile
from tooling.offline import RecordedResource, Render, render, render_stack

PROJECT = "qwen-cluster"
# The policy pack's config as CI passes it to `pulumi preview` / `pulumi up`.
POLICY_CONFIG = stackfile.PROJECT_ROOT / "policies" / "config.json"


def read_policy_config(path: Path = POLICY_CONFIG) -> dict[str, Any]:
    """The policy config file (`--policy-pack-config`): policy name -> its properties."""
    return dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class Violation:
    policy: str
    enforcement: str  # "mandatory" | "advisory"
    resource: str | None  # the resource's name; None for the stack as a whole
    resource_type: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.resource} ({self.resource_type})" if self.resource else "stack"
        return f"[{self.enforcement}] {self.policy}: {where}: {self.message}"


def urn_of(stack: str, resource: RecordedResource) -> str:
    return f"urn:pulumi:{stack}::{PROJECT}::{resource.type}::{resource.name}"


def _property_dependencies(
    resource: RecordedResource,
    refs: Mapping[str, RecordedResource],
    by_name: Mapping[str, RecordedResource],
) -> dict[str, list[RecordedResource]]:
    """Input property -> the resources it depends on: as the SDK told the engine when the render
    recorded it (ids may be unknown in a preview), else rebuilt from the mock ids in the inputs."""
    if resource.property_dependencies is not None:
        return {
            key: [by_name[name] for name in names if name in by_name]
            for key, names in resource.property_dependencies.items()
        }
    found: dict[str, list[RecordedResource]] = {}
    for key, value in resource.inputs.items():
        deps: list[RecordedResource] = []
        for text in offline.strings(value):
            target = refs.get(text)
            if target is not None and target is not resource and all(d is not target for d in deps):
                deps.append(target)
        if deps:
            found[key] = deps
    return found


def _options(parent_urn: str | None) -> PolicyResourceOptions:
    return PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [], parent_urn)


def as_sent(value: Any) -> Any:
    """`value` as it arrives over gRPC (google.protobuf.Struct): every number a float, tuples lists."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping):
        return {key: as_sent(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_sent(item) for item in value]
    return value


def policy_resources(stack: str, resources: list[RecordedResource], *, outputs: bool) -> list[PolicyResource]:
    """PolicyResources as the engine builds them: parent, dependencies, property dependencies."""
    refs = offline.references(resources)
    by_name: dict[str, RecordedResource] = {}
    for resource in resources:
        by_name.setdefault(resource.name, resource)
    built: dict[int, PolicyResource] = {}
    for resource in resources:
        parent = by_name.get(resource.parent) if resource.parent else None
        built[id(resource)] = PolicyResource(
            resource_type=resource.type,
            props=unknown_checking_proxy(
                deserialize_properties(as_sent(dict(resource.outputs if outputs else resource.inputs)))
            ),
            urn=urn_of(stack, resource),
            name=resource.name,
            opts=_options(urn_of(stack, parent) if parent else None),
            provider=None,
            parent=None,
            dependencies=[],
            property_dependencies={},
        )
    for resource in resources:
        policy_resource = built[id(resource)]
        parent = by_name.get(resource.parent) if resource.parent else None
        policy_resource.parent = built[id(parent)] if parent else None
        seen: list[PolicyResource] = []
        for key, deps in _property_dependencies(resource, refs, by_name).items():
            policy_resource.property_dependencies[key] = [built[id(d)] for d in deps]
            seen += [built[id(d)] for d in deps if built[id(d)] not in seen]
        for name in resource.depends_on:
            target = by_name.get(name)
            if target is not None and built[id(target)] not in seen:
                seen.append(built[id(target)])
        policy_resource.dependencies = seen
    return [built[id(resource)] for resource in resources]


def _level(policy: Any, policy_config: Mapping[str, Any]) -> EnforcementLevel:
    given = policy_config.get(policy.name)
    if isinstance(given, Mapping) and "enforcementLevel" in given:
        return EnforcementLevel(given["enforcementLevel"])
    if isinstance(given, str):
        return EnforcementLevel(given)
    return policy.enforcement_level or EnforcementLevel.MANDATORY


# What pulumi_policy's analyzer reports when a policy reads a value unknown in a preview (an
# advisory in place of the policy's verdict; policy.py _PolicyAnalyzerServicer.Analyze). A Python
# pack always reports version 0.0.1 there (the CLI shows PulumiPolicy.yaml's version elsewhere).
SDK_PACK_VERSION = "0.0.1"


def cannot_run(policy: str, error: UnknownValueError) -> str:
    return (
        f"can't run policy '{policy}' from policy pack '{guard.PACK_NAME}@v{SDK_PACK_VERSION}' "
        f"during preview: {error.message}"
    )


def _run(result: Any) -> None:
    if inspect.isawaitable(result):
        asyncio.run(result)


def analyze(
    resources: list[RecordedResource],
    *,
    stack: str = "offline",
    cluster: config.ClusterConfig | None = None,
    policy_config: Mapping[str, Any] | None = None,
    policies: list[Any] | None = None,
) -> list[Violation]:
    """Every violation of the pack over `resources`; `cluster` is the stack config the policies
    judge against (None: none, as when the pack is started without PULUMI_CONFIG)."""
    policy_config = as_sent(dict(policy_config or {}))
    policies = guard.POLICIES if policies is None else policies
    violations: list[Violation] = []
    token = guard.STACK.set(cluster)
    try:
        inputs_view = policy_resources(stack, resources, outputs=False)
        outputs_view = policy_resources(stack, resources, outputs=True)
        by_urn = {r.urn: r for r in outputs_view}
        for policy in policies:
            level = _level(policy, policy_config)
            if level is EnforcementLevel.DISABLED:
                continue
            if level is EnforcementLevel.REMEDIATE:
                level = EnforcementLevel.MANDATORY
            given = policy_config.get(policy.name)
            settings = dict(given) if isinstance(given, Mapping) else {}
            if isinstance(policy, ResourceValidationPolicy):
                for resource in inputs_view:
                    args = ResourceValidationArgs(
                        resource.resource_type,
                        resource.props,
                        resource.urn,
                        resource.name,
                        resource.opts,
                        resource.provider,
                        settings,
                    )

                    def report(
                        message: str, urn: str | None = None, resource=resource, level=level, policy=policy
                    ) -> None:
                        violations.append(
                            Violation(
                                policy.name, level.value, resource.name, resource.resource_type, message
                            )
                        )

                    try:
                        _run(policy.validate(args, report))
                    except UnknownValueError as error:
                        violations.append(
                            Violation(
                                policy.name,
                                EnforcementLevel.ADVISORY.value,
                                resource.name,
                                resource.resource_type,
                                cannot_run(policy.name, error),
                            )
                        )
            elif isinstance(policy, StackValidationPolicy):
                args = StackValidationArgs(outputs_view, settings)

                def report_stack(message: str, urn: str | None = None, level=level, policy=policy) -> None:
                    target = by_urn.get(urn) if urn else None
                    violations.append(
                        Violation(
                            policy.name,
                            level.value,
                            target.name if target else None,
                            target.resource_type if target else None,
                            message,
                        )
                    )

                try:
                    _run(policy.validate(args, report_stack))
                except UnknownValueError as error:
                    violations.append(
                        Violation(
                            policy.name,
                            EnforcementLevel.ADVISORY.value,
                            None,
                            None,
                            cannot_run(policy.name, error),
                        )
                    )
    finally:
        guard.STACK.reset(token)
    return violations


def analyze_render(
    rendered: Render, *, cluster: config.ClusterConfig | None = None, **kwargs: Any
) -> list[Violation]:
    if rendered.error:
        raise ValueError(f"stack {rendered.stack} did not render: {rendered.error}")
    return analyze(rendered.resources, stack=rendered.stack, cluster=cluster, **kwargs)


def check_stack(stack: str, **kwargs: Any) -> tuple[Render, list[Violation]]:
    """Render a stack file of this project under mocks and run the pack over it."""
    rendered = render_stack(stack)
    return rendered, analyze_render(rendered, cluster=stackfile.load(stack), **kwargs)


def check_config(stack_config: dict[str, Any], stack: str = "offline", **kwargs: Any) -> list[Violation]:
    """Render a stack config (a stack file's `config:` map) and run the pack over it."""
    rendered = render(stack_config, stack)
    cluster = stackfile.validate_as_handed(stack_config)
    return analyze_render(rendered, cluster=cluster, **kwargs)


def mandatory(violations: list[Violation]) -> list[Violation]:
    return [v for v in violations if v.enforcement == EnforcementLevel.MANDATORY.value]
