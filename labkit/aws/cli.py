"""`lab.py up|check|upgrade|down|run STACK` for an AWS stack (labkit/cli.py hands these over)."""

from __future__ import annotations

import json
import time

from rich.console import Console

from labkit.aws import lab
from labkit.cluster import lifecycle
from labkit.hosts import netns


def main(args, console: Console) -> int:
    label = args.label or args.stack
    if args.command == "down":
        removed = lab.down(label)
        console.print(f"removed {len(removed)} namespaces of lab {label}")
        return 0
    missing = netns.missing_requirements()
    if missing:
        console.print("[bold red]the lab cannot run here:[/] " + "; ".join(missing))
        return 2
    if args.command == "up":
        started = time.monotonic()
        aws_plan = lab.load(args.stack, label=args.label, root=args.root)
        report, _ = lab.up(aws_plan, clock_scale=args.clock_scale or lifecycle.DEFAULT_CLOCK_SCALE)
        _print_up(report, console, label, time.monotonic() - started)
        return 0 if report.ok else 1
    if args.command == "upgrade":
        if not args.change:
            console.print("[bold red]upgrade needs at least one --change KEY=VALUE[/]")
            return 2
        result = lab.upgrade(label, args.change, max_requests=args.max_requests)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            console.print_json(json.dumps({k: v for k, v in result.items() if k != "steps"}))
        clean = result["ok"] and not result["failed"] and not result["streamsCut"]
        return 0 if clean else 1
    if args.command == "check":
        return _check(label, args, console)
    if args.command == "run":  # up, check, down (what `make lab` does)
        try:
            started = time.monotonic()
            report, _ = lab.up(
                lab.load(args.stack, label=args.label, root=args.root),
                clock_scale=args.clock_scale or lifecycle.DEFAULT_CLOCK_SCALE,
            )
            _print_up(report, console, label, time.monotonic() - started)
            return _check(label, args, console) if report.ok else 1
        finally:
            removed = lab.down(label)
            console.print(f"removed {len(removed)} namespaces of lab {label}")
    console.print(f"[bold red]lab {args.command} is not built for AWS stacks[/]")
    return 2


def _check(label: str, args, console: Console) -> int:
    from labkit.aws import check
    from labkit.cluster import report as lab_report

    aws_plan, results = check.run(label)
    if args.json:
        print(lab_report.json_text(aws_plan.plan, results))
    else:
        lab_report.print_results(console, results, verbose=args.verbose)
    lab_report.print_summary(console, results)
    return 0 if all(result.ok for result in results) else 1


def _print_up(report: lab.AwsUp, console: Console, label: str, seconds: float) -> None:
    for note in report.notes:
        console.print(f"[dim]lab: {note}[/]")
    for step in report.steps:
        if step.op == "same":
            continue
        mark = "[green]ok[/]" if step.ok else "[bold red]FAILED[/]"
        console.print(
            f"{mark} {step.resource or step.step} ({step.step} on {step.node}) {step.seconds:.1f} s"
        )
        if not step.ok:
            console.print(step.detail[-1500:])
    console.print(f"lab {label}: {'up' if report.ok else 'FAILED'} in {seconds:.1f} s")
