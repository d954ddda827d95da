"""Benchmarks that print figures measured in one run (`make bench`).

Each render runs in its own Python process so that its wall time and peak memory are its
own; ratios compare runs of this one invocation, never a number remembered from elsewhere.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
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


def measure_render(stack: str, count: int) -> dict[str, Any]:
    """Run in a child process: render `stack` with `count` nodes, report time and shape."""
    started = time.perf_counter()
    from tooling import offline

    imported = time.perf_counter()
    render = offline.render(scaled_stack(stack, count), stack)
    finished = time.perf_counter()
    if render.error:
        raise SystemExit(render.error)
    custom = render.custom_resources
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "nodes": count,
        "wall_s": finished - started,
        # CPU seconds (user + system): what the render costs, less what waiting for a busy
        # machine's cores adds to the wall time.
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "render_s": finished - imported,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "resources": len(render.resources),
        "custom": len(custom),
        "interfaces": sum(1 for r in custom if r.type in NETWORK_INTERFACE_TYPES),
        "sg_rules": sum(1 for r in custom if r.type in SG_RULE_TYPES),
        "critical_path": len(render.critical_path()),
    }


def measure_baremetal_chain(stack: str, count: int) -> dict[str, Any]:
    """Run in a child process: the bare-metal critical path and how much of it is the rollout
    chain, and what of the chain does work on day 0 (a drain has no `create`)."""
    from tooling import offline

    render = offline.render(scaled_stack(stack, count), stack)
    if render.error:
        raise SystemExit(render.error)
    path = render.critical_path()
    by_name = {r.name: r for r in render.custom_resources}
    chain = [name for name in path if name.endswith(("-drain", "-ready", "-model-vllm"))]
    day0 = [name for name in chain if not (name.endswith("-drain") and "create" not in by_name[name].inputs)]
    return {"nodes": count, "critical_path": len(path), "chain": len(chain), "day0_serial_steps": len(day0)}


def measure_floor() -> dict[str, Any]:
    """Run in a child process: import the SDKs and start the mocks, register nothing."""
    started = time.perf_counter()
    import pulumi
    import pulumi_aws  # noqa: F401
    import pulumi_command  # noqa: F401
    import pulumi_docker  # noqa: F401

    from tooling import offline

    pulumi.runtime.set_mocks(offline.RecordingMocks(), project="qwen-cluster", stack="floor", preview=False)
    return {
        "wall_s": time.perf_counter() - started,
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


def render_benchmarks(stack: str, counts: list[int], repeat: int = 3) -> dict[str, Any]:
    """Each size rendered `repeat` times, the fastest kept: on a machine shared with other
    work a run is only ever slowed down, so the minimum is the figure closest to the cost."""
    floor = min((child("measure_floor") for _ in range(repeat)), key=lambda run: run["wall_s"])
    runs = [
        min((child("measure_render", stack, count) for _ in range(repeat)), key=lambda run: run["wall_s"])
        for count in counts
    ]
    small, large = runs[0], runs[-1]
    per_node = (
        ((large["custom"] - large["interfaces"]) - (small["custom"] - small["interfaces"]))
        / (large["nodes"] - small["nodes"])
        if large["nodes"] != small["nodes"]
        else 0.0
    )
    return {
        "stack": stack,
        "repeat": repeat,
        "floor": floor,
        "runs": runs,
        "resources_per_node": per_node,
        "interfaces_per_node": (large["interfaces"] - small["interfaces"])
        / max(1, large["nodes"] - small["nodes"]),
        "ratio_largest_to_smallest": large["wall_s"] / small["wall_s"],
        "cpu_ratio_largest_to_smallest": large["cpu_s"] / small["cpu_s"],
        "overhead_over_floor": small["wall_s"] / floor["wall_s"],
        "sg_rules_constant": len({run["sg_rules"] for run in runs}) == 1,
        "critical_path_constant": len({run["critical_path"] for run in runs}) == 1,
    }


def lab_up_times(stack: str, counts: list[int]) -> dict[str, Any]:
    """Wall time of `lab up` (namespaces, links, every node's scripts, servers, nginx) per size."""
    from labkit import blueprint, lifecycle

    times = {}
    for count in counts:
        label = f"bench{count}"
        lifecycle.down(label)
        lab_plan = blueprint.load(stack, nodes=count, label=label)
        started = time.perf_counter()
        try:
            report = lifecycle.up(lab_plan)
            times[count] = time.perf_counter() - started
            failed = [step for step in report.steps if not step.ok]
            if failed:
                raise RuntimeError(f"lab up {count} nodes: {failed[0]}")
        finally:
            lifecycle.down(label)
    return {"seconds": times, "ratio": times[counts[-1]] / times[counts[0]]}


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{"model": "Qwen/Qwen3-32B", "messages": [{"role": "user", "content": "hello"}]}'
wrk.headers["Content-Type"] = "application/json"
"""


def _wrk_ms(text: str) -> float:
    """wrk's '1.23ms' / '850.00us' / '1.02s' in milliseconds."""
    number, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def _throughput(
    namespace: str, ip: str, port: int, *, clients: int, seconds: float, access=None
) -> dict[str, Any]:
    """wrk (C, so the load generator is not what is measured) from inside `namespace`; through
    the load balancer with the lab's key over TLS (`access`: labkit.probes.ClientAccess). wrk
    does not check the certificate; the key goes in its script file, never on its command line."""
    import tempfile

    scheme = "https" if access is not None and access.ca_file else "http"
    key_line = ""
    if access is not None and access.api_key:
        key_line = f'\nwrk.headers["Authorization"] = "Bearer {access.api_key}"\n'

    with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
        script.write(WRK_SCRIPT + key_line)
        script.flush()
        result = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                "wrk",
                "-t2",
                f"-c{clients}",
                f"-d{seconds:g}s",
                "--latency",
                "-s",
                script.name,
                f"{scheme}://{ip}:{port}/v1/chat/completions",
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
            check=True,
        )
    out = result.stdout
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: (.*)", out)
    if errors:
        raise RuntimeError(f"wrk against {ip}:{port}: {errors.group(0)}")
    return {
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50_ms": _wrk_ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1)),
        "p99_ms": _wrk_ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1)),
    }


def _first_byte(namespace: str, ip: str, port: int, samples: int, access=None) -> float:
    from labkit import netns, probes

    firsts = []
    for _ in range(samples):
        result = netns.call_in(
            namespace, probes.stream, ip, port, timeout=10.0, access=access or probes.PLAIN
        )
        if not result.ok:
            raise RuntimeError(f"stream from {ip}:{port} failed: {result.error}")
        firsts.append(result.first_event)
    return 1000 * sorted(firsts)[len(firsts) // 2]


def load_balancer_vs_direct(
    stack: str, *, token_delay: float, clients: int = 8, seconds: float = 3.0, samples: int = 30
) -> dict:
    """Through nginx vs straight to one replica, from the same node namespace (nodes may
    reach both). With token_delay 0 the stand-in answers at once, so the proxy's own cost
    is all that shows; with a delay per token the requests look more like generations."""
    from labkit import blueprint, lifecycle

    label = "benchlb"
    lifecycle.down(label)
    lab_plan = blueprint.load(stack, label=label)
    try:
        lifecycle.up(lab_plan, lifecycle.Options(token_delay=token_delay))
        lb = lab_plan.load_balancer
        access = lifecycle.client_access(lab_plan)
        source = next(node for node in lab_plan.nodes if node.ip != lb.ip)
        backend = next(head for head in lab_plan.heads if head.ip != source.ip)
        listener, model_port = lab_plan.cluster.load_balancer.port, lab_plan.cluster.model_port
        figures = {
            "from": source.node,
            "direct": {
                "to": f"{backend.node}:{model_port}",
                **_throughput(source.namespace, backend.ip, model_port, clients=clients, seconds=seconds),
                "ttfb_ms": _first_byte(source.namespace, backend.ip, model_port, samples),
            },
            "load_balancer": {
                "to": f"{lb.node}:{listener}",
                **_throughput(
                    source.namespace, lb.ip, listener, clients=clients, seconds=seconds, access=access
                ),
                "ttfb_ms": _first_byte(source.namespace, lb.ip, listener, samples, access),
            },
        }
    finally:
        lifecycle.down(label)
    figures["token_delay_ms"] = 1000 * token_delay
    figures["throughput_ratio"] = figures["load_balancer"]["rps"] / figures["direct"]["rps"]
    figures["ttfb_added_ms"] = figures["load_balancer"]["ttfb_ms"] - figures["direct"]["ttfb_ms"]
    return figures


def lab_available() -> str | None:
    """Why the lab benchmarks cannot run here, or None."""
    import os

    from labkit import netns

    if os.geteuid() != 0:
        return "not root"
    missing = netns.missing_requirements()
    if shutil.which("wrk") is None:
        missing.append("wrk is not installed (make system installs it)")
    return "; ".join(missing) if missing else None


def print_lab(console, up: dict[str, Any], lbs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    counts = list(up["seconds"])
    console.print(
        "lab up: "
        + ", ".join(f"{n} nodes {s:.2f} s" for n, s in up["seconds"].items())
        + f"; {counts[-1]}/{counts[0]}: {up['ratio']:.2f}x (target <= 2x)"
    )
    for lb in lbs:
        title = f"load balancer vs direct (wrk from {lb['from']}, stand-in {lb['token_delay_ms']:g} ms/token)"
        table = Table("path", "requests", "req/s", "p50 ms", "p99 ms", "first byte ms", title=title)
        for key in ("direct", "load_balancer"):
            row = lb[key]
            table.add_row(
                f"{key.replace('_', ' ')} ({row['to']})",
                str(row["requests"]),
                f"{row['rps']:.0f}",
                f"{row['p50_ms']:.2f}",
                f"{row['p99_ms']:.2f}",
                f"{row['ttfb_ms']:.2f}",
            )
        console.print(table)
        console.print(
            f"LB throughput / direct: {lb['throughput_ratio']:.0%} (target >= 70%); first byte through "
            f"the LB: {lb['ttfb_added_ms']:+.2f} ms (target <= +5 ms)"
        )


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
        "interfaces",
        "SG rules",
        "critical path",
        title=f"offline render of {figures['stack']} (fastest of {figures['repeat']})",
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
            str(run["interfaces"]),
            str(run["sg_rules"]),
            str(run["critical_path"]),
        )
    floor = figures["floor"]
    table.add_row(
        "floor", f"{floor['wall_s']:.2f}", "-", "-", f"{floor['peak_mb']:.0f}", "0", "0", "0", "0", "0"
    )
    console.print(table)
    runs = figures["runs"]
    console.print(
        f"{runs[-1]['nodes']}-node render / {runs[0]['nodes']}-node render: "
        f"{figures['ratio_largest_to_smallest']:.2f}x wall, "
        f"{figures['cpu_ratio_largest_to_smallest']:.2f}x CPU (target <= 5x); "
        f"{runs[0]['nodes']}-node render / floor: {figures['overhead_over_floor']:.2f}x; "
        f"resources per node besides interfaces: {figures['resources_per_node']:.2f} (target <= 6); "
        f"interfaces per node: {figures['interfaces_per_node']:.1f}; "
        f"SG rules constant: {figures['sg_rules_constant']}; "
        f"critical path constant: {figures['critical_path_constant']}"
    )


def print_chain(console, runs: list[dict[str, Any]]) -> None:
    first, last = runs[0], runs[-1]
    per_node = (last["critical_path"] - first["critical_path"]) / max(1, last["nodes"] - first["nodes"])
    console.print(
        "bare-metal rollout chain (one replica at a time): critical path "
        + " / ".join(f"{run['critical_path']} at {run['nodes']} nodes" for run in runs)
        + f" ({per_node:.1f} per added node: drain, container, health gate); on day 0 "
        + " / ".join(str(run["day0_serial_steps"]) for run in runs)
        + " of those steps do work one after another (a container start, a short SSH command;"
        " no drain, no wait for a model load)"
    )


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stack", default="prod")
    parser.add_argument("--nodes", default="4,64,256", help="node counts to render, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="renders per size; the fastest counts")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--lab-stack", default="onprem", help="the bare-metal stack the lab rehearses")
    parser.add_argument("--lab-nodes", default="4,16", help="node counts for `lab up`, comma-separated")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.nodes.split(",")]
    console = Console(width=None if sys.stdout.isatty() else 150, stderr=args.json)
    figures: dict[str, Any] = {
        "machine": machine(),
        "render": render_benchmarks(args.stack, counts, args.repeat),
    }
    lab_counts = [int(n) for n in args.lab_nodes.split(",")]
    figures["baremetal_chain"] = [child("measure_baremetal_chain", args.lab_stack, n) for n in lab_counts]
    if not args.json:
        console.print(f"machine: {figures['machine']}")
        print_render(console, figures["render"])
        print_chain(console, figures["baremetal_chain"])
    skipped = lab_available()
    if skipped:
        figures["lab"] = {"skipped": skipped}
        console.print(f"lab benchmarks skipped: {skipped} (they need root and network namespaces)")
    else:
        up = lab_up_times(args.lab_stack, [int(n) for n in args.lab_nodes.split(",")])
        # Instant answers expose the proxy's cost; 5 ms per token (8 tokens) is closer to a
        # generation, where a connection per request is noise.
        lbs = [load_balancer_vs_direct(args.lab_stack, token_delay=delay) for delay in (0.0, 0.005)]
        figures["lab"] = {"up": up, "load_balancer": lbs}
        if not args.json:
            print_lab(console, up, lbs)
    if args.json:
        print(json.dumps(figures, indent=2))
    return 0


def machine() -> str:
    import os
    import platform

    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    python = platform.python_version()
    return f"{platform.machine()}, {os.cpu_count()} cores, {memory_gb:.0f} GiB, Python {python}"
