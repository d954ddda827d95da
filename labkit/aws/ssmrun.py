"""SSM State Manager as the lab runs it: an association's targets, its rate controls, and one
`aws:runShellScript` document run on each target, reported as SSM reports it.

What SSM does, and where it says so:
- Parameters: `{{ Name }}` in a document is replaced by the association's value, or the
  parameter's default; a value outside its `allowedPattern` makes the association invalid
  (InvalidParameters), a `{{ Name }}` the document does not declare makes the document invalid
  (InvalidDocumentContent) (SSM User Guide, "Data elements and parameters").
- aws:runShellScript: the agent writes `runCommand` (one line each) to `_script.sh` and runs
  `sh -c <that file>` as root, so the file's `#!` line picks the shell (amazon-ssm-agent
  agent/plugins/runscript/runshellscript.go: shellCommand "sh", shellArgs ["-c"];
  runscript.go runCommands). Exit 0 is Success, anything else Failed; past `timeoutSeconds`
  the command is killed and reported TimedOut (pluginutil GetStatus).
- Targets: `InstanceIds` names instances; `tag:Key` matches instances carrying the tag with one
  of the values; several targets must all hold.
- Rate controls: at most `maxConcurrency` targets at once (a count, or a percentage of the
  targets, rounded up, at least one); once more than `maxErrors` targets failed, no new target
  starts (those running finish) and the association's run is Failed ("Using targets and rate
  controls", SSM User Guide).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from labkit.aws.model import Association, Instance

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z0-9_.:/-]+)\s*\}\}")
SUCCESS, FAILED, TIMED_OUT = "Success", "Failed", "TimedOut"


class DocumentError(ValueError):
    """What SSM refuses before any target runs (invalid document or parameters)."""


@dataclass(frozen=True)
class Step:
    action: str
    name: str
    lines: list[str]
    timeout_seconds: int


@dataclass
class Invocation:
    """One document run on one instance, as `list-command-invocations` would show it."""

    instance: str  # node name
    instance_id: str
    status: str
    exit_code: int
    output: str
    seconds: float = 0.0


@dataclass
class AssociationRun:
    association: str
    document: str
    status: str
    invocations: list[Invocation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # targets never started (maxErrors reached)
    detail: str = ""


def steps(document: dict[str, Any], parameters: dict[str, str]) -> list[Step]:
    """The document's steps with every `{{ Name }}` replaced as SSM replaces it."""
    declared: dict[str, dict[str, Any]] = document.get("parameters") or {}
    values = {}
    for name, spec in declared.items():
        value = parameters.get(name, spec.get("default"))
        if value is None:
            raise DocumentError(f"InvalidParameters: {name} has no value and no default")
        pattern = spec.get("allowedPattern")
        if pattern and not re.search(pattern, str(value)):
            raise DocumentError(f"InvalidParameters: {name}={str(value)[:60]!r} does not match {pattern}")
        values[name] = str(value)
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        raise DocumentError(f"InvalidParameters: the document declares no {', '.join(unknown)}")

    def fill(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in values:
                raise DocumentError(f"InvalidDocumentContent: {{{{ {name} }}}} is not a declared parameter")
            return values[name]

        return _PLACEHOLDER.sub(one, text)

    found = []
    for step in document.get("mainSteps") or []:
        if step.get("action") != "aws:runShellScript":
            raise DocumentError(
                f"step {step.get('name')}: action {step.get('action')} is not modelled by the lab"
            )
        inputs = step.get("inputs") or {}
        lines = inputs.get("runCommand") or []
        lines = lines if isinstance(lines, list) else [lines]
        found.append(
            Step(
                action=step["action"],
                name=str(step.get("name")),
                lines=[fill(str(line)) for line in lines],
                timeout_seconds=int(fill(str(inputs.get("timeoutSeconds", "3600")))),
            )
        )
    return found


def targets(association: Association, instances: dict[str, Instance]) -> list[Instance]:
    """The instances an association's targets select, in node order."""
    chosen = list(instances.values())
    for target in association.targets:
        key, wanted = str(target.get("key")), [str(v) for v in target.get("values") or []]
        if key == "InstanceIds":
            chosen = [i for i in chosen if i.instance_id in wanted]
        elif key.startswith("tag:"):
            tag = key[len("tag:") :]
            chosen = [i for i in chosen if i.tags.get(tag) in wanted]
        else:
            raise DocumentError(f"{association.resource}: target key {key} is not modelled by the lab")
    return chosen


def rate(value: str, count: int, *, errors: bool = False) -> int:
    """maxConcurrency / maxErrors as a number of targets."""
    value = value.strip() or ("0" if errors else "1")
    if value.endswith("%"):
        share = math.ceil(count * float(value[:-1]) / 100)
        return share if errors else max(1, share)
    return int(value)


# (instance, steps) -> (status, exit code, output)
Runner = Callable[[Instance, list[Step]], tuple[str, int, str]]


def run(
    association: Association,
    document: dict[str, Any],
    instances: dict[str, Instance],
    runner: Runner,
) -> AssociationRun:
    """Apply an association once: its document on every target within its rate controls."""
    result = AssociationRun(association.resource, association.document, SUCCESS)
    try:
        planned = steps(document, association.parameters)
    except DocumentError as error:
        result.status, result.detail = FAILED, str(error)
        return result
    chosen = targets(association, instances)
    if not chosen:
        result.status, result.detail = FAILED, "no instance matches the targets"
        return result
    concurrency = rate(association.max_concurrency, len(chosen))
    max_errors = rate(association.max_errors, len(chosen), errors=True)
    pending = list(chosen)
    failed = 0
    running: dict[Future, tuple[Instance, float]] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        while pending or running:
            while pending and len(running) < concurrency and failed <= max_errors:
                instance = pending.pop(0)
                running[pool.submit(runner, instance, planned)] = (instance, time.monotonic())
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                instance, started = running.pop(future)
                try:
                    status, code, output = future.result()
                except Exception as error:  # the lab's own failure: reported, never hidden
                    status, code, output = FAILED, -1, f"lab: {error}"
                result.invocations.append(
                    Invocation(
                        instance.node, instance.instance_id, status, code, output, time.monotonic() - started
                    )
                )
                if status != SUCCESS:
                    failed += 1
    result.skipped = [instance.node for instance in pending]
    if failed or result.skipped:
        result.status = FAILED
        worst = next(i for i in result.invocations if i.status != SUCCESS) if failed else None
        result.detail = f"{failed} of {len(chosen)} targets failed (maxErrors {association.max_errors})" + (
            f"; {worst.instance}: {worst.status} exit {worst.exit_code}" if worst else ""
        )
    return result
