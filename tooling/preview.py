"""Offline preview: render a stack under Pulumi's mocks and run the policy pack over it.

No Pulumi CLI, engine or cloud credentials. Prints the resource tree grouped by component,
counts, the port exposure in effect and the policy report; `--json` for machines;
`--diagram FILE` draws the cluster (SVG or PNG by the file's extension).
Exit codes: 0 clean (advisories allowed), 1 a mandatory policy violation or a deploy the hosts
would stop (`--deploy-from ADDRESS` outside access.adminCidrs: no lock-out), 2 an invalid config.
The pack runs with the policy config CI passes to `pulumi preview` (policies/config.json,
tooling/policy_harness.POLICY_CONFIG): its thresholds are CI's, not a second set of defaults.

Change plan (Day 2): `plan.py STACK --change KEY=VALUE [--change ...]` renders the stack as it
is and with the changes applied (KEY a dotted path as in the stack file, VALUE JSON or a plain
string; `nodes` takes the whole list); `plan.py STACK --against GIT_REF` renders the program
and stack file at GIT_REF and the working tree. Both print per resource create / update /
replace (create-before-delete or delete-before-replace) / delete / same with the input keys
that changed, then the rollout (tooling/changes/). Exit codes: 0 the endpoint stays up,
3 every replica out at once, the endpoint replaced or a replacement that would collide,
1 a mandatory policy violation in the new render, 2 an invalid config or change.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from qwen_cluster import config
from qwen_cluster.render import firewall
from tooling import changes, offline, stackfile
from tooling.diagram import diagram

# Security-group rules: protocol, ports, the peer and why.
_RULE = (
    "ipProtocol",
    "fromPort",
    "toPort",
    "cidrIpv4",
    "cidrIpv6",
    "referencedSecurityGroupId",
    "description",
)
# The properties worth a reviewer's eye, per resource type (camelCase input paths).
KEY_PROPERTIES: dict[str, tuple[str, ...]] = {
    "aws:ec2/vpc:Vpc": ("cidrBlock",),
    "aws:ec2/subnet:Subnet": ("cidrBlock", "availabilityZone", "mapPublicIpOnLaunch"),
    "aws:ec2/instance:Instance": ("instanceType", "privateIp", "availabilityZone", "placementGroup"),
    "aws:ec2/launchTemplate:LaunchTemplate": (
        "instanceType",
        "networkInterfaces",
        "placement.groupName",
        "metadataOptions.httpTokens",
    ),
    "aws:ec2/placementGroup:PlacementGroup": ("strategy",),
    "aws:ec2/networkInterface:NetworkInterface": ("privateIps", "interfaceType"),
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": _RULE,
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": (*_RULE, "prefixListId"),
    "aws:lb/loadBalancer:LoadBalancer": ("loadBalancerType", "internal"),
    "aws:lb/listener:Listener": ("port", "protocol", "tcpIdleTimeoutSeconds"),
    "aws:lb/targetGroup:TargetGroup": ("port", "protocol", "healthCheck.path", "deregistrationDelay"),
    "aws:lb/targetGroupAttachment:TargetGroupAttachment": ("targetId", "port"),
    "command:remote:Command": ("connection.host",),
    "docker:index/container:Container": ("image", "networkMode", "ipcMode"),
    "docker:index/remoteImage:RemoteImage": ("name",),
}


def _lookup(props: dict[str, Any], path: str) -> Any:
    value: Any = props
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _brief(value: Any) -> str:
    if isinstance(value, list):
        return f"[{len(value)}]" if value and isinstance(value[0], dict) else ",".join(map(str, value))
    if isinstance(value, dict):
        return "{…}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # the engine hands numbers over as floats
    return str(value)


def resource_rows(render: offline.Render) -> list[dict[str, Any]]:
    """Custom resources grouped by the component that owns them (the nearest parent)."""
    components = {r.name: r.type for r in render.resources if not r.custom}
    rows = []
    for resource in render.custom_resources:
        owner = resource.parent if resource.parent in components else None
        shown = {}
        for path in KEY_PROPERTIES.get(resource.type, ()):
            value = _lookup(resource.inputs, path)
            if value not in (None, "", [], {}):
                shown[path] = _brief(value)
        rows.append(
            {
                "component": f"{components[owner]} {owner}" if owner else "(stack)",
                "type": resource.type,
                "name": resource.name,
                "properties": shown,
            }
        )
    return rows


def plan(
    stack: str, stack_config: dict[str, Any] | None = None, *, deploy_from: str | None = None
) -> dict[str, Any]:
    """The whole report as data. `deploy_from`: the deploying machine's address as the hosts see
    it (bare metal: checked against what each host's new firewall admits to SSH)."""
    from tooling import policy_harness

    started = time.perf_counter()
    stack_config = stackfile.read(stack) if stack_config is None else stack_config
    try:
        cluster = stackfile.validate_as_handed(stack_config)
    except config.ConfigError as error:
        return {"stack": stack, "valid": False, "errors": error.errors}
    render = offline.render(stack_config, stack)
    if render.error:
        return {"stack": stack, "valid": False, "errors": [render.error]}
    violations = policy_harness.analyze_render(
        render, cluster=cluster, policy_config=policy_harness.read_policy_config()
    )
    custom = render.custom_resources
    lockout = firewall.lockout_notices(cluster, deploy_from)
    return {
        "stack": stack,
        "valid": True,
        # Said before anything runs: a deploy the hosts will stop (certain) or may stop.
        "deploy": [{"message": n.message, "certain": n.certain} for n in lockout],
        "target": cluster.target.value,
        "policyConfig": str(policy_harness.POLICY_CONFIG.relative_to(stackfile.PROJECT_ROOT)),
        # The secrets rendered with the offline tools' throwaway values: said, not hidden.
        "placeholders": stackfile.offline_placeholders(stack_config),
        "resources": resource_rows(render),
        "counts": dict(sorted(Counter(r.type for r in custom).items())),
        "total": len(custom),
        "components": sum(1 for r in render.resources if not r.custom),
        "exposure": [
            {
                "name": rule.name,
                "on": rule.target.value,
                "from": list(rule.cidrs) if rule.cidrs else rule.peer.value,
                "ports": "all" if rule.ports is None else str(rule.ports),
                "protocol": rule.protocol,
            }
            for rule in cluster.exposures()
        ],
        "violations": [
            {"policy": v.policy, "enforcement": v.enforcement, "resource": v.resource, "message": v.message}
            for v in violations
        ],
        "mandatory": sum(1 for v in violations if v.enforcement == "mandatory"),
        "advisory": sum(1 for v in violations if v.enforcement == "advisory"),
        "outputs": render.outputs,
        "seconds": round(time.perf_counter() - started, 3),
    }


# --- change plan ------------------------------------------------------------------------------

_RENDER_AT = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
from tooling import offline
result = offline.render_stack(sys.argv[2])
print(json.dumps({
    "resources": [dataclasses.asdict(r) for r in result.resources],
    "outputs": result.outputs,
    "error": result.error,
}, default=str))
"""


def render_at(ref: str, stack: str) -> offline.Render:
    """The program and stack file at a git ref, rendered in a separate interpreter (its own
    `qwen_cluster` package), read back as a Render."""
    root = stackfile.PROJECT_ROOT
    with tempfile.TemporaryDirectory(prefix="qcl-plan-") as tree:
        archive = subprocess.run(["git", "-C", str(root), "archive", ref], capture_output=True, check=False)
        if archive.returncode:
            raise ValueError(f"--against {ref}: {archive.stderr.decode().strip() or 'git archive failed'}")
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        done = subprocess.run(
            [sys.executable, "-c", _RENDER_AT, tree, stack], capture_output=True, text=True, cwd=tree
        )
        if done.returncode:
            raise ValueError(f"--against {ref}: rendering {stack} failed: {done.stderr.strip()[-2000:]}")
    data = json.loads(done.stdout)
    known = {f.name for f in dataclasses.fields(offline.RecordedResource)}
    resources = [
        offline.RecordedResource(**{k: v for k, v in r.items() if k in known}) for r in data["resources"]
    ]
    return offline.Render(stack, resources, data["outputs"], [], data["error"])


def change_plan(
    stack: str, *, change_texts: list[str] | None = None, against: str | None = None
) -> dict[str, Any]:
    """The change plan as data (what `--json` prints)."""
    from tooling import policy_harness

    started = time.perf_counter()
    report: dict[str, Any] = {"stack": stack, "changes_requested": change_texts or [], "against": against}
    try:
        if against:
            old = render_at(against, stack)
            new_config = stackfile.read(stack)
        else:
            old = offline.render_stack(stack)
            new_config = changes.apply_changes(stackfile.read(stack), change_texts or [])
        cluster = stackfile.validate_as_handed(new_config)
    except (config.ConfigError, changes.ChangeSyntaxError, ValueError) as error:
        errors = error.errors if isinstance(error, config.ConfigError) else [str(error)]
        return {**report, "valid": False, "errors": errors, "exit": 2}
    if old.error:
        return {**report, "valid": False, "errors": [f"the stack as it is: {old.error}"], "exit": 2}
    new = offline.render(new_config, stack)
    if new.error:
        return {**report, "valid": False, "errors": [new.error], "exit": 2}
    found = changes.diff(old, new)
    summary = changes.rollout(old, new, found)
    violations = policy_harness.analyze_render(
        new, cluster=cluster, policy_config=policy_harness.read_policy_config()
    )
    mandatory = [v for v in violations if v.enforcement == "mandatory"]
    code = changes.verdict(summary)
    if code == 0 and mandatory:
        code = 1
    notes = []
    gpu_instances_created = [
        c.name for c in found if c.action == "create" and c.type == "aws:ec2/instance:Instance"
    ]
    if cluster.aws and not cluster.aws.ami_id and gpu_instances_created and old.custom_resources:
        notes.append(
            f"aws.amiId is not set: {', '.join(gpu_instances_created)} will launch from the newest "
            "DLAMI of that day while the running nodes keep theirs; pin aws.amiId to keep them alike"
        )
    return {
        **report,
        "valid": True,
        "changes": [change.as_dict() for change in found],
        "counts": dict(Counter(change.action for change in found)),
        "rollout": summary.as_dict(),
        "lanes": summary.lanes_dict(),
        "ami": new.outputs.get("ami"),
        "notes": notes,
        "violations": [
            {"policy": v.policy, "enforcement": v.enforcement, "resource": v.resource, "message": v.message}
            for v in mandatory
        ],
        "seconds": round(time.perf_counter() - started, 3),
        "exit": code,
    }


def print_change_plan(console, report: dict[str, Any]) -> None:
    from rich.table import Table

    what = ", ".join(report["changes_requested"]) or f"against {report['against']}"
    if not report["valid"]:
        console.print(f"[bold red]{report['stack']}: {what}: invalid[/]")
        for error in report["errors"]:
            console.print(f"  - {error}")
        return
    table = Table("action", "strategy", "type", "name", "keys", title=f"{report['stack']}: {what}")
    styles = {"create": "green", "update": "yellow", "replace": "red", "delete": "red"}
    for change in report["changes"]:
        if change["action"] == "same":
            continue
        style = styles[change["action"]]
        keys = ", ".join(change["keys"])
        if change.get("collision"):
            keys += f" [bold red](collides: {change['collision']})[/]"
        table.add_row(
            f"[{style}]{change['action']}[/]", change["strategy"] or "", change["type"], change["name"], keys
        )
    console.print(table)
    counts = ", ".join(f"{n} {action}" for action, n in sorted(report["counts"].items()))
    console.print(f"resources: {counts}")
    rollout = report["rollout"]
    steps = " -> ".join("+".join(step) for step in rollout["steps"]) or "none"
    console.print(
        f"rollout: {rollout['replicas']} replicas; nodes replaced: "
        f"{', '.join(rollout['nodesReplaced']) or 'none'}; model servers restarted: "
        f"{', '.join(rollout['serversRestarted']) or 'none'}; replicas drained: "
        f"{', '.join(rollout['replicasDrained']) or 'none'}; at most "
        f"{rollout['maxReplicasOutOfService']} replica(s) out of service at once; steps: {steps}"
    )
    lanes = report["lanes"]
    if lanes["lanes"]:
        console.print(
            f"lanes ({len(lanes['lanes'])}, at most {lanes['mostOutOfServiceAtOnce']} replica(s) out at "
            "once): " + "; ".join(" -> ".join(lane) for lane in lanes["lanes"])
        )
        console.print(
            "staged first: "
            + (", ".join(lanes["stagedFirst"]) or "nothing")
            + f"; at most {_duration(lanes['atMostSeconds'])} after staging (the longest lane x "
            f"{lanes['replicaBoundSeconds']} s per replica: its drain and health timeouts, on AWS more; "
            "docs/ci.md says how to size the `up` workflow from it)"
        )
    if rollout["endpointChanges"]:
        console.print(f"[red]endpoint replaced or deleted: {', '.join(rollout['endpointChanges'])}[/]")
    for collision in rollout["collisions"]:
        console.print(f"[red]collision: {collision}[/]")
    if report.get("ami"):
        ami = report["ami"]
        console.print(f"AMI: {', '.join(sorted(set(ami['ids'].values())))} ({ami['source']})")
    for note in report["notes"]:
        console.print(f"[yellow]note: {note}[/]")
    for violation in report["violations"]:
        console.print(f"[red]mandatory {violation['policy']}: {violation['message']}[/]")
    verdict = {
        0: "[green]endpoint stays up[/]",
        1: "[red]policy violation[/]",
        3: "[red]OUTAGE or collision[/]",
    }
    console.print(f"{verdict[report['exit']]} (planned in {report['seconds']:.2f} s)")


def print_report(console, report: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.tree import Tree

    stack = report["stack"]
    if not report["valid"]:
        console.print(f"[bold red]{stack}: invalid config[/]")
        for error in report["errors"]:
            console.print(f"  - {error}")
        return
    tree = Tree(
        f"[bold]{stack}[/] ({report['target']}): {report['total']} resources in "
        f"{report['components']} components"
    )
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in report["resources"]:
        grouped[row["component"]].append(row)
    for component, rows in grouped.items():
        branch = tree.add(f"[cyan]{component}[/] ({len(rows)})")
        for row in rows:
            props = "  ".join(f"{k}={v}" for k, v in row["properties"].items())
            branch.add(f"{row['type'].split(':')[-1]} [bold]{row['name']}[/] {props}")
    console.print(tree)
    counts = Table("type", "count", title="resource counts")
    for type_, count in report["counts"].items():
        counts.add_row(type_, str(count))
    console.print(counts)
    exposure = Table("rule", "on", "from", "ports", title="port exposure in effect (everything else denied)")
    for rule in report["exposure"]:
        source = rule["from"] if isinstance(rule["from"], str) else ", ".join(rule["from"])
        exposure.add_row(rule["name"], rule["on"], source, f"{rule['ports']}/{rule['protocol']}")
    console.print(exposure)
    if report["violations"]:
        policy = Table(
            "level",
            "policy",
            "resource",
            "message",
            title=f"policy report (qwen-cluster-guard, {report['policyConfig']})",
        )
        for v in report["violations"]:
            style = "red" if v["enforcement"] == "mandatory" else "yellow"
            policy.add_row(
                f"[{style}]{v['enforcement']}[/]", v["policy"], v["resource"] or "(stack)", v["message"]
            )
        console.print(policy)
    if report.get("placeholders"):
        console.print(
            f"offline placeholders for {', '.join(report['placeholders'])}: the stack file holds none, or "
            "ciphertext nothing here decrypts; `pulumi preview` and `up` use the stack's own and refuse a "
            "stack without them (set each with `pulumi config set --secret`)"
        )
    for notice in report.get("deploy", []):
        level = "[red]will stop[/]" if notice["certain"] else "[yellow]may stop[/]"
        console.print(f"deploy {level}: {notice['message']}")
    verdict = "[red]FAIL[/]" if report["mandatory"] or _stops(report) else "[green]PASS[/]"
    console.print(
        f"{verdict} {stack}: {report['total']} resources, {report['mandatory']} mandatory and "
        f"{report['advisory']} advisory violations, rendered and checked in {report['seconds']:.2f} s"
    )


def _stops(report: dict[str, Any]) -> bool:
    return any(notice["certain"] for notice in report.get("deploy", []))


def exit_code(reports: list[dict[str, Any]]) -> int:
    """2 an invalid config; 1 a mandatory violation, or a deploy the hosts will stop."""
    if any(not r["valid"] for r in reports):
        return 2
    return 1 if any(r["mandatory"] or _stops(r) for r in reports) else 0


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "stacks",
        nargs="*",
        default=list(stackfile.STACKS),
        help=f"stacks to preview (default: {' '.join(stackfile.STACKS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument(
        "--deploy-from",
        metavar="ADDRESS",
        help="the address your SSH reaches the hosts from (bare metal): checked against what each "
        "host's new firewall admits (access.adminCidrs); with bareMetal.bastion, its address is",
    )
    parser.add_argument(
        "--change",
        action="append",
        metavar="KEY=VALUE",
        help="plan a change to one stack (repeatable): KEY dotted as in the stack file, VALUE JSON or text",
    )
    parser.add_argument(
        "--against",
        metavar="GIT_REF",
        help="plan the working tree against the program and stack file at GIT_REF",
    )
    parser.add_argument(
        "--diagram",
        metavar="FILE",
        help="draw the cluster to FILE (.svg or .png); "
        "with several stacks, FILE gets the stack name inserted",
    )
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.deploy_from:
        try:
            ipaddress.ip_address(args.deploy_from)
        except ValueError:
            console.print(f"[red]--deploy-from {args.deploy_from!r} is not an IP address[/]")
            return 2
    if args.change or args.against:
        if len(args.stacks) != 1:
            console.print(
                "[red]--change and --against plan one stack: name it (e.g. plan.py dev --change ...)[/]"
            )
            return 2
        try:
            report = change_plan(args.stacks[0], change_texts=args.change, against=args.against)
        except FileNotFoundError as error:
            console.print(f"[red]{error}[/]")
            return 2
        if args.json:
            print(json.dumps(report, indent=2, default=str))
        else:
            print_change_plan(console, report)
        return report["exit"]
    reports = []
    for stack in args.stacks:
        try:
            reports.append(plan(stack, deploy_from=args.deploy_from))
        except FileNotFoundError as error:
            console.print(f"[red]{error}[/]")
            return 2
        if args.diagram and reports[-1]["valid"]:
            target = Path(args.diagram)
            if len(args.stacks) > 1:
                target = target.with_name(f"{target.stem}-{stack}{target.suffix}")
            fmt = target.suffix.lstrip(".") or "svg"
            drawn = diagram(stackfile.load(stack), title=f"qwen-cluster {stack}")
            path = drawn.render(target.with_suffix(""), format=fmt, cleanup=True)
            reports[-1]["diagram"] = path
    if args.json:
        print(json.dumps(reports, indent=2, default=str))
    else:
        for report in reports:
            print_report(console, report)
            if report.get("diagram"):
                console.print(f"diagram: {report['diagram']}")
    return exit_code(reports)


def _duration(seconds: int) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"
