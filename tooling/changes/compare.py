"""What the engine would do to each resource, decided from two offline renders
(tooling/offline.py): create / update / replace (create-before-delete or delete-before-replace) /
delete / same, by the rules of tooling/changes/rules.py and the resource options the program set
(deleteBeforeReplace, ignoreChanges, replaceOnChanges).

How replacement ripples: when a resource is replaced its id, ARN and DNS name change, so every
input holding them changes too (in a real preview they are unknown); a launch template update
makes a new version, so an input that follows its version changes. `diff` propagates both until
nothing moves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tooling.changes.rules import UnknownResourceType, rule_for
from tooling.offline import RecordedResource, Render, references, strings

Action = Literal["create", "update", "replace", "delete", "same"]
Strategy = Literal["create-before-delete", "delete-before-replace"]


@dataclass
class Change:
    type: str
    name: str
    action: Action
    strategy: Strategy | None = None
    keys: list[str] = field(default_factory=list)
    replace_keys: list[str] = field(default_factory=list)  # the keys that force the replacement
    collision: str | None = None  # create-before-delete on a fixed identity

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ignored(key: str, ignore_changes: Iterable[str]) -> bool:
    return any(
        key == path or path.startswith(f"{key}.") or path.startswith(f"{key}[") for path in ignore_changes
    )


def _changed_keys(old: RecordedResource, new: RecordedResource) -> set[str]:
    keys = set(old.inputs) | set(new.inputs)
    return {
        key
        for key in keys
        if not key.startswith("__")
        and _normal(old.inputs.get(key)) != _normal(new.inputs.get(key))
        and not _ignored(key, new.ignore_changes)
    }


def _normal(value: Any) -> Any:
    """Numbers as the engine compares them (gRPC hands every number over as a float)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping):
        return {key: _normal(item) for key, item in value.items() if item not in (None, [], {})}
    if isinstance(value, list | tuple):
        return [_normal(item) for item in value]
    return value


def _decide(resource: RecordedResource, keys: set[str]) -> tuple[Action, list[str]]:
    rule = rule_for(resource.type)
    if rule is None:
        raise UnknownResourceType(
            f"{resource.type} ({resource.name}) has no rule in tooling/changes/rules.py RULES: "
            "add one citing the provider source before registering it"
        )
    if not keys:
        return "same", []
    forced = sorted(
        key
        for key in keys
        if rule.replaces_key(key) or any(key == path.split(".")[0] for path in resource.replace_on_changes)
    )
    if "*" in resource.replace_on_changes:
        forced = sorted(keys)
    return ("replace" if forced else "update"), forced


def _strategy(resource: RecordedResource) -> Strategy:
    rule = rule_for(resource.type)
    if resource.delete_before_replace or (rule is not None and rule.delete_before_replace):
        return "delete-before-replace"
    return "create-before-delete"


def diff(old: Render, new: Render) -> list[Change]:
    """Per custom resource of either render: what the engine would do, in the new render's
    registration order (deleted resources last)."""
    old_by = {(r.type, r.name): r for r in old.custom_resources}
    new_by = {(r.type, r.name): r for r in new.custom_resources}
    keys: dict[tuple[str, str], set[str]] = {}
    for ident, resource in new_by.items():
        if ident in old_by:
            keys[ident] = _changed_keys(old_by[ident], resource)

    # Ripples: replaced resources change their id/ARN/DNS name; updated launch templates their
    # latest version. Inputs holding those values change with them.
    marks = references(new.custom_resources)
    holders: dict[tuple[str, str], dict[tuple[str, str], set[str]]] = {}
    for ident, resource in new_by.items():
        for key, value in resource.inputs.items():
            for text in strings(value):
                if text in marks:
                    source = (marks[text].type, marks[text].name)
                    if source != ident:
                        holders.setdefault(source, {}).setdefault(ident, set()).add(key)
    decided: dict[tuple[str, str], tuple[Action, list[str]]] = {}
    changed = True
    while changed:
        changed = False
        for ident in keys:
            decided[ident] = _decide(new_by[ident], keys[ident])
        for source, dependents in holders.items():
            if source not in new_by:
                continue
            action = decided.get(source, ("create", []))[0]
            rule = rule_for(source[0])
            moves = action in ("replace", "create") or (
                action == "update" and rule is not None and rule.new_version_on_update
            )
            if not moves:
                continue
            for dependent, dependent_keys in dependents.items():
                if dependent in keys and not dependent_keys <= keys[dependent]:
                    keys[dependent] |= dependent_keys
                    changed = True

    changes: list[Change] = []
    for ident, resource in new_by.items():
        if ident not in old_by:
            changes.append(Change(resource.type, resource.name, "create"))
            continue
        action, forced = decided[ident]
        change = Change(resource.type, resource.name, action, keys=sorted(keys[ident]), replace_keys=forced)
        if action == "replace":
            change.strategy = _strategy(resource)
            if change.strategy == "create-before-delete":
                change.collision = fixed_identity(resource, new)
        changes.append(change)
    for ident, resource in old_by.items():
        if ident not in new_by:
            changes.append(Change(resource.type, resource.name, "delete"))
    return changes


def fixed_identity(resource: RecordedResource, render: Render) -> str | None:
    """What the old and the new resource could not both hold at once, if anything: a static
    private IP (EC2 answers InvalidIPAddress.InUse), a container name, a security-group rule
    (InvalidPermission.Duplicate)."""
    if resource.type == "aws:ec2/instance:Instance":
        if resource.inputs.get("privateIp"):
            return f"static IP {resource.inputs['privateIp']}"
        template = resource.inputs.get("launchTemplate") or {}
        marks = references(render.custom_resources)
        source = marks.get(str(template.get("id", "")))
        if source is not None:
            for interface in source.inputs.get("networkInterfaces") or []:
                if interface.get("privateIpAddress"):
                    return f"static IP {interface['privateIpAddress']} (launch template {source.name})"
    if resource.type == "docker:index/container:Container" and resource.inputs.get("name"):
        return f"container name {resource.inputs['name']}"
    if resource.type.startswith("aws:vpc/securityGroup") and resource.type.endswith("Rule"):
        return "the same security-group rule (InvalidPermission.Duplicate)"
    return None
