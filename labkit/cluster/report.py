"""Check results for people (rich tables, one line of summary) and for machines (JSON)."""

from __future__ import annotations

import json
from itertools import groupby

from rich.console import Console
from rich.table import Table

from labkit.cluster.blueprint import LabPlan
from labkit.cluster.check import Result, as_json, summary
from labkit.cluster.lifecycle import UpReport

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def print_plan(console: Console, plan: LabPlan) -> None:
    table = Table("namespace", "address", "what", title=f"lab {plan.label}")
    table.add_row(plan.switch, "-", f"bridge {len(plan.members)} ports")
    for member in plan.nodes:
        roles = [
            "master" if member.node == plan.cluster.master.name else "worker",
            *(["replica head"] if member in plan.heads else []),
            *(["nginx"] if member == plan.load_balancer else []),
        ]
        table.add_row(member.namespace, f"{member.ip}/{member.prefixlen}", ", ".join(roles))
    for member in plan.vantages:
        table.add_row(member.namespace, member.ip, member.vantage.value)
    console.print(table)
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/]")


def print_up(console: Console, report: UpReport) -> None:
    """What ran, in the order it finished: the lab's machines, then the program's resources."""
    for note in report.notes:
        console.print(f"[dim]lab substitution: {note}[/]")
    table = Table("at s", "node", "step", "op", "result", "last line", title="apply")
    for step in report.steps:
        if step.op == "same":
            continue
        last = step.detail.strip().splitlines()[-1] if step.detail.strip() else ""
        result = "[green]ok[/]" if step.ok else "[bold red]FAILED[/]"
        table.add_row(f"{step.started:.2f}", step.node, step.step, step.op, result, last[:90])
    console.print(table)


def print_upgrade(console: Console, result) -> None:
    """An upgrade rehearsal: what ran, then what the clients saw."""
    for note in result.notes:
        console.print(f"[dim]lab substitution: {note}[/]")
    table = Table("at s", "node", "resource", "op", "s", "result", title="upgrade: what ran")
    for step in result.steps:
        mark = "[green]ok[/]" if step.ok else f"[bold red]FAILED[/] {step.detail.strip()[-80:]}"
        table.add_row(f"{step.started:.2f}", step.node, step.resource, step.op, f"{step.seconds:.2f}", mark)
    console.print(table)
    down = f" ({', '.join(result.down_at_max)})" if result.down_at_max else ""
    console.print(
        f"requests {result.requests}, failed {result.failed}, streams cut {result.streams_cut}, "
        f"most replicas down at once {result.max_replicas_down}{down}, {result.seconds:.1f} s"
    )
    if result.probe_sweeps is not None:
        console.print(
            f"probe matrix: {result.probe_sweeps} sweeps, "
            f"{len(result.opened)} must-be-closed ports seen open {result.opened or ''}"
        )
    for failure in result.failures[:10]:
        console.print(f"[red]  {failure}[/]")
    if result.images:
        console.print("images now: " + ", ".join(f"{n} {i}" for n, i in sorted(result.images.items())))
    for where in result.stopped_at:
        console.print(f"[bold red]stopped at {where}[/]")
    if result.stopped_at:
        console.print(
            "replicas not reached (still on what they ran): " + (", ".join(result.not_reached) or "none")
        )
        console.print("replicas left out of the load balancer: " + (", ".join(result.left_out) or "none"))


def print_results(console: Console, results: list[Result], *, verbose: bool = False) -> None:
    """One table per group; port probes that passed are folded into a count per vantage."""
    for group, rows in groupby(results, key=lambda result: result.group):
        rows = list(rows)
        shown = rows if verbose or group != "ports" else [row for row in rows if row.status != "pass"]
        table = Table("from", "to", "what", "expected", "observed", "", title=group)
        for row in shown:
            mark = f"[{STYLE[row.status]}]{row.status}[/]"
            table.add_row(row.source, row.target, row.what, row.expected, row.observed, mark)
        if group == "ports" and not verbose:
            for source, by_source in groupby(rows, key=lambda result: result.source):
                by_source = list(by_source)
                opened = sum(1 for row in by_source if row.status == "pass" and row.observed == "open")
                closed = sum(1 for row in by_source if row.status == "pass" and row.observed != "open")
                table.add_row(
                    source,
                    "all targets",
                    f"{len(by_source)} probes",
                    "per port table",
                    f"{opened} open, {closed} closed as promised",
                    "[green]pass[/]",
                )
        console.print(table)


def print_summary(console: Console, results: list[Result]) -> None:
    line = summary(results)
    console.print(f"[{'green' if line.startswith('GREEN') else 'bold red'}]{line}[/]")


def json_text(plan: LabPlan, results: list[Result]) -> str:
    return json.dumps(as_json(plan, results), indent=2)
