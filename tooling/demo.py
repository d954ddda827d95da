"""The offline half of the main job (`make demo`): the preview of every stack (validated config,
topology, resources, policy report, diagram in out/). labkit/demo.py runs it, then the lab
rehearsal of onprem where this machine allows it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import graphviz
from rich.console import Console
from rich.table import Table

from qwen_cluster import config, summary
from tooling import preview, stackfile
from tooling.diagram import diagram

OUT = Path(__file__).resolve().parent.parent / "out"


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
    console.print(
        f"topology: {topo['replicas']} replicas x (TP {topo['tensorParallel']}, PP "
        f"{topo['pipelineParallel']}) = {topo['gpusPerReplica']} GPUs each; load balancer "
        f"targets {', '.join(topo['loadBalancerTargets'])}"
    )
    pinned = Table("Ray/vLLM port", "pinned to", title="ports pinned inside the cluster range")
    for name, span in topo["pinnedPorts"].items():
        pinned.add_row(name, span)
    console.print(pinned)


def preview_stacks(console: Console) -> tuple[int, str]:
    """Every stack previewed offline and drawn in OUT: the exit code (tooling/preview.py
    exit_code) and a line saying how many stacks are clean."""
    OUT.mkdir(exist_ok=True)
    reports = []
    for stack in stackfile.STACKS:
        # An invalid stack gets no summary; the plan report below lists every problem.
        with contextlib.suppress(config.ConfigError):
            print_summary(console, stack, summary.summary(stackfile.load(stack)))
        report = preview.plan(stack)
        if report["valid"]:
            drawn = diagram(stackfile.load(stack), title=f"qwen-cluster {stack}")
            try:
                report["diagram"] = drawn.render(OUT / stack, format="svg", cleanup=True)
            except graphviz.ExecutableNotFound:
                console.print("[yellow]diagram skipped: graphviz's dot is not installed (make system)[/]")
        preview.print_report(console, report)
        if report.get("diagram"):
            console.print(f"diagram: {report['diagram']}")
        reports.append(report)
    passed = sum(1 for r in reports if r["valid"] and not r["mandatory"])
    console.rule("offline preview")
    console.print(f"{passed} of {len(reports)} stacks valid and free of mandatory policy violations")
    return preview.exit_code(reports), f"{passed}/{len(reports)} stacks clean"
