"""The lab: rehearse a stack's cluster network in Linux network namespaces (root).

scripts/lab.py up STACK [--nodes N] [--real-model] [--change KEY=VALUE ...]
                                          apply the program to the lab (day 0, or what changed);
                                          --real-model: the real vLLM serves (labkit/models/realvllm.py);
                                          --change: the stack with changes, as plan.py takes them
scripts/lab.py check STACK [--json]       verify + probes; exit 1 on any failure (on the lab as
                                          it is: a lab knows its own node count)
scripts/lab.py upgrade STACK --change KEY=VALUE [...] [--json] [--probe-matrix] [--nodes N]
                                          apply a change under client load; exit 1 on a
                                          failed step, request or cut stream (--nodes: a lab
                                          that is not up is brought up with N nodes first)
scripts/lab.py down STACK                 remove everything the lab made (also after a crash)
scripts/lab.py run STACK                  up, check, down (what `make lab` does)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from labkit.cluster import blueprint, check, lifecycle, report, upgrade
from labkit.engine import executor
from labkit.hosts import netns
from labkit.models import realvllm
from qwen_cluster.config import ConfigError
from tooling.changes import edit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab.py", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("up", "check", "upgrade", "down", "run"))
    parser.add_argument("stack", help="a stack name (Pulumi.<stack>.yaml)")
    parser.add_argument("--json", action="store_true", help="check results as JSON on stdout")
    parser.add_argument("--nodes", type=int, help="override the node count (rehearse a bigger cluster)")
    parser.add_argument("--label", help="name the lab's namespaces qcl-<label>-* (default: the stack name)")
    parser.add_argument("--root", type=Path, default=None, help="directory holding Pulumi.<stack>.yaml")
    parser.add_argument("--verbose", action="store_true", help="show every port probe")
    parser.add_argument(
        "--strict-bandwidth",
        action="store_true",
        help="fail (not warn) when a lab link is below minBandwidthGbps",
    )
    parser.add_argument(
        "--clock-scale",
        type=float,
        default=None,
        help=f"lab clock for timeouts and the thinking pause (1 = real time; default "
        f"{lifecycle.DEFAULT_CLOCK_SCALE:g}, with --real-model {realvllm.REAL_MODEL_CLOCK:g})",
    )
    parser.add_argument(
        "--real-model",
        action="store_true",
        help="run the real vLLM (CPU build, tiny Qwen3 model) as every replica's model server",
    )
    parser.add_argument(
        "--change",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="up, run: bring up the stack with this change; upgrade: apply it under load "
        "(as scripts/plan.py --change; repeatable)",
    )
    parser.add_argument(
        "--probe-matrix",
        action="store_true",
        help="upgrade: sweep the probes that must stay closed while the change applies",
    )
    parser.add_argument(
        "--max-requests", type=int, default=upgrade.LoadSettings.max_requests, help="upgrade: client load cap"
    )
    parser.add_argument(
        "--model-load-seconds",
        type=float,
        default=lifecycle.MODEL_LOAD_SECONDS,
        help="the stand-in model's load time before /health answers (on the lab clock)",
    )
    args = parser.parse_args(argv)
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 150)
    default_clock = realvllm.REAL_MODEL_CLOCK if args.real_model else lifecycle.DEFAULT_CLOCK_SCALE
    clock = args.clock_scale or default_clock
    options = lifecycle.Options(
        clock_scale=clock, model_load_seconds=args.model_load_seconds, real_model=args.real_model
    )

    if _is_aws(args):  # the AWS target: nodes run user data and SSM documents (labkit/aws/)
        from labkit.aws import cli as aws_cli

        return aws_cli.main(args, console)
    if args.command == "down":
        removed = lifecycle.down(args.label or args.stack)
        console.print(f"removed {len(removed)} namespaces of lab {args.label or args.stack}")
        return 0
    if args.command == "upgrade":
        return _upgrade(args, console, options)
    try:
        lab_plan = lab_plan_for(
            args.stack,
            label=args.label,
            nodes=args.nodes,
            root=args.root,
            as_applied=args.command == "check",
            changes=args.change if args.command in ("up", "run") else (),
        )
    except lifecycle.SizeError as error:
        console.print(f"[bold red]{error}[/]")
        return 2
    except (ConfigError, blueprint.PlanError, FileNotFoundError, edit.ChangeSyntaxError) as error:
        console.print(f"[bold red]lab {args.stack}: nothing built[/]\n{error}")
        return 2
    missing = netns.missing_requirements()
    if missing:
        console.print("[bold red]the lab cannot run here:[/] " + "; ".join(missing))
        return 2

    status = 0
    try:
        if args.command in ("up", "run"):
            report.print_plan(console, lab_plan)
            up_report = lifecycle.up(lab_plan, options)
            report.print_up(console, up_report)
            if not up_report.ok:
                status = 1
        if args.command in ("check", "run") and status == 0:
            results = check.run(lab_plan, options, strict_bandwidth=args.strict_bandwidth)
            if args.json:
                print(report.json_text(lab_plan, results))
            else:
                report.print_results(console, results, verbose=args.verbose)
            report.print_summary(console, results)
            status = 0 if all(result.ok for result in results) else 1
    finally:
        if args.command == "run":
            removed = lifecycle.down(lab_plan.label)
            console.print(f"removed {len(removed)} namespaces of lab {lab_plan.label}")
    return status


def lab_plan_for(
    stack: str,
    *,
    label: str | None = None,
    nodes: int | None = None,
    root: Path | None = None,
    as_applied: bool = False,
    changes: list[str] | tuple[str, ...] = (),
) -> blueprint.LabPlan:
    """The plan of the lab `label` (default: the stack's name): the stack file at the node count
    the lab was brought up with (lifecycle.nodes_for; `nodes` for a lab not up yet), or with
    `as_applied` the config the lab last applied (what `check` probes: the lab as it runs, as
    `doctor --lab` reads it). SizeError when `nodes` differs from a lab that is up."""
    count = lifecycle.nodes_for(label or stack, nodes)
    lab_plan = blueprint.load(stack, nodes=count, label=label, root=root, changes=changes)
    state = executor.load_state(lifecycle.state_file(lab_plan)) if as_applied else None
    return lifecycle.plan_from_config(state.config, lab_plan.label) if state is not None else lab_plan


def _is_aws(args) -> bool:
    from labkit.aws import lab as aws_lab

    try:
        return aws_lab.is_aws(args.stack, args.root)
    except FileNotFoundError:
        return False


def _upgrade(args, console: Console, options: lifecycle.Options) -> int:
    if not args.change:
        console.print("[bold red]upgrade needs at least one --change KEY=VALUE[/]")
        return 2
    missing = netns.missing_requirements()
    if missing:
        console.print("[bold red]the lab cannot run here:[/] " + "; ".join(missing))
        return 2
    if args.nodes is not None:
        status = _up_for_upgrade(args, console, options)
        if status:
            return status
    load = upgrade.LoadSettings(max_requests=args.max_requests)
    if options.real_model:
        load = upgrade.real_model_load(args.max_requests)
    try:
        result = upgrade.run(
            args.label or args.stack, args.change, options, load=load, probe_matrix=args.probe_matrix
        )
    except (upgrade.UpgradeError, ConfigError, executor.ExecutorError) as error:
        console.print(f"[bold red]lab upgrade {args.stack}: nothing applied[/]\n{error}")
        return 2
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        report.print_upgrade(console, result)
    clean = result.ok and not result.failed and not result.streams_cut
    return 0 if clean else 1


def _up_for_upgrade(args, console: Console, options: lifecycle.Options) -> int:
    """`upgrade --nodes N`: the lab with N nodes, brought up first when it is not up; a lab that
    is up with another node count is refused (the change would be applied to a different
    cluster than asked for)."""
    label = args.label or args.stack
    try:
        lifecycle.nodes_for(label, args.nodes)
    except lifecycle.SizeError as error:
        console.print(f"[bold red]{error}[/]")
        return 2
    if lifecycle.state_file_for(label).exists():
        return 0  # up with that many nodes already
    try:
        lab_plan = blueprint.load(args.stack, nodes=args.nodes, label=args.label, root=args.root)
    except (ConfigError, blueprint.PlanError, FileNotFoundError) as error:
        console.print(f"[bold red]lab {args.stack}: nothing built[/]\n{error}")
        return 2
    up_report = lifecycle.up(lab_plan, options)
    if not up_report.ok:
        report.print_up(console, up_report)
        return 1
    console.print(f"lab {label} up with {args.nodes} nodes")
    return 0
