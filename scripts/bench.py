"""Benchmarks that print figures measured in one run (`make bench`).

Each render runs in its own Python process so that its wall time and peak memory are its
own; ratios compare runs of this one invocation, never a number remembered from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SG_RULE_TYPES = (
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
)
NETWORK_INTERFACE_TYPES = (
    "aws:ec2/networkInterface:NetworkInterface",
    "aws:ec2/networkInterfaceAttachment:NetworkInterfaceAttachment",
)


def scaled_stack(stack: str, count: int) -> dict[str, Any]:
    """The stack file with `count` nodes in a /17 (AWS: the first four addresses skipped)."""
    from components import stackfile

    stack_config = stackfile.read(stack)
    cidr = stack_config["qwen-cluster:network"]["cidr"]
    first, second = cidr.split(".")[:2]
    nodes = []
    for index in range(count):
        node = {
            "name": "master" if index == 0 else f"worker-{index}",
            "ip": f"{first}.{second}.{index // 250 + 1}.{index % 250 + 4}",
        }
        if index == 0:
            node["role"] = "master"
        nodes.append(node)
    stack_config["qwen-cluster:nodes"] = nodes
    stack_config["qwen-cluster:network"] = {
        **stack_config["qwen-cluster:network"],
        "cidr": f"{first}.{second}.0.0/17",
    }
    return stack_config


def measure_render(stack: str, count: int) -> dict[str, Any]:
    """Run in a child process: render `stack` with `count` nodes, report time and shape."""
    started = time.perf_counter()
    from components import offline

    imported = time.perf_counter()
    render = offline.render(scaled_stack(stack, count), stack)
    finished = time.perf_counter()
    if render.error:
        raise SystemExit(render.error)
    custom = render.custom_resources
    return {
        "nodes": count,
        "wall_s": finished - started,
        "render_s": finished - imported,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "resources": len(render.resources),
        "custom": len(custom),
        "interfaces": sum(1 for r in custom if r.type in NETWORK_INTERFACE_TYPES),
        "sg_rules": sum(1 for r in custom if r.type in SG_RULE_TYPES),
        "critical_path": len(render.critical_path()),
    }


def measure_floor() -> dict[str, Any]:
    """Run in a child process: import the SDKs and start the mocks, register nothing."""
    started = time.perf_counter()
    import pulumi
    import pulumi_aws  # noqa: F401
    import pulumi_command  # noqa: F401
    import pulumi_docker  # noqa: F401

    from components import offline

    pulumi.runtime.set_mocks(offline.RecordingMocks(), project="qwen-cluster", stack="floor", preview=False)
    return {
        "wall_s": time.perf_counter() - started,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(function: str, *args: Any) -> dict[str, Any]:
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from scripts import bench; "
        f"print(json.dumps(bench.{function}(*{args!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{function}{args} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def render_benchmarks(stack: str, counts: list[int]) -> dict[str, Any]:
    floor = child("measure_floor")
    runs = [child("measure_render", stack, count) for count in counts]
    small, large = runs[0], runs[-1]
    per_node = (
        ((large["custom"] - large["interfaces"]) - (small["custom"] - small["interfaces"]))
        / (large["nodes"] - small["nodes"])
        if large["nodes"] != small["nodes"]
        else 0.0
    )
    return {
        "stack": stack,
        "floor": floor,
        "runs": runs,
        "resources_per_node": per_node,
        "interfaces_per_node": (large["interfaces"] - small["interfaces"])
        / max(1, large["nodes"] - small["nodes"]),
        "ratio_largest_to_smallest": large["wall_s"] / small["wall_s"],
        "overhead_over_floor": small["wall_s"] / floor["wall_s"],
        "sg_rules_constant": len({run["sg_rules"] for run in runs}) == 1,
        "critical_path_constant": len({run["critical_path"] for run in runs}) == 1,
    }


def print_render(console, figures: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        "nodes",
        "wall s",
        "render s",
        "peak MB",
        "resources",
        "custom",
        "interfaces",
        "SG rules",
        "critical path",
        title=f"offline render of {figures['stack']}",
    )
    for run in figures["runs"]:
        table.add_row(
            str(run["nodes"]),
            f"{run['wall_s']:.2f}",
            f"{run['render_s']:.2f}",
            f"{run['peak_mb']:.0f}",
            str(run["resources"]),
            str(run["custom"]),
            str(run["interfaces"]),
            str(run["sg_rules"]),
            str(run["critical_path"]),
        )
    floor = figures["floor"]
    table.add_row("floor", f"{floor['wall_s']:.2f}", "-", f"{floor['peak_mb']:.0f}", "0", "0", "0", "0", "0")
    console.print(table)
    runs = figures["runs"]
    console.print(
        f"{runs[-1]['nodes']}-node render / {runs[0]['nodes']}-node render: "
        f"{figures['ratio_largest_to_smallest']:.2f}x (target <= 5x); "
        f"{runs[0]['nodes']}-node render / floor: {figures['overhead_over_floor']:.2f}x; "
        f"resources per node besides interfaces: {figures['resources_per_node']:.2f} (target <= 6); "
        f"interfaces per node: {figures['interfaces_per_node']:.1f}; "
        f"SG rules constant: {figures['sg_rules_constant']}; "
        f"critical path constant: {figures['critical_path_constant']}"
    )


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--nodes", default="4,64,256", help="node counts to render, comma-separated")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",")]
    figures = {"machine": machine(), "render": render_benchmarks(args.stack, counts)}
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(f"machine: {figures['machine']}")
    print_render(console, figures["render"])
    return 0


def machine() -> str:
    import os
    import platform

    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    python = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores, {memory_gb:.0f} GiB, Python {python}"


if __name__ == "__main__":
    sys.exit(main())
