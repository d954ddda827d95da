"""The main job: validate every stack and print what it would build."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from components import config, offline, stackfile, summary  # noqa: E402


def print_summary(console: Console, stack: str, data: dict) -> None:
    band = data["bandwidthClass"]
    topo = data["topology"]
    console.rule(f"[bold]{stack}[/] ({data['target']})")
    console.print(
        f"bandwidth class {band['gbps']:g} Gbit/s from {band['source']}; floor "
        f"{band['floor']:g} Gbit/s; EFA {'on' if band['efa'] else 'off'}; "
        f"latency budget {data['network']['maxLatencyMs']:g} ms"
    )
    nodes = Table("node", "ip", "role", "replica head", title="nodes")
    for node in data["nodes"]:
        nodes.add_row(node["name"], node["ip"], node["role"], "yes" if node["head"] else "")
    console.print(nodes)
    table = Table("name", "port", "scope", "required", title="port table")
    for entry in data["ports"]:
        table.add_row(entry["name"], str(entry["port"]), entry["scope"], str(entry["required"]))
    console.print(table)
    exposure = Table("rule", "on", "from", "ports", title="exposure (everything else denied)")
    for rule in data["exposure"]:
        source = rule["from"] if isinstance(rule["from"], str) else ", ".join(rule["from"])
        exposure.add_row(rule["name"], rule["target"], source, f"{rule['ports']}/{rule['protocol']}")
    console.print(exposure)
    console.print(
        f"topology: {topo['replicas']} replicas x (TP {topo['tensorParallel']}, PP "
        f"{topo['pipelineParallel']}) = {topo['gpusPerReplica']} GPUs each; load balancer "
        f"targets {', '.join(topo['loadBalancerTargets'])}"
    )
    pinned = Table("Ray/vLLM port", "pinned to", title="ports pinned inside the cluster range")
    for name, span in topo["pinnedPorts"].items():
        pinned.add_row(name, span)
    console.print(pinned)


def print_resources(console: Console, stack: str) -> bool:
    """What the stack registers, rendered offline under Pulumi's mocks: counts by type."""
    result = offline.render_stack(stack)
    if result.error:
        console.print(f"[red]{stack}: {result.error}[/]")
        return False
    counts = Counter(resource.type for resource in result.custom_resources)
    table = Table("resource type", "count", title=f"{stack}: resources (offline render)")
    for type_, count in sorted(counts.items()):
        table.add_row(type_, str(count))
    console.print(table)
    components = len(result.resources) - len(result.custom_resources)
    console.print(f"{stack}: {sum(counts.values())} resources in {components} components")
    return True


def main() -> int:
    console = Console()
    failed = 0
    for stack in stackfile.STACKS:
        try:
            cluster = stackfile.load(stack)
        except config.ConfigError as error:
            console.print(f"[red]{stack}: {error}[/]")
            failed += 1
            continue
        print_summary(console, stack, summary.summary(cluster))
        if not print_resources(console, stack):
            failed += 1
    console.print(f"{len(stackfile.STACKS) - failed} of {len(stackfile.STACKS)} stacks valid")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
