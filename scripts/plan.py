"""Offline preview: render a stack under Pulumi's mocks and run the policy pack over it.

No Pulumi CLI, engine or cloud credentials. Prints the resource tree grouped by component,
counts, the port exposure in effect and the policy report; `--json` for machines;
`--diagram FILE` draws the cluster (SVG or PNG by the file's extension).
Exit codes: 0 clean (advisories allowed), 1 a mandatory policy violation, 2 an invalid config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from components import config, offline, stackfile  # noqa: E402
from components.render.diagram import diagram  # noqa: E402

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


def plan(stack: str, stack_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole report as data."""
    from policies import harness

    started = time.perf_counter()
    stack_config = stackfile.read(stack) if stack_config is None else stack_config
    try:
        cluster = config.validate(stackfile.cluster_keys(stack_config))
    except config.ConfigError as error:
        return {"stack": stack, "valid": False, "errors": error.errors}
    render = offline.render(stack_config, stack)
    if render.error:
        return {"stack": stack, "valid": False, "errors": [render.error]}
    violations = harness.analyze_render(render, cluster=cluster)
    custom = render.custom_resources
    return {
        "stack": stack,
        "valid": True,
        "target": cluster.target.value,
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
        policy = Table("level", "policy", "resource", "message", title="policy report (qwen-cluster-guard)")
        for v in report["violations"]:
            style = "red" if v["enforcement"] == "mandatory" else "yellow"
            policy.add_row(
                f"[{style}]{v['enforcement']}[/]", v["policy"], v["resource"] or "(stack)", v["message"]
            )
        console.print(policy)
    verdict = "[red]FAIL[/]" if report["mandatory"] else "[green]PASS[/]"
    console.print(
        f"{verdict} {stack}: {report['total']} resources, {report['mandatory']} mandatory and "
        f"{report['advisory']} advisory violations, rendered and checked in {report['seconds']:.2f} s"
    )


def exit_code(reports: list[dict[str, Any]]) -> int:
    if any(not r["valid"] for r in reports):
        return 2
    return 1 if any(r["mandatory"] for r in reports) else 0


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
        "--diagram",
        metavar="FILE",
        help="draw the cluster to FILE (.svg or .png); "
        "with several stacks, FILE gets the stack name inserted",
    )
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    reports = []
    for stack in args.stacks:
        try:
            reports.append(plan(stack))
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


if __name__ == "__main__":
    sys.exit(main())
