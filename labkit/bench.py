"""`make bench`: the render benchmarks (tooling/bench.py) and the lab's: `lab up` per size, the
load balancer against a replica reached directly (wrk), the lane rehearsal under client load,
the real vLLM (CPU) through an image bump, the AWS node side (labkit/aws/), the routing benchmark and
prefill/decode over NIXL (labkit/cluster/pdlab.py).
Figures measured in one run; the lab's need root and network namespaces."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from labkit.cluster import blueprint, check, lifecycle, probes, upgrade
from labkit.hosts import netns
from tooling import bench as render_bench


def lab_up_times(stack: str, counts: list[int]) -> dict[str, Any]:
    """Wall time of `lab up` (namespaces, links, every node's scripts, servers, nginx) per size."""

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


# The lane rehearsal: an image bump, a release that never becomes healthy (the stand-in for an
# image tagged -unhealthy, labkit/models/modelserver.py), then a good release, in that order.
LANE_CHANGES = (
    ("image bump", ["model.image=vllm/vllm-openai:v0.33.1"]),
    ("never healthy", ["model.image=vllm/vllm-openai:v0.33.2-unhealthy", "rollout.healthTimeoutSeconds=60"]),
    ("next good change", ["model.image=vllm/vllm-openai:v0.33.2", "rollout.healthTimeoutSeconds=300"]),
)


def lab_lanes(stack: str, count: int, max_requests: int = 1200) -> list[dict[str, Any]]:
    """`lab.py upgrade --nodes count` of LANE_CHANGES under client load: requests, failed, the
    most replicas down at once, where a rollout stopped."""

    label = f"lanes{count}"
    lifecycle.down(label)
    runs = []
    try:
        report = lifecycle.up(blueprint.load(stack, nodes=count, label=label))
        if not report.ok:
            raise RuntimeError(f"lab up {count} nodes: {next(s for s in report.steps if not s.ok)}")
        for name, change in LANE_CHANGES:
            result = upgrade.run(
                label, change, lifecycle.Options(), load=upgrade.LoadSettings(max_requests=max_requests)
            )
            runs.append(
                {
                    "rehearsal": name,
                    "ok": result.ok,
                    "requests": result.requests,
                    "failed": result.failed,
                    "streamsCut": result.streams_cut,
                    "maxReplicasDown": result.max_replicas_down,
                    "seconds": round(result.seconds, 1),
                    "lanes": len(result.lanes),
                    "stoppedAt": result.stopped_at,
                    "replicasNotReached": len(result.not_reached),
                }
            )
    finally:
        lifecycle.down(label)
    return runs


def print_lanes(console, count: int, runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(
        "rehearsal",
        "ok",
        "requests",
        "failed",
        "cut",
        "most down",
        "s",
        "stopped at",
        "not reached",
        title=f"lab.py upgrade at {count} nodes ({runs[0]['lanes'] if runs else '?'} lanes)",
    )
    for run in runs:
        table.add_row(
            run["rehearsal"],
            str(run["ok"]),
            *(str(run[key]) for key in ("requests", "failed", "streamsCut", "maxReplicasDown")),
            f"{run['seconds']:.1f}",
            str(len(run["stoppedAt"])),
            str(run["replicasNotReached"]),
        )
    console.print(table)


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
    the load balancer with the lab's key over TLS (`access`: labkit.cluster.probes.ClientAccess). wrk
    does not check the certificate; the key goes in its script file, never on its command line."""
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


def lab_real_model(stack: str, count: int = 4, max_requests: int = 120) -> dict[str, Any]:
    """The 4-node real-vLLM rehearsal (`lab.py up --real-model`, then an image bump under client
    load): lab up, every replica's restart to healthy in the bump (the longest stretch its
    /health did not answer 200, asked from the load-balancer node every 0.2 s: stop, start,
    load), requests, failed, streams cut, the most replicas down at once."""
    import threading

    from labkit.models import realvllm
    from qwen_cluster.render.vllm import HEALTH_PATH

    label = f"real{count}"
    lifecycle.down(label)
    options = lifecycle.Options(clock_scale=realvllm.REAL_MODEL_CLOCK, real_model=True)
    try:
        started = time.monotonic()
        plan = blueprint.load(stack, nodes=count, label=label)
        report = lifecycle.up(plan, options)
        if not report.ok:
            raise RuntimeError(f"lab up {count} nodes: {next(s for s in report.steps if not s.ok)}")
        figures: dict[str, Any] = {"nodes": count, "upSeconds": round(time.monotonic() - started, 1)}
        serving = next((s for s in report.steps if s.step == "serving"), None)
        figures["firstHealthy"] = serving.detail if serving else ""
        lb, port = plan.load_balancer.namespace, plan.cluster.model_port
        down_since: dict[str, float] = {}
        longest: dict[str, float] = {head.node: 0.0 for head in plan.heads}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                now = time.monotonic()
                for head in plan.heads:
                    status = probes.get(head.ip, port, HEALTH_PATH, timeout=1).status
                    if status == 200:
                        if head.node in down_since:
                            longest[head.node] = max(longest[head.node], now - down_since.pop(head.node))
                    else:
                        down_since.setdefault(head.node, now)
                stop.wait(0.2)

        watcher = threading.Thread(target=netns.call_in, args=(lb, watch), daemon=True)
        watcher.start()
        try:
            bump = ["model.image=vllm/vllm-openai:v0.33.1"]
            result = upgrade.run(label, bump, options, load=upgrade.real_model_load(max_requests))
        finally:
            stop.set()
            watcher.join(timeout=30)
        figures.update(
            {
                "ok": result.ok,
                "requests": result.requests,
                "failed": result.failed,
                "streamsCut": result.streams_cut,
                "maxReplicasDown": result.max_replicas_down,
                "seconds": round(result.seconds, 1),
                "restartToHealthy": {node: round(value, 1) for node, value in longest.items()},
                "stoppedAt": result.stopped_at,
            }
        )
        return figures
    finally:
        lifecycle.down(label)


def print_real_model(console, figures: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        "replica",
        "restart to healthy (s)",
        title=(
            f"real vLLM (CPU), {figures['nodes']} nodes: lab up {figures['upSeconds']} s "
            f"({figures['firstHealthy']}); image bump under load: {figures['requests']} requests, "
            f"{figures['failed']} failed, {figures['streamsCut']} streams cut, most down at once "
            f"{figures['maxReplicasDown']}, {figures['seconds']} s, ok {figures['ok']}"
        ),
    )
    for node, seconds in figures["restartToHealthy"].items():
        table.add_row(node, f"{seconds:.1f}")
    console.print(table)


def aws_rehearsal(stack: str = "prod", max_requests: int = 3000) -> dict[str, Any]:
    """The AWS target's node side (labkit/aws/): `lab up` of the stack (every node's first boot
    and SSM associations, weights from the lab bucket when the stack reads S3), then an image
    bump in rollout.maxUnavailable lanes under client load, a node added under load, a release
    that never gets healthy; `down` after."""
    from labkit.aws import lab as aws_lab
    from tooling import stackfile

    label = f"bench-{stack}"
    aws_lab.down(label)
    try:
        started = time.monotonic()
        report, _ = aws_lab.up(aws_lab.load(stack, label=label))
        up_seconds = time.monotonic() - started
        if not report.ok:
            failed = next(step for step in report.steps if not step.ok)
            raise RuntimeError(f"aws lab up {stack}: {failed.resource}: {failed.detail[-300:]}")
        bump = aws_lab.upgrade(label, ["model.image=vllm/vllm-openai:v0.33.1"], max_requests=max_requests)
        keep = ("requests", "failed", "streamsCut", "maxReplicasDown", "seconds", "ok", "lanes")
        figures = {
            "stack": stack,
            "upSeconds": round(up_seconds, 1),
            "associations": len(report.runs),
            "imageBump": {key: bump[key] for key in keep},
            "everyDocumentOnEveryNode": bump["ssm"]["everyDocumentOnEveryNode"],
        }
        # A node added (nodes +1): it boots, gets its associations, registers and serves.
        nodes = stackfile.read(stack)["qwen-cluster:nodes"]
        last = max(ipaddress.ip_address(node["ip"]) for node in nodes)
        nodes = [*nodes, {"name": f"worker-{len(nodes)}", "ip": str(last + 1)}]
        added = aws_lab.upgrade(label, [f"nodes={json.dumps(nodes)}"], max_requests=max_requests)
        figures["nodeAdded"] = {
            **{key: added[key] for key in keep},
            "nodesAdded": added["nodesAdded"],
            "preparedSeconds": added["prepared"]["seconds"],
            "everyDocumentOnEveryNode": added["ssm"]["everyDocumentOnEveryNode"],
        }
        # A release that never answers /health: its lane stops, the others keep serving. With the
        # lanes' 60 s health timeout: the stack's own (prod: 1800 s) is never on the lab clock, and
        # the bench would wait it out in full.
        never = aws_lab.upgrade(label, dict(LANE_CHANGES)["never healthy"], max_requests=max_requests)
        figures["neverHealthy"] = {
            **{key: never[key] for key in keep},
            "stoppedAt": never["stoppedAt"],
            "replicasNotReached": never["replicasNotReached"],
        }
        return figures
    finally:
        aws_lab.down(label)


# Where the endpoint form of the routing benchmark finds the API key.
ROUTING_KEY_VARIABLE = "QWEN_CLUSTER_API_KEY"


def routing(args: argparse.Namespace, console) -> dict[str, Any]:
    """The routing benchmark: the router's own cost per policy at 2, 8 and 16 stand-in workers
    (labkit/cluster/routerhop.py, `routerHopMs`), then the workloads on real vLLM replicas
    (labkit/cluster/routinglab.py) unless --routing-hop-only; runs logged as they end."""
    from labkit.cluster import routerhop, routinglab

    log = lambda line: console.print(line, highlight=False)  # noqa: E731
    reports = Path(args.routing_reports) if args.routing_reports else None
    if reports:
        reports.mkdir(parents=True, exist_ok=True)
    if args.routing_endpoint:
        # Any endpoint, a user's own cluster: its key from the environment, its CA, and the
        # replicas' /metrics where they can be read (docs/routing.md, "Measure your own cluster").
        figures = routinglab.benchmark_endpoint(
            args.routing_endpoint,
            api_key=os.environ.get(ROUTING_KEY_VARIABLE),
            ca_file=args.routing_ca,
            metrics_urls=[url for url in (args.routing_metrics or "").split(",") if url],
            rounds=args.routing_rounds,
            workloads=args.routing_workloads.split(","),
            tools=tuple(args.routing_tools.split(",")),
            tokenizer=args.routing_tokenizer,
            reports=reports,
            log=log,
        )
        return figures
    hop = routerhop.measure(log=log)
    if args.routing_hop_only:
        figures = {"routerHopMs": hop["routerHopMs"], "routerHop": hop}
        if not args.json:
            print_router_hop(console, hop)
        return figures
    where = args.routing_where or "lab"
    if where == "lab":
        figures = routinglab.benchmark_in_lab(
            args.lab_stack, args.routing_rounds, args.routing_workloads.split(","), log=log
        )
    else:
        figures = routinglab.benchmark(
            args.routing_rounds,
            args.routing_workloads.split(","),
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            tool=args.routing_tools.split(",")[0],
            reports=reports,
            log=log,
        )
    figures = {**figures, "routerHopMs": hop["routerHopMs"], "routerHop": hop}
    if not args.json:
        print_router_hop(console, hop)
        print_routing(console, figures)
    return figures


def print_router_hop(console, hop: dict[str, Any]) -> None:
    from rich.table import Table

    counts = sorted({count for by_count in hop["detail"].values() for count in by_count}, key=int)
    table = Table(
        "policy",
        *(f"{count} workers: hop ms (direct / routed p50)" for count in counts),
        title=f"the router's own cost: {hop['setup']['where']}; {hop['setup']['client']}",
    )
    for policy, by_count in hop["detail"].items():
        table.add_row(
            policy,
            *(
                f"{by_count[c]['hopMs']} ({by_count[c]['directP50Ms']} / {by_count[c]['routedP50Ms']})"
                for c in counts
            ),
        )
    console.print(table)


def print_routing(console, figures: dict[str, Any]) -> None:
    from rich.table import Table

    setup = figures["setup"]
    table = Table(
        "workload",
        "policy",
        "requests",
        "errors",
        "hit rate",
        "TTFT p50 s",
        "TTFT p90 s",
        "out tok/s",
        "busiest/mean",
        title=(
            f"routing: {setup['where']}; KV {setup['kvTokensPerReplica']} tokens per replica; "
            f"thresholds {setup['balanceAbsThreshold']}/{setup['balanceRelThreshold']}; "
            f"median of {setup['rounds']}"
        ),
    )
    for name, by_policy in figures["workloads"].items():
        for policy, row in by_policy.items():
            table.add_row(
                name,
                policy,
                *(str(row[key]) for key in ("requests", "errors", "prefixCacheHitRate", "ttftP50Seconds")),
                *(
                    str(row[key])
                    for key in ("ttftP90Seconds", "outputTokensPerSecond", "busiestReplicaRatio")
                ),
            )
    console.print(table)
    for line in figures["goals"]:
        console.print(f"  {line}", highlight=False)


def pd(args: argparse.Namespace, console) -> dict[str, Any]:
    """The prefill/decode rehearsal over NIXL (labkit/cluster/pdlab.py), its steps logged as they end."""
    from labkit.cluster import pdlab

    log = lambda line: console.print(line, highlight=False)  # noqa: E731
    figures = pdlab.benchmark(requests=args.pd_requests, log=log)
    if not args.json:
        print_pd(console, figures)
    return figures


# The committed stack made disaggregated on two lab nodes: the prefill pool the master, the decode
# pool the worker (docs/disaggregation.md, "The whole stack in the lab").
PD_STACK_CHANGES = (
    "serving.mode=disaggregated",
    'serving.prefill={"nodes":["master"]}',
    'serving.decode={"nodes":["worker-1"]}',
    "bareMetal.gpuModel=H100",
)


PD_COUNTERS = (
    "prompt_tokens_total",
    "nixl_bytes_transferred_sum",
    "nixl_bytes_transferred_count",
    "nixl_num_failed_transfers_total",
    "external_prefix_cache_hits_total",
    "request_success_total",
)


def _pd_counters(plan, pools: dict[str, str]) -> dict[str, dict[str, float]]:
    """What each node's vLLM counted (PD_COUNTERS), asked on the node itself."""
    from labkit.cluster import pdlab

    figures = {}
    port = plan.cluster.model_port
    for name in pools:
        node = plan.node(name)
        page = netns.call_in(node.namespace, probes.get, node.ip, port, "/metrics", timeout=60)
        counted = pdlab.samples(page.body.decode()) if page.ok else {}
        figures[name] = {key: counted.get(f"vllm:{key}", 0.0) for key in PD_COUNTERS}
    return figures


def _wait_router_serving(plan, deadline_seconds: float = 600) -> None:
    """Until vLLM's router answers its /health: it starts serving once its own health checks
    passed (measured: ~20 s after every replica's /health), and until then nginx's backup, the
    decode pool alone, serves each request whole (no KV crosses)."""
    from qwen_cluster.render import router

    address, router_port = router.api_address(plan.cluster)
    deadline = time.monotonic() + deadline_seconds
    while True:
        reply = netns.call_in(
            plan.load_balancer.namespace, lambda: probes.get(address, router_port, "/health", timeout=5)
        )
        if reply.status == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router at {address}:{router_port} never answered /health with 200")
        time.sleep(1)  # polling a process that starts at its own speed; bounded by the deadline


def pd_stack(stack: str, requests: int, log, *, kill_requests: int = 6) -> dict[str, Any]:
    """`lab.py up STACK --nodes 2 --real-model --change <PD_STACK_CHANGES>`, then `requests` chat
    completions of fresh ~900-token prompts from the client vantage through the endpoint (nginx,
    TLS, the key, the router in P/D mode): each one's status and seconds, and what each node's vLLM
    counted of NIXL (bytes and transfers, failures, external prefix-cache hits). Then the prefill
    node's vLLM killed under client load (prefill_killed_under_load)."""
    import random

    from labkit.cluster import pdlab
    from labkit.models import realvllm
    from qwen_cluster.ports import Vantage

    label = "pdstack"
    lifecycle.down(label)
    options = lifecycle.Options(clock_scale=realvllm.REAL_MODEL_CLOCK, real_model=True)
    plan = blueprint.load(stack, nodes=2, label=label, changes=PD_STACK_CHANGES)
    pools = {name: plan.cluster.serving.pool_of(name) for name in ("master", "worker-1")}
    try:
        started = time.monotonic()
        report = lifecycle.up(plan, options)
        if not report.ok:
            raise RuntimeError(f"lab up: {next(s for s in report.steps if not s.ok)}")
        figures: dict[str, Any] = {"stack": stack, "changes": list(PD_STACK_CHANGES)}
        figures["upSeconds"] = round(time.monotonic() - started, 1)
        log(f"pd stack: up in {figures['upSeconds']} s")
        _wait_router_serving(plan)
        figures["routerReadyAfterUpSeconds"] = round(time.monotonic() - started - figures["upSeconds"], 1)
        log(f"pd stack: the router serves {figures['routerReadyAfterUpSeconds']} s after up")
        access = lifecycle.client_access(plan)
        lb, port = plan.load_balancer.ip, plan.cluster.load_balancer.port
        rng = random.Random(7)
        answers = []
        before = _pd_counters(plan, pools)
        for index in range(requests):
            text = pdlab.prompt(rng, 1000)
            sent = time.monotonic()
            reply = netns.call_in(
                plan.vantage(Vantage.CLIENT).namespace,
                lambda text=text: probes.chat(
                    lb, port, text, timeout=check.PD_REQUEST_SECONDS, max_tokens=8, access=access
                ),
            )
            answers.append({"status": reply.status, "seconds": round(time.monotonic() - sent, 2)})
            log(f"pd stack: request {index + 1}: HTTP {reply.status} in {answers[-1]['seconds']} s")
        figures["requests"] = answers
        after = _pd_counters(plan, pools)
        for name, pool in pools.items():
            figures[pool] = {key: after[name][key] - before[name][key] for key in PD_COUNTERS}
        if kill_requests:
            figures["prefillKilled"] = prefill_killed_under_load(plan, pools, kill_requests, log)
        return figures
    finally:
        lifecycle.down(label)


def prefill_killed_under_load(plan, pools: dict[str, str], requests: int, log) -> dict[str, Any]:
    """The prefill node's vLLM killed (SIGKILL to the container's process: a crash, which its
    restart policy, unless-stopped, answers with a new start) while clients send `requests`
    through the endpoint, one every 4 s from two workers: how many failed, and how many the decode
    pool served whole (its prompt tokens not pulled over NIXL: nginx's backup while the router has
    no prefill worker, or the router's own fallback). Then until the prefill node serves again."""
    import signal

    from labkit.hosts import dockerd
    from qwen_cluster import tags
    from qwen_cluster.render.vllm import HEALTH_PATH

    prefill = next(name for name, pool in pools.items() if pool == "prefill")
    decode = next(name for name, pool in pools.items() if pool == "decode")
    member = plan.node(prefill)
    daemon = lifecycle.daemon(plan, member)

    def inspect(field: str) -> str:
        done = dockerd.docker(daemon, "inspect", "--format", field, tags.MODEL_SERVER_CONTAINER)
        return done.stdout.strip()

    pid, restarts = int(inspect("{{.State.Pid}}")), int(inspect("{{.RestartCount}}"))
    before = _pd_counters(plan, pools)
    settings = upgrade.pd_real_model_load(requests)
    load_started = time.monotonic()
    with upgrade.ClientLoad(plan, settings) as clients:
        deadline = time.monotonic() + check.PD_REQUEST_SECONDS
        while not any(outcome.ok for outcome in clients.outcomes):
            if time.monotonic() > deadline:
                raise RuntimeError("no request answered before the kill")
            time.sleep(0.5)  # polling the clients' answers, bounded by the deadline
        killed_at = time.monotonic() - load_started
        os.kill(pid, signal.SIGKILL)
        log(f"pd stack: killed the prefill node's vLLM (pid {pid}) at {killed_at:.1f} s of the load")
        deadline = time.monotonic() + requests * check.PD_REQUEST_SECONDS
        while len(clients.outcomes) < requests and time.monotonic() < deadline:
            time.sleep(0.5)  # the clients end after `requests`; bounded by the deadline
    outcomes = sorted(clients.outcomes, key=lambda outcome: outcome.started)
    # Back: the container restarted (a new process), its vLLM healthy again.
    deadline = time.monotonic() + 900
    while True:
        health = netns.call_in(
            member.namespace, lambda: probes.get(member.ip, plan.cluster.model_port, HEALTH_PATH, timeout=5)
        )
        if health.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)  # a model load runs at its own speed; bounded by the deadline
    after = _pd_counters(plan, pools)
    delta = {name: {key: after[name][key] - before[name][key] for key in PD_COUNTERS} for name in pools}
    pulled = delta[decode]["external_prefix_cache_hits_total"]
    figures = {
        "requests": len(outcomes),
        "failed": sum(1 for outcome in outcomes if not outcome.ok),
        "killedAtSeconds": round(killed_at, 1),
        "answers": [
            {
                "startedSeconds": round(outcome.started, 1),
                "seconds": round(outcome.seconds, 1),
                "status": outcome.status,
                "streamed": outcome.streamed,
                **({"error": outcome.error} if outcome.error else {}),
            }
            for outcome in outcomes
        ],
        "decodePromptTokens": delta[decode]["prompt_tokens_total"],
        "decodePulledTokens": pulled,
        "containerRestarts": int(inspect("{{.RestartCount}}")) - restarts,
        "prefillHealthyAgain": health.status == 200,
    }
    log(
        f"pd stack: prefill killed under load: {figures['requests']} requests, {figures['failed']} failed; "
        f"the decode pool computed {figures['decodePromptTokens'] - pulled:g} of its "
        f"{figures['decodePromptTokens']:g} prompt tokens itself; prefill restarted "
        f"{figures['containerRestarts']}x, healthy again: {figures['prefillHealthyAgain']}"
    )
    return figures


# What each figure of the P/D table does and does not show (docs/lab.md says the same).
PD_NOTES = (
    "KV bytes: the decode server's vllm:nixl_bytes_transferred per request; shows the KV crossed "
    "the wire (every block the prompt touches x 512 B), not that a GPU path would move it so.",
    "transfer s: its vllm:nixl_xfer_time_seconds; against the bandwidth arithmetic (bytes / link). "
    "The rates keep the tiny model's KV-to-prefill ratio at Qwen3-32B's on H100 for each link: "
    "the share of prefill time the transfer takes carries over, not the seconds.",
    "TTFT next to aggregated: both servers share 2 cores and each NIXL process spins one, so it "
    "shows no gain or loss of disaggregation, only what the transfer adds.",
)


def print_pd(console, figures: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        "link Mbit/s",
        "Qwen3-32B Gbit/s",
        "requests",
        "errors",
        "prompt tokens",
        "KV bytes",
        "transfer s p50",
        "predicted s",
        "TTFT p50 s",
        "aggregated TTFT p50 s",
        title=(
            f"prefill/decode over NIXL (UCX on TCP, veths): tiny model prefill "
            f"{figures['tinyPrefillTokensPerSecond']} tokens/s x {figures['kvBytesPerToken']} B = KV at "
            f"{figures['tinyKvGbitPerSecond'] * 1000:.0f} Mbit/s (Qwen3-32B on H100: "
            f"{figures['qwenKvGbitPerSecond']} Gbit/s); identical to aggregated: "
            f"{figures['identicalToAggregated']}"
        ),
    )
    for row in figures["rates"]:
        table.add_row(
            str(row["linkMbit"] or "unshaped"),
            str(row["equivalentGbit"] or "-"),
            *(
                str(row[key])
                for key in (
                    "requests",
                    "errors",
                    "promptTokensP50",
                    "kvBytesP50",
                    "transferSecondsP50",
                    "predictedTransferSeconds",
                    "ttftP50Seconds",
                    "aggregatedTtftP50Seconds",
                )
            ),
        )
    console.print(table)
    for note in PD_NOTES:
        console.print(f"  {note}", highlight=False)
    console.print(f"  first P/D requests: {figures['firstRequestsSeconds']} s", highlight=False)
    for case, by_policy in figures["failures"].items():
        for policy, outcome in by_policy.items():
            console.print(f"  {case}, {policy}: {outcome}", highlight=False)
    console.print(f"  expired KV lease: {figures['expiredLease']}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(description=__doc__)
    render_bench.add_arguments(parser)
    parser.add_argument("--lab-stack", default="onprem", help="the bare-metal stack the lab rehearses")
    parser.add_argument("--lab-nodes", default="4,16", help="node counts for `lab up`, comma-separated")
    parser.add_argument("--no-lab", action="store_true", help="the render figures only")
    parser.add_argument("--lanes-nodes", type=int, default=16, help="nodes of the lane rehearsal (0: none)")
    parser.add_argument(
        "--real-model-nodes", type=int, default=4, help="nodes of the real-vLLM rehearsal (0: none)"
    )
    parser.add_argument(
        "--aws-stack", default="prod", help="the AWS stack whose node side is rehearsed ('': none)"
    )
    parser.add_argument(
        "--only",
        choices=("routing", "aws", "pd", "pd-stack"),
        help="one section alone: routing (least-conn against vLLM's router on two real vLLM "
        "replicas), aws (the --aws-stack node side: up, image bump, node added, never healthy), "
        "pd (prefill/decode over NIXL: identity with aggregated, shaped links, failures), or "
        "pd-stack (--lab-stack made disaggregated on two nodes with the real vLLM, served through "
        "the endpoint: each request and the decode node's NIXL counters)",
    )
    parser.add_argument("--no-pd", action="store_true", help="leave the prefill/decode rehearsal out")
    parser.add_argument("--pd-requests", type=int, default=8, help="P/D requests per shaped rate")
    parser.add_argument(
        "--pd-kill-requests",
        type=int,
        default=6,
        help="pd-stack: client requests while the prefill node's vLLM is killed (0: no kill)",
    )
    parser.add_argument("--no-routing", action="store_true", help="leave the routing benchmark out")
    parser.add_argument("--routing-rounds", type=int, default=3, help="routing runs per policy; medians")
    parser.add_argument(
        "--routing-workloads",
        default="shared-prefix,multi-turn,no-reuse",
        help="routing workloads, comma-separated",
    )
    parser.add_argument(
        "--routing-where",
        choices=("lab", "loopback"),
        help="through the lab's endpoint (nginx, key, TLS; the default) "
        "or on loopback addresses (nginx without TLS, the router started by the benchmark)",
    )
    parser.add_argument(
        "--routing-tools",
        default="client",
        help="who sends the workloads: client (the benchmark's own), vllm-bench (`vllm bench serve`, "
        "shared-prefix and no-reuse), guidellm (its own cached environment, all three); "
        "comma-separated with --routing-endpoint, the first elsewhere",
    )
    parser.add_argument(
        "--routing-endpoint",
        help=f"the workloads through this base URL (a deployed cluster's endpoint), the key from "
        f"${ROUTING_KEY_VARIABLE}",
    )
    parser.add_argument("--routing-ca", help="the CA file the endpoint's certificate chains to")
    parser.add_argument(
        "--routing-metrics", help="the replicas' /metrics URLs, comma-separated (hit rate, per replica)"
    )
    parser.add_argument(
        "--routing-tokenizer",
        help="vllm-bench's and guidellm's tokenizer (the served model's; a path or id; "
        "default: the lab's model)",
    )
    parser.add_argument(
        "--routing-reports", help="a directory to keep each guidellm run's own JSON report in"
    )
    parser.add_argument(
        "--routing-hop-only",
        action="store_true",
        help="the router's own cost alone (stand-in workers on loopback, a minute or two)",
    )
    parser.add_argument("--balance-abs-threshold", type=int, help="the router's (default: the program's)")
    parser.add_argument("--balance-rel-threshold", type=float, help="the router's (default: the program's)")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200, stderr=args.json)
    if args.only == "routing":
        figures = {"machine": render_bench.machine(), "routing": routing(args, console)}
        if args.json:
            print(json.dumps(figures, indent=2))
        return 0
    if args.only == "pd-stack":
        log = lambda line: console.print(line, highlight=False)  # noqa: E731
        figures = {"machine": render_bench.machine()}
        figures["pdStack"] = pd_stack(
            args.lab_stack, args.pd_requests, log, kill_requests=args.pd_kill_requests
        )
        print(json.dumps(figures if args.json else figures["pdStack"], indent=2))
        return 0
    if args.only == "pd":
        figures = {"machine": render_bench.machine(), "pd": pd(args, console)}
        if args.json:
            print(json.dumps(figures, indent=2))
        return 0
    if args.only == "aws":
        figures = {"machine": render_bench.machine(), "lab": {"aws": aws_rehearsal(args.aws_stack or "prod")}}
        console.print(f"AWS node side ({args.aws_stack}): {json.dumps(figures['lab']['aws'])}")
        if args.json:
            print(json.dumps(figures, indent=2))
        return 0
    figures = render_bench.run(args, console)
    skipped = "--no-lab given" if args.no_lab else lab_available()
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
        if args.lanes_nodes:
            figures["lab"]["lanes"] = lab_lanes(args.lab_stack, args.lanes_nodes)
            if not args.json:
                print_lanes(console, args.lanes_nodes, figures["lab"]["lanes"])
        if args.real_model_nodes:
            figures["lab"]["realModel"] = lab_real_model(args.lab_stack, args.real_model_nodes)
            if not args.json:
                print_real_model(console, figures["lab"]["realModel"])
        if not args.no_routing:
            figures["routing"] = routing(args, console)
        if not args.no_pd:
            figures["pd"] = pd(args, console)
        if args.aws_stack:
            figures["lab"]["aws"] = aws_rehearsal(args.aws_stack)
            if not args.json:
                console.print(f"AWS node side ({args.aws_stack}): {json.dumps(figures['lab']['aws'])}")
    if args.json:
        print(json.dumps(figures, indent=2))
    return 0
