"""Prefill/decode disaggregation over NIXL, rehearsed with the real parts: a prefill vLLM CPU
server (`kv_producer`) and a decode server (`kv_consumer`) each in a network namespace of its own
on a lab switch, NIXL's UCX backend on TCP across the veths, vLLM's router in P/D mode (and the
client) in a third; the prefill node's link shaped with `tc ... tbf`, the side channel firewalled
with nft. `scripts/bench.py --only pd` (`benchmark`) and tests/test_real_pd.py run it;
docs/lab.md, "Prefill and decode over NIXL", has the figures and what they do and do not show.

- The servers run the program's rendered `vllm serve` line (qwen_cluster/render/vllm.py) with the
  lab's CPU changes (labkit/models/realvllm.py CPU_CHANGES), plus the KV-transfer flag and the
  NIXL/UCX environment of their role (`kv_transfer`).
- The aggregated reference is the prefill server itself: a `kv_producer` asked without
  `kv_transfer_params` serves the request whole, as a plain server (vLLM's NixlConnector keeps
  blocks for a remote decode only when the request says `do_remote_decode`:
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py request_finished).
- Figures come from vLLM's own metrics: the decode server's `vllm:nixl_bytes_transferred` and
  `vllm:nixl_xfer_time_seconds` histograms, `vllm:external_prefix_cache_hits`, the prefill
  server's `vllm:request_prefill_time_seconds` and its lease counters
  (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py NixlPromMetrics).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.cluster import routingbench
from labkit.cluster.blueprint import BRIDGE, MEMBER_IF, PREFIX
from labkit.hosts import local, netns
from labkit.models import realvllm, router, servermetrics
from qwen_cluster import catalog, kvlink
from qwen_cluster import ports as port_table
from qwen_cluster.render import vllm as vllm_render

LABEL = "pdlab"
# The servers and the router run at the lowest CPU priority (PdLab._spawn says why).
NICE = ("nice", "-n", "19")
SWITCH = f"{PREFIX}{LABEL}-switch"
# The lab's addresses: any private /24 (the namespaces have no route off the lab).
NET = "10.239.80"
ROUTER_IP = f"{NET}.2"
ROUTER_PORT = 30000
ROUTER_METRICS_PORT = 29000
MODEL = routingbench.MODEL
# A side-channel host the peer cannot reach: vLLM's default, `localhost` (vllm/envs.py). The prefill
# server binds it and advertises it; the decode server then knocks on its own loopback. (An
# address the node does not hold is worse: the listener thread dies at bind and the engine waits
# for it forever, never healthy: nixl/base_scheduler.py ready_event.wait(), measured.)
UNREACHABLE_HOST = "localhost"
# Each server's KV cache (64 MiB: 131k tokens of the tiny model, more than any prompt here).
KV_CACHE_BYTES = 64 * 2**20
HEALTHY_TIMEOUT = 900


@dataclass(frozen=True)
class Node:
    name: str  # prefill | decode
    ip: str
    role: str  # kv_producer | kv_consumer
    core: int  # the engine's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)

    @property
    def namespace(self) -> str:
        return f"{PREFIX}{LABEL}-{self.name}"

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{MODEL_PORT}"


MODEL_PORT = 5000
PREFILL = Node("prefill", f"{NET}.10", "kv_producer", 0)
DECODE = Node("decode", f"{NET}.11", "kv_consumer", 1)
ROUTER_NS = f"{PREFIX}{LABEL}-router"


# ---------------------------------------------------------------- what the servers run


def stack(policy: str = "fail"):
    """The onprem stack on the lab's two nodes, disaggregated: `prefill` the prefill pool,
    `decode` the decode pool, NIXL over UCX on TCP, `policy` its serving.kvTransfer.loadFailurePolicy.
    Its gpuModel (H100) is what the config wants for the link floor; the lab does not use it."""
    from qwen_cluster import config
    from tooling import stackfile

    raw = stackfile.cluster_keys(stackfile.read("onprem"))
    raw["nodes"] = [
        {"name": PREFILL.name, "ip": PREFILL.ip, "role": "master"},
        {"name": DECODE.name, "ip": DECODE.ip},
    ]
    raw["network"] = {**raw["network"], "cidr": f"{NET}.0/24"}
    # No Prometheus in this rehearsal (it reads each server's /metrics itself), so no monitoring
    # password or certificate either.
    raw["monitoring"] = {"prometheus": False}
    bare_metal = {key: value for key, value in raw["bareMetal"].items() if key != "hostKeys"}
    # The lab NIC named (bareMetal.interface): the program then tells UCX over TCP its device itself.
    raw["bareMetal"] = {
        **bare_metal,
        "loadBalancerNode": PREFILL.name,
        "gpuModel": "H100",
        "interface": MEMBER_IF,
    }
    # No RDMA here (veths): tuning.rdma off, so the program renders UCX over TCP (UCX_TLS=tcp).
    raw["tuning"] = {**raw.get("tuning", {}), "rdma": False}
    raw["serving"] = {
        "mode": "disaggregated",
        "prefill": {"nodes": [PREFILL.name]},
        "decode": {"nodes": [DECODE.name]},
        "kvTransfer": {"backend": "ucx", "loadFailurePolicy": policy},
    }
    return config.validate(raw)


def server_command(
    node: Node, policy: str = "fail", side_channel_host: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment as the program renders them for its pool
    (qwen_cluster/render/vllm.py, and qwen_cluster/render/kvtransfer.py for NIXL: the
    `--kv-transfer-config`, the side channel on the node's own address, UCX on TCP on the lab NIC
    with its ports in the kv-data row) with the lab's CPU changes (realvllm.CPU_CHANGES: the KV
    buffer in host memory), the lab's CPU environment and the engine's core. `side_channel_host`
    replaces the rendered one: a departure the config refuses, for the failure rehearsal."""
    cluster = stack(policy)
    argv = realvllm.cpu_serve_argv(
        vllm_render.serve_argv(cluster, node.name), realvllm.ensure_model(), KV_CACHE_BYTES
    )
    env = {key: value for key, value in os.environ.items() if key not in realvllm.CPU_ENVIRONMENT_REMOVED}
    env.update({key: value for key, (value, _why) in realvllm.CPU_ENVIRONMENT.items()})
    env.update(vllm_render.environment(cluster, node.name))
    if side_channel_host:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = side_channel_host
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(node.core % (os.cpu_count() or 1))
    return [str(realvllm.ensure_venv() / "bin" / "vllm"), *argv[1:]], env


def side_channel_port() -> int:
    return port_table.port_of(stack().ports, port_table.KV_SIDE_CHANNEL)


def tiny_model() -> catalog.ModelWeights:
    """The tiny Qwen3 (labkit/models/tinymodel.py) as the catalog describes a model, from its
    config.json: its KV bytes per token by the catalog's own arithmetic (2 x 2 layers x 2 KV heads
    x head size 32 x 2 bytes = 512)."""
    config = json.loads((realvllm.ensure_model() / "config.json").read_text())
    return catalog.ModelWeights(
        "tiny-qwen3",
        0.000131,
        2.0,
        config["num_attention_heads"],
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        config["head_dim"],
    )


# ---------------------------------------------------------------- the lab


def _run(argv: list[str]) -> None:
    netns.run(argv)


def _link(namespace: str, ip: str, port: str) -> None:
    netns.add(namespace)
    _run(
        [
            "ip",
            "-n",
            SWITCH,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            MEMBER_IF,
            "netns",
            namespace,
        ]
    )
    _run(["ip", "-n", SWITCH, "link", "set", port, "master", BRIDGE, "up"])
    _run(["ip", "-n", namespace, "addr", "add", f"{ip}/24", "dev", MEMBER_IF])
    _run(["ip", "-n", namespace, "link", "set", MEMBER_IF, "up"])


def down() -> None:
    """Everything of the lab gone: its processes (by their mark), its namespaces."""
    netns.kill_marked(LABEL)
    for namespace in netns.listed():
        if namespace.startswith(f"{PREFIX}{LABEL}-"):
            netns.delete(namespace)


@dataclass
class Completion:
    """One completion as the client saw it."""

    status: int
    seconds: float
    ttft: float | None = None
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and bool(self.tokens)


@dataclass
class Lab:
    workdir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    # -- processes

    def start_server(self, node: Node, policy: str = "fail", side_channel_host: str | None = None) -> None:
        argv, env = server_command(node, policy, side_channel_host)
        self._spawn(node.name, node.namespace, argv, env)

    def wait_healthy(self, names: list[str], timeout: float = HEALTHY_TIMEOUT) -> None:
        for name in names:
            url = {"prefill": PREFILL.url, "decode": DECODE.url, "router": self.router_url}[name]
            self._wait(
                lambda url=url: self.status(f"{url}/health") == 200, timeout, f"{name}'s /health", name
            )

    def wait_routed(self, node: Node, timeout: float = 60) -> None:
        """Until the router counts `node` healthy again (its `vllm_router_worker_health`: a worker
        it saw fail is back only after --health-success-threshold checks, 2 by default, every
        --health-check-interval-secs; meanwhile it answers 503 "No available workers")."""
        pattern = re.compile(
            rf'^vllm_router_worker_health\{{[^}}]*"{re.escape(node.url)}"[^}}]*\}} 1(\.0)?$', re.M
        )

        def healthy() -> bool:
            try:
                return bool(pattern.search(netns.call_in(ROUTER_NS, _get, self.router_metrics_url)))
            except OSError:
                return False

        self._wait(healthy, timeout, f"the router's health of {node.name}", "router")

    @property
    def router_metrics_url(self) -> str:
        return f"http://{ROUTER_IP}:{ROUTER_METRICS_PORT}/metrics"

    def restart(self, node: Node, policy: str = "fail", side_channel_host: str | None = None) -> None:
        """`node`'s server stopped and started again (another policy or side-channel host), healthy,
        and back in the router's set."""
        self.stop(node.name)
        self.start_server(node, policy, side_channel_host)
        self.wait_healthy([node.name])
        self.wait_routed(node)

    def start_router(self) -> None:
        argv = router.pd_command(
            [PREFILL.url], [DECODE.url], host=ROUTER_IP, port=ROUTER_PORT, metrics_port=ROUTER_METRICS_PORT
        )
        self._spawn("router", ROUTER_NS, argv, dict(os.environ))
        self.wait_healthy(["router"], 60)

    @property
    def router_url(self) -> str:
        return f"http://{ROUTER_IP}:{ROUTER_PORT}"

    def stop(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            netns.kill_marked(f"{LABEL}/{name}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)

    def _spawn(self, name: str, namespace: str, argv: list[str], env: dict[str, str]) -> None:
        # NICE: at the lowest priority: NIXL's UCX progress thread spins a core per server even idle, and on
        # this 2-core machine two spinners starved whatever ran beside them (a lab check's 2 s probes
        # in the suite's other worker failed); niced, they take only what is left.
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                netns.marked_argv(f"{LABEL}/{name}", [*NICE, "ip", "netns", "exec", namespace, *argv]),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, name: str, size: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-size:] if path.exists() else ""

    def log_count(self, name: str, text: str) -> int:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace").count(text) if path.exists() else 0

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str, name: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            process = self.processes.get(name)
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited ({process.returncode}) before {what}:\n{self.log_tail(name)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not within {timeout:.0f} s:\n{self.log_tail(name)}")
            time.sleep(0.5)

    # -- the network

    def shape(self, mbit: float | None) -> None:
        """The prefill node's egress (the KV's direction: the decode side reads the blocks) through
        a token bucket of `mbit` (tc-tbf(8); netem does not exist on this kernel), or unshaped.
        The bucket holds 10 ms of the rate (at least 64 KiB: a veth hands TCP segments of up to
        64 KiB); the queue 8 MiB, more than a prompt's KV here: a NIC at line rate backs up into
        the sender rather than dropping, and a queue of 1 s at 2.2 Mbit/s (275 kB) dropped 729
        packets of 1.4 MB transfers, which then took 7.9 s instead of the arithmetic's 5.3 s."""
        netns.exec_in(PREFILL.namespace, ["tc", "qdisc", "del", "dev", MEMBER_IF, "root"], check=False)
        if mbit:
            burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))
            netns.exec_in(
                PREFILL.namespace,
                ["tc", "qdisc", "add", "dev", MEMBER_IF, "root", "tbf", "rate", f"{int(mbit * 1000)}kbit",
                 "burst", str(burst), "limit", str(8 * 2**20)],
            )  # fmt: skip

    def qdisc_counts(self) -> dict[str, int]:
        """The shaping qdisc's own counts (`tc -s -j qdisc`): bytes sent, packets dropped, and
        how often a packet waited for tokens (overlimits)."""
        shown = netns.exec_in(PREFILL.namespace, ["tc", "-s", "-j", "qdisc", "show", "dev", MEMBER_IF]).stdout
        root = next((q for q in json.loads(shown or "[]") if q.get("root")), {})
        return {key: int(root.get(key, 0)) for key in ("bytes", "drops", "overlimits")}

    def firewall_side_channel(self, closed: bool) -> None:
        """The decode node's packets to the prefill node's side channel dropped (nft, in the decode
        namespace), or let through again."""
        netns.exec_in(DECODE.namespace, ["nft", "delete", "table", "inet", "qclpd"], check=False)
        if closed:
            rules = (
                "table inet qclpd {\n chain out {\n  type filter hook output priority 0;\n"
                f"  ip daddr {PREFILL.ip} tcp dport {side_channel_port()} drop\n }}\n}}\n"
            )
            netns.exec_in(DECODE.namespace, ["nft", "-f", "-"], input=rules)

    # -- the client (in the router's namespace)

    def status(self, url: str) -> int:
        return netns.call_in(ROUTER_NS, local.http_status, url)

    def metrics(self, node: Node) -> dict[str, float]:
        return netns.call_in(ROUTER_NS, lambda: samples(_get(f"{node.url}/metrics")))

    def complete(
        self,
        base_url: str,
        prompt: str,
        max_tokens: int = 8,
        timeout: float = 300,
        stream: bool = True,
        salt: str | None = None,
    ) -> Completion:
        return netns.call_in(ROUTER_NS, complete, base_url, prompt, max_tokens, timeout, stream, salt)

    def aggregated(self, text: str, max_tokens: int = 8) -> Completion:
        """`text` answered whole by the prefill server, asked directly without kv_transfer_params:
        a plain server. Its prefix cache salted (vLLM's `cache_salt`), so that neither this
        request nor a later P/D one of the same prompt reuses the other's blocks: each computes
        the prompt in one pass (a prefix hit recomputes only the last partial block, in a
        batch of another shape)."""
        return self.complete(PREFILL.url, text, max_tokens, salt=f"aggregated-{random.getrandbits(64):x}")


def _get(url: str, timeout: float = 60) -> str:
    """A page (a server's /metrics), waited for: under load (two NIXL spinners on two cores, and the
    machine shared) a decode server's /metrics once took over 10 s."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(metrics_text: str) -> dict[str, float]:
    """Every sample of a /metrics page summed over its labels (one engine, one model here)."""
    return servermetrics.summed(metrics_text)


def complete(
    base_url: str, prompt: str, max_tokens: int, timeout: float, stream: bool = True, salt: str | None = None
) -> Completion:
    """One completion at temperature 0 with each token's log-prob: streamed, the time to its
    first token; its tokens and log-probs. An error vLLM reports inside a stream (its status is
    200 by then: `{"error": ...}` as an event) is the result's error. One write per request and
    TCP_NODELAY (a client that writes headers and body apart meets delayed ACKs: 40 ms stalls
    that are the client's)."""
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": stream,
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    if salt:
        request["cache_salt"] = salt
    body = json.dumps(request).encode()
    host, port = base_url.removeprefix("http://").split(":")
    started = time.monotonic()
    result = Completion(0, 0.0)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn.sock.sendall(head + body)
        response = http.client.HTTPResponse(conn.sock, method="POST")
        response.begin()
        result.status = response.status
        if response.status != 200:
            result.error = response.read(500).decode(errors="replace")
            return result
        if not stream:
            _add(result, json.load(response), started)
            return result
        done = False
        while line := response.readline():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            _add(result, json.loads(data), started)
        if not done and not result.error:
            result.error = "stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        result.seconds = time.monotonic() - started
        conn.close()
    return result


def _add(result: Completion, event: dict[str, Any], started: float) -> None:
    """A streamed event's (or a whole answer's) tokens, log-probs, usage or error."""
    if event.get("error"):
        result.error = json.dumps(event["error"])[:500]
    for choice in event.get("choices") or []:
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        if tokens and result.ttft is None:
            result.ttft = time.monotonic() - started
        result.tokens += tokens
        result.logprobs += logprobs.get("token_logprobs") or []
    if event.get("usage"):
        result.prompt_tokens = event["usage"]["prompt_tokens"]


def prompt(rng: random.Random, characters: int = 3000) -> str:
    """A prompt no server has seen (a fresh prefix: no prefix-cache hit on either side); the
    tiny model's byte-level tokenizer makes ~0.93 tokens of a character (routingbench)."""
    return f"{rng.getrandbits(64):016x} " + routingbench.random_text(rng, characters)


@contextlib.contextmanager
def up(*, decode_policy: str = "fail", workdir: Path | None = None, router_too: bool = True) -> Iterator[Lab]:
    """The switch, the three namespaces, both servers (started together) and the router; all of
    it gone on the way out (and any leftover of an earlier run before)."""
    missing = netns.missing_requirements()
    if missing:
        raise netns.NetnsError("; ".join(missing))
    down()
    router.ensure_venv()
    lab = Lab(Path(workdir or tempfile.mkdtemp(prefix="qcl-pd-")))
    lab.workdir.mkdir(parents=True, exist_ok=True)
    try:
        netns.add(SWITCH)
        _run(["ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", SWITCH, "link", "set", BRIDGE, "up"])
        for index, (namespace, ip) in enumerate(
            ((PREFILL.namespace, PREFILL.ip), (DECODE.namespace, DECODE.ip), (ROUTER_NS, ROUTER_IP))
        ):
            _link(namespace, ip, f"pd{index}")
        lab.start_server(PREFILL)
        lab.start_server(DECODE, decode_policy)
        lab.wait_healthy(["prefill", "decode"])
        if router_too:
            lab.start_router()
        yield lab
    finally:
        for name in list(lab.processes):
            lab.stop(name)
        down()


# ---------------------------------------------------------------- what a run shows


@dataclass
class Pulled:
    """One request through the router, with what the decode server's metrics say it pulled."""

    completion: Completion
    bytes: float
    transfer_seconds: float | None
    transfers: float
    external_hits: float


DECODE_COUNTERS = (
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_bytes_transferred_count",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:external_prefix_cache_hits_total",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:request_success_total",
)


def disaggregated(lab: Lab, text: str, max_tokens: int = 8, timeout: float = 300) -> Pulled:
    """`text` through the router, and the decode server's NIXL figures for it (its metrics
    before, and after they count the request: they are written once per engine step)."""
    before = lab.metrics(DECODE)
    completion = lab.complete(lab.router_url, text, max_tokens, timeout)
    after = before
    if completion.ok:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = lab.metrics(DECODE)
            if after.get("vllm:request_success_total", 0) > before.get("vllm:request_success_total", 0):
                break
            time.sleep(0.2)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in DECODE_COUNTERS}
    transfers = delta["vllm:nixl_xfer_time_seconds_count"]
    return Pulled(
        completion,
        delta["vllm:nixl_bytes_transferred_sum"],
        delta["vllm:nixl_xfer_time_seconds_sum"] / transfers if transfers else None,
        transfers,
        delta["vllm:external_prefix_cache_hits_total"],
    )


def identical(a: Completion, b: Completion) -> bool:
    """Token for token and log-prob for log-prob (bitwise: the same floats)."""
    return a.ok and b.ok and a.tokens == b.tokens and a.logprobs == b.logprobs


def difference(a: Completion, b: Completion) -> dict[str, Any]:
    """How two answers differ: tokens that differ, the largest log-prob difference."""
    return {
        "tokensDiffering": sum(x != y for x, y in zip(a.tokens, b.tokens, strict=False))
        + abs(len(a.tokens) - len(b.tokens)),
        "maxLogprobDifference": max(
            (abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=False)), default=None
        ),
    }


def pulled_bytes(prompt_tokens: int, kv_per_token: int, block: int = 128) -> int:
    """What a decode server pulls for a prompt: every block the prompt touches, the last one
    partly filled too (vLLM's CPU block is 128 tokens, vllm/platforms/cpu.py), each slot's KV
    (measured: 1,371 prompt tokens, 11 blocks, 720,896 bytes)."""
    return -(-prompt_tokens // block) * block * kv_per_token


# ---------------------------------------------------------------- the scaling

# What the lab's links stand for: Qwen3-32B prefilled by one H100 (qwen_cluster/kvlink.py, the
# policy pack's arithmetic: 256 KiB of KV per token at ~7.5k tokens/s, KV at ~15.8 Gbit/s) on
# these links.
QWEN = catalog.MODELS["Qwen/Qwen3-32B"]
QWEN_GPU = catalog.GPUS["H100"]
QWEN_LINKS_GBIT = (10, 100, 400)


def qwen_kv_gbps() -> float:
    return kvlink.kv_gbps(kvlink.prefill_tokens_per_second(QWEN_GPU, QWEN), QWEN.kv_bytes_per_token())


def equivalent_mbit(link_gbit: float, tiny_kv_gbps: float) -> float:
    """The lab link on which the tiny model's KV takes the same share of its prefill time as
    Qwen3-32B's on `link_gbit`: that share is KV rate / link (kvlink.LinkDemand.prefill_share),
    so the link scales by the ratio of the KV rates (the tiny model's on this CPU, measured,
    over Qwen3-32B's on an H100)."""
    return link_gbit * 1000 * tiny_kv_gbps / qwen_kv_gbps()


def prefill_rate(lab: Lab, rng: random.Random, requests: int = 3, characters: int = 3000) -> float:
    """The tiny model's prefill tokens/s on the prefill server, as P/D runs it (its NIXL thread
    spinning): fresh prompts sent to it directly, the prompt tokens over vLLM's own
    `vllm:request_prefill_time_seconds`."""
    before = lab.metrics(PREFILL)
    tokens = 0
    for _ in range(requests):
        done = lab.complete(PREFILL.url, prompt(rng, characters), 1)
        if not done.ok:
            raise RuntimeError(f"prefill alone: {done.status} {done.error}")
        tokens += done.prompt_tokens
    key = "vllm:request_prefill_time_seconds_count"
    deadline = time.monotonic() + 30
    after = lab.metrics(PREFILL)
    while after.get(key, 0) - before.get(key, 0) < requests and time.monotonic() < deadline:
        time.sleep(0.2)
        after = lab.metrics(PREFILL)
    seconds = after["vllm:request_prefill_time_seconds_sum"] - before.get(
        "vllm:request_prefill_time_seconds_sum", 0
    )
    return tokens / seconds


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


# What the decode server logs when a KV load fails, per kv_load_failure_policy: under `fail` the
# scheduler's line (vllm/v1/core/sched/scheduler.py _handle_invalid_blocks); under `recompute` a
# failed handshake leaves only the worker's transfer failure (measured: no "Recovered from KV load
# failure", which is for blocks that failed after the handshake).
FAILURE_LOG = {
    "fail": "Failing 1 request(s) due to KV load failure",
    "recompute": "NIXL transfer failure: handshake_failed",
}


def failed_load(lab: Lab, rng: random.Random, policy: str) -> dict[str, Any]:
    """What a client gets from the router while the decode server cannot load the KV: one
    request whole and one streamed (a stream's status is sent before the failure), and whether
    the decode server's log and its `vllm:nixl_num_failed_transfers` say so."""
    marker = FAILURE_LOG[policy]
    counter = "vllm:nixl_num_failed_transfers_total"
    logged, failed = lab.log_count("decode", marker), lab.metrics(DECODE).get(counter, 0.0)
    outcome: dict[str, Any] = {}
    for mode, stream in (("whole", False), ("streamed", True)):
        done = lab.complete(lab.router_url, prompt(rng, 1500), 4, 300, stream)
        outcome[mode] = {
            "status": done.status,
            "seconds": round(done.seconds, 1),
            "tokens": len(done.tokens),
            "error": done.error[:160],
        }
    outcome["decodeLogged"] = lab.log_count("decode", marker) - logged
    outcome["failedTransfersCounted"] = lab.metrics(DECODE).get(counter, 0.0) - failed
    return outcome


def benchmark(
    rates: tuple[float, ...] = QWEN_LINKS_GBIT,
    requests: int = 8,
    characters: int = 3000,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The rehearsal and its figures (the issue's names): first requests, identity with the
    aggregated answer, per shaped rate the KV bytes and transfer seconds per request against the
    arithmetic and TTFT next to aggregated, then the failures (side channel firewalled, a wrong
    side-channel host, under `fail` and `recompute`) and an expired KV lease."""
    rng = random.Random(39)
    kv_per_token = tiny_model().kv_bytes_per_token()
    figures: dict[str, Any] = {"kvBytesPerToken": kv_per_token}
    started = time.monotonic()
    with up(decode_policy="fail") as lab:
        figures["upSeconds"] = round(time.monotonic() - started, 1)
        log(f"up in {figures['upSeconds']} s")
        # The side channel firewalled: first, while the decode side has not met the prefill side
        # (the side channel serves only the handshake; a decode server that shook hands keeps
        # the peer's metadata and never asks again).
        lab.firewall_side_channel(True)
        failures = {"sideChannelFirewalled": {"fail": failed_load(lab, rng, "fail")}}
        lab.firewall_side_channel(False)
        log(f"side channel firewalled, fail: {failures['sideChannelFirewalled']['fail']}")
        # The first requests (handshake, first steps) and the identity with aggregated.
        first = []
        for _ in range(3):
            pulled = disaggregated(lab, prompt(rng, characters))
            first.append(round(pulled.completion.seconds, 2))
        figures["firstRequestsSeconds"] = first
        log(f"first P/D requests: {first} s")
        same, moved, differences = [], [], []
        for _ in range(4):
            text = prompt(rng, characters)
            reference = lab.aggregated(text)
            pulled = disaggregated(lab, text)
            same.append(identical(reference, pulled.completion))
            differences.append(difference(reference, pulled.completion))
            # Its blocks came over the wire, and the decode side counts the prompt as external hits.
            tokens = pulled.completion.prompt_tokens
            moved.append(
                {
                    "promptTokens": tokens,
                    "bytes": pulled.bytes,
                    "predictedBytes": pulled_bytes(tokens, kv_per_token),
                    "externalPrefixHits": pulled.external_hits,
                    "transferSeconds": pulled.transfer_seconds,
                }
            )
        figures["identicalToAggregated"] = all(same)
        figures["differences"] = differences
        figures["moved"] = moved
        log(f"identical to aggregated (tokens and log-probs): {same} {differences}; moved: {moved}")
        tiny_rate = prefill_rate(lab, rng, characters=characters)
        figures["tinyPrefillTokensPerSecond"] = round(tiny_rate)
        tiny_kv_gbps = kvlink.kv_gbps(tiny_rate, kv_per_token)
        figures["tinyKvGbitPerSecond"] = round(tiny_kv_gbps, 4)
        figures["qwenKvGbitPerSecond"] = round(qwen_kv_gbps(), 2)
        log(f"tiny prefill {tiny_rate:.0f} tokens/s: KV at {tiny_kv_gbps * 1000:.1f} Mbit/s")
        rows = []
        for link in (None, *rates):
            mbit = equivalent_mbit(link, tiny_kv_gbps) if link else None
            lab.shape(mbit)
            # One request first, not counted: the first transfer on a new qdisc took 11.8 s once
            # where the next ones took the arithmetic's 0.8 s (measured at 14.6 Mbit/s).
            disaggregated(lab, prompt(rng, characters))
            pulls, references = [], []
            shaped_before = lab.qdisc_counts()
            for _ in range(requests):
                text = prompt(rng, characters)
                references.append(lab.aggregated(prompt(rng, characters)))
                pulls.append(disaggregated(lab, text))
            shaped = lab.qdisc_counts()
            lab.shape(None)
            good = [pull for pull in pulls if pull.completion.ok]
            kv_bytes = _p50([pull.bytes for pull in good])
            row = {
                "linkMbit": round(mbit, 1) if mbit else None,
                "equivalentGbit": link,
                "requests": len(pulls),
                "errors": len(pulls) - len(good),
                "kvBytesPerToken": kv_per_token,
                "kvBytesP50": kv_bytes,
                "promptTokensP50": _p50([pull.completion.prompt_tokens for pull in good]),
                "transferSecondsP50": _p50([pull.transfer_seconds for pull in good if pull.transfer_seconds]),
                "predictedTransferSeconds": round(kv_bytes * 8 / (mbit * 1e6), 4)
                if mbit and kv_bytes
                else None,
                "predictedShareOfPrefill": round(figures["qwenKvGbitPerSecond"] / link, 3) if link else None,
                "ttftP50Seconds": _p50([pull.completion.ttft for pull in good if pull.completion.ttft]),
                "aggregatedTtftP50Seconds": _p50([ref.ttft for ref in references if ref.ok and ref.ttft]),
                "qdisc": {key: shaped[key] - shaped_before.get(key, 0) for key in shaped} if mbit else None,
            }
            rows.append(row)
            log(f"link {row['linkMbit'] or 'unshaped'} Mbit ({link or '-'} Gbit/s for Qwen3-32B): {row}")
        figures["rates"] = rows
        # An expired KV lease: the prefill side keeps a request's blocks 30 s for the decode side
        # (kv_lease_duration, nixl/base_worker.py); asked only by a client that never goes on to a
        # decode server, it releases them; a decode read after that still succeeds.
        figures["expiredLease"] = expired_lease(lab, rng, characters)
        log(f"expired lease: {figures['expiredLease']}")
        # A wrong side-channel host: the prefill server advertises `localhost`.
        lab.restart(PREFILL, side_channel_host=UNREACHABLE_HOST)
        failures["wrongSideChannelHost"] = {"fail": failed_load(lab, rng, "fail")}
        log(f"wrong side-channel host, fail: {failures['wrongSideChannelHost']['fail']}")
        lab.restart(DECODE, "recompute")
        failures["wrongSideChannelHost"]["recompute"] = failed_load(lab, rng, "recompute")
        log(f"wrong side-channel host, recompute: {failures['wrongSideChannelHost']['recompute']}")
        figures["failures"] = failures
    figures["seconds"] = round(time.monotonic() - started, 1)
    return figures


def expired_lease(lab: Lab, rng: random.Random, characters: int) -> dict[str, Any]:
    """The router's first half by hand: the prefill request with `do_remote_decode`, then its
    `kv_transfer_params` handed to the decode server only after the prefill side released the
    blocks (its `vllm:nixl_num_kv_expired_reqs` counted it)."""
    text = prompt(rng, characters)
    expired = "vllm:nixl_num_kv_expired_reqs_total"
    after_expiry = "vllm:nixl_num_notifications_after_expiry_total"
    before = lab.metrics(PREFILL)
    body = {
        "model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }  # fmt: skip
    answer = netns.call_in(ROUTER_NS, _post, f"{PREFILL.url}/v1/completions", body)
    params = answer["kv_transfer_params"]
    started = time.monotonic()
    while lab.metrics(PREFILL).get(expired, 0) <= before.get(expired, 0):
        if time.monotonic() - started > 120:
            raise RuntimeError("the prefill server never released the unclaimed blocks")
        time.sleep(1)
    released_after = time.monotonic() - started
    body = {**body, "max_tokens": 4, "kv_transfer_params": params}
    decoded = netns.call_in(ROUTER_NS, _post, f"{DECODE.url}/v1/completions", body, check=False)
    # The prefill server reads the decode side's notifications in its engine steps
    # (nixl/pull_worker.py _get_new_notifs, from get_finished): an idle one never looks. Any
    # request makes it step (measured: without one, nothing was logged or counted).
    lab.complete(PREFILL.url, prompt(rng, 200), 1)
    deadline = time.monotonic() + 30
    after = lab.metrics(PREFILL)
    while after.get(after_expiry, 0) <= before.get(after_expiry, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
        after = lab.metrics(PREFILL)
    return {
        "releasedAfterSeconds": round(released_after, 1),
        "decodeStatus": decoded.get("status", 200),
        "kvExpiredReqs": after.get(expired, 0) - before.get(expired, 0),
        "notificationsAfterExpiry": after.get(after_expiry, 0) - before.get(after_expiry, 0),
        "prefillLogSays": "Potentially invalid KV blocks"
        if lab.log_count("prefill", "Potentially invalid KV blocks")
        else None,
    }


def _post(url: str, body: dict, check: bool = True) -> dict:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        if check:
            raise
        return {"status": error.code, "error": error.read(300).decode(errors="replace")}
