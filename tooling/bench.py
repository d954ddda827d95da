"""The render benchmarks of `make bench`: figures measured in one run (the lab's are in
labkit/bench.py, which runs both; scripts/bench.py).

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
    from tooling import stackfile

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
    stack_config = stackfile.with_nodes(stack_config, nodes)
    stack_config["qwen-cluster:network"] = {
        **stack_config["qwen-cluster:network"],
        "cidr": f"{first}.{second}.0.0/17",
    }
    return stack_config


def measure_render(stack: str, count: int, speedup: bool = True) -> dict[str, Any]:
    """Run in a child process: render `stack` with `count` nodes, report time and shape;
    `speedup`: with tooling/sdk_speedup.py (what the offline tools use), or with the SDK's own
    dependency search (what `pulumi up` runs).

    Wall and CPU (`time.process_time`: this process's user + system time, what the render
    costs, less what waiting for a busy machine's cores adds to the wall time) from before the
    imports to the end of the render; the critical paths after the clock stops."""
    started, started_cpu = time.perf_counter(), time.process_time()
    from tooling import changes, offline

    imported = time.perf_counter()
    render = offline.render(scaled_stack(stack, count), stack, speedup=speedup)
    finished, finished_cpu = time.perf_counter(), time.process_time()
    if render.error:
        raise SystemExit(render.error)
    custom = render.custom_resources
    by_name = {r.name: r for r in custom}
    day0 = render.critical_path()
    day0_waits = render.critical_path(changes.waits_on_create)
    day2 = render.critical_path(changes.is_health_gate)
    return {
        "nodes": count,
        "speedup": speedup,
        "wall_s": finished - started,
        "cpu_s": finished_cpu - started_cpu,
        "render_s": finished - imported,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "resources": len(render.resources),
        "custom": len(custom),
        "edges": sum(len(waits_for) for waits_for in render.dependencies().values()),
        "interfaces": sum(1 for r in custom if r.type in NETWORK_INTERFACE_TYPES),
        "sg_rules": sum(1 for r in custom if r.type in SG_RULE_TYPES),
        # Day 0: everything is created; the longest chain of creations, and the most creations
        # that wait for a model to load one after another. Day 2: a change that restarts every
        # model server passes every health gate; the most gates one after another.
        "day0_path": len(day0),
        "day0_waits": sum(1 for name in day0_waits if changes.waits_on_create(by_name[name])),
        "day2_gates": sum(1 for name in day2 if changes.is_health_gate(by_name[name])),
        "day2_path": len(day2),
    }


def measure_floor() -> dict[str, Any]:
    """Run in a child process: import the SDKs and start the mocks, register nothing."""
    started, started_cpu = time.perf_counter(), time.process_time()
    import pulumi
    import pulumi_aws  # noqa: F401
    import pulumi_command  # noqa: F401
    import pulumi_docker  # noqa: F401

    from tooling import offline

    pulumi.runtime.set_mocks(offline.RecordingMocks(), project="qwen-cluster", stack="floor", preview=False)
    return {
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - started_cpu,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(function: str, *args: Any) -> dict[str, Any]:
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from tooling import bench; "
        f"print(json.dumps(bench.{function}(*{args!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{function}{args} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def render_benchmarks(stack: str, counts: list[int], repeat: int = 3, speedup: bool = True) -> dict[str, Any]:
    """Each size rendered `repeat` times, the run with the least CPU kept (its wall beside it):
    on a machine shared with other work a run is only ever slowed down, so the minimum is the
    figure closest to the cost."""
    floor = min((child("measure_floor") for _ in range(repeat)), key=lambda run: run["cpu_s"])
    runs = [
        min(
            (child("measure_render", stack, count, speedup) for _ in range(repeat)),
            key=lambda run: run["cpu_s"],
        )
        for count in counts
    ]
    for run in runs:
        # Network interfaces apart: each EFA instance kind brings its own number per node.
        run["per_node"] = (run["custom"] - run["interfaces"]) / run["nodes"]
        run["edges_per_node"] = run["edges"] / run["nodes"]
    for before, after in zip(runs, runs[1:], strict=False):
        added = after["nodes"] - before["nodes"]
        after["added_per_node"] = (
            (after["custom"] - after["interfaces"]) - (before["custom"] - before["interfaces"])
        ) / added
        after["edges_added_per_node"] = (after["edges"] - before["edges"]) / added
    small, large = runs[0], runs[-1]
    by_nodes = {run["nodes"]: run for run in runs}
    figures: dict[str, Any] = {
        "stack": stack,
        "speedup": speedup,
        "repeat": repeat,
        "floor": floor,
        "runs": runs,
        "interfaces_per_node": (large["interfaces"] - small["interfaces"])
        / max(1, large["nodes"] - small["nodes"]),
        "ratio_largest_to_smallest": large["wall_s"] / small["wall_s"],
        "cpu_ratio_largest_to_smallest": large["cpu_s"] / small["cpu_s"],
        "overhead_over_floor": small["wall_s"] / floor["wall_s"],
        "sg_rules_constant": len({run["sg_rules"] for run in runs}) == 1,
        "day0_path_constant": len({run["day0_path"] for run in runs}) == 1,
        "added_per_node_constant": len({run["added_per_node"] for run in runs[1:]}) <= 1,
        "edges_added_per_node_constant": len({run["edges_added_per_node"] for run in runs[1:]}) <= 1,
    }
    if 64 in by_nodes and 256 in by_nodes:
        figures["ratio_256_to_64"] = by_nodes[256]["wall_s"] / by_nodes[64]["wall_s"]
        figures["cpu_ratio_256_to_64"] = by_nodes[256]["cpu_s"] / by_nodes[64]["cpu_s"]
    return figures


RATIO_TARGET = 4.5  # a 256-node render takes at most about 4.5x a 64-node one


def print_render(console, figures: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        "nodes",
        "wall s",
        "CPU s",
        "render s",
        "peak MB",
        "resources",
        "custom",
        "per node",
        "added per node",
        "edges",
        "edges per node",
        "edges added per node",
        "day-0 path",
        "day-0 waits",
        "day-2 gates",
        title=f"offline render of {figures['stack']} (least CPU of {figures['repeat']}; "
        + (
            "with tooling/sdk_speedup.py)"
            if figures.get("speedup", True)
            else "the SDK's own search, as `pulumi up`)"
        ),
    )
    for run in figures["runs"]:
        table.add_row(
            str(run["nodes"]),
            f"{run['wall_s']:.2f}",
            f"{run['cpu_s']:.2f}",
            f"{run['render_s']:.2f}",
            f"{run['peak_mb']:.0f}",
            str(run["resources"]),
            str(run["custom"]),
            f"{run['per_node']:.2f}",
            f"{run['added_per_node']:.2f}" if "added_per_node" in run else "-",
            str(run["edges"]),
            f"{run['edges_per_node']:.2f}",
            f"{run['edges_added_per_node']:.2f}" if "edges_added_per_node" in run else "-",
            str(run["day0_path"]),
            str(run["day0_waits"]),
            str(run["day2_gates"]),
        )
    floor = figures["floor"]
    floor_row = [f"{floor['wall_s']:.2f}", f"{floor['cpu_s']:.2f}", "-", f"{floor['peak_mb']:.0f}"]
    table.add_row("floor", *floor_row, *["-"] * 10)
    console.print(table)
    runs = figures["runs"]
    if "ratio_256_to_64" in figures:
        verdict = "met" if figures["cpu_ratio_256_to_64"] <= RATIO_TARGET else "MISSED"
        console.print(
            f"256-node render / 64-node render: {figures['ratio_256_to_64']:.2f}x wall, "
            f"{figures['cpu_ratio_256_to_64']:.2f}x CPU (target <= {RATIO_TARGET}x: {verdict})"
        )
    console.print(
        f"{runs[-1]['nodes']}-node render / {runs[0]['nodes']}-node render: "
        f"{figures['ratio_largest_to_smallest']:.2f}x wall, "
        f"{figures['cpu_ratio_largest_to_smallest']:.2f}x CPU; "
        f"{runs[0]['nodes']}-node render / floor: {figures['overhead_over_floor']:.2f}x; "
        f"resources added per node constant: {figures['added_per_node_constant']}; "
        f"dependency edges added per node constant: {figures['edges_added_per_node_constant']}; "
        f"interfaces per node: {figures['interfaces_per_node']:.1f}; "
        f"SG rules constant: {figures['sg_rules_constant']}"
    )
    sizes = " / ".join(str(run["nodes"]) for run in runs)
    console.print(
        f"critical paths (longest dependency chains) at {sizes} nodes: day 0 "
        + " / ".join(str(run["day0_path"]) for run in runs)
        + f" resources (the same at every size: {figures['day0_path_constant']}) and "
        + " / ".join(str(run["day0_waits"]) for run in runs)
        + " creations that wait for a model load, one after another; day 2 "
        + " / ".join(str(run["day2_gates"]) for run in runs)
        + " health gates one after another"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The render benchmarks' options (labkit/bench.py adds the lab's)."""
    parser.add_argument("--stacks", default="onprem,prod", help="stacks to render, comma-separated")
    parser.add_argument("--nodes", default="4,64,256", help="node counts to render, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="renders per size; the least CPU counts")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--without-speedup",
        action="store_true",
        help="render with the SDK's own dependency search, as `pulumi up` runs (tooling/sdk_speedup.py off)",
    )


def run(args: argparse.Namespace, console) -> dict[str, Any]:
    """The render figures of every stack of `args`, printed as they come unless --json."""
    counts = [int(n) for n in args.nodes.split(",")]
    figures: dict[str, Any] = {"machine": machine(), "render": {}}
    if not args.json:
        console.print(f"machine: {figures['machine']}")
    for stack in args.stacks.split(","):
        figures["render"][stack] = render_benchmarks(stack, counts, args.repeat, not args.without_speedup)
        if not args.json:
            print_render(console, figures["render"][stack])
    return figures


def machine() -> str:
    import os
    import platform

    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    python = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores, {memory_gb:.0f} GiB, Python {python}"
