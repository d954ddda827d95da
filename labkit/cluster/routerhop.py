"""What vLLM's router adds to a request by itself: stand-in workers that answer at once on
loopback, the real router (labkit/models/router.py) in front of 2, 8 and 16 of them, and a
client that times the same requests straight to a worker and through the router, per policy.

- The workers (`serve`, a process of their own so that the client's timing shares no interpreter
  with them): `/health`, `/v1/chat/completions` (a fixed short answer, JSON), and the scale-out
  render route the cache_aware and kv_aware policies ask before they choose
  (`/v1/chat/completions/render`: the shape vLLM 0.32 answers, `GenerateRequest`, with token ids
  from the prompt's characters, so that prompts sharing a prefix share token ids). Sockets with
  TCP_NODELAY and HTTP/1.1 keep-alive, as uvicorn's.
- The client: one kept-alive connection per server, TCP_NODELAY, the request in one write
  (http.client sends a bytes body with its headers), sequential requests; every prompt new
  (a random 2,000-character text), so the cache_aware tree and the kv_aware lookup work as they
  would on a miss. `routerHopMs` = the median through the router - the median straight to a
  worker.
- kv_aware gets a static event source per worker that no publisher serves (stand-ins have no KV
  cache): its lookups run on an empty index, every one a miss.
- `fresh`: the same through the router with a new connection per request (what a client without
  keep-alive, or one whose idle connections a proxy closed, pays).

The command line: `python -m labkit.cluster.routerhop serve HOST...` (the workers, at WORKER_PORT),
`... measure` (the whole measurement, JSON).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from labkit.cluster import routingbench
from labkit.hosts import local
from labkit.models import router

WORKER_PORT = 5000
ROUTER_PORT = 30000
ROUTER_METRICS_PORT = 29000
WORKER_COUNTS = (2, 8, 16)
POLICIES = ("round_robin", "cache_aware", "kv_aware")
REQUESTS = 200
WARM_UP = 20
PROMPT_CHARACTERS = 2000
# Streamed answers: this many tokens, this far apart (a fast GPU decode: ~5 ms a token).
STREAM_TOKENS = 16
TOKEN_SECONDS = 0.005
ANSWER = {
    "id": "chatcmpl-standin",
    "object": "chat.completion",
    "model": routingbench.MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def _token_ids(body: dict) -> list[int]:
    """Stand-in token ids: one per character of the messages' text (shared prefixes stay shared)."""
    text = "".join(str(message.get("content", "")) for message in body.get("messages", []))
    return [1 + ord(character) % 500 for character in text]


def _rendered(body: dict) -> dict:
    """What vLLM 0.32's `/v1/chat/completions/render` answers (vllm/entrypoints/scale_out/render/
    api_router.py, response_model GenerateRequest), trimmed to its fields with values."""
    return {
        "request_id": "chatcmpl-standin",
        "token_ids": _token_ids(body),
        "sampling_params": {"max_tokens": body.get("max_tokens") or 16, "temperature": 0.0},
        "model": routingbench.MODEL,
        "stream": False,
        "priority": 0,
    }


# The POSTs the stand-ins answered, by path (GET /counts on any of them: the process's total).
COUNTS: dict[str, int] = {}
# Rendered answers by request body (the few latest).
RENDERED: dict[bytes, bytes] = {}


class _Worker(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def _answer(self, code: int, payload: object) -> None:
        self._send(code, json.dumps(payload).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, tokens: int) -> None:
        """An SSE answer as vLLM streams one: a chunk per token, each its own write, then
        `[DONE]` (chunked transfer encoding), TOKEN_SECONDS apart like a fast decode."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index in range(tokens + 1):
            if index:
                time.sleep(TOKEN_SECONDS)
            delta = {"choices": [{"index": 0, "delta": {"content": "ok"}}]} if index < tokens else None
            event = f"data: {json.dumps(delta)}\n\n" if delta else "data: [DONE]\n\n"
            data = event.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path == "/health":
            self._answer(200, {})
        elif self.path == "/counts":
            self._answer(200, COUNTS)
        elif self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": routingbench.MODEL, "object": "model"}]})
        else:
            self._answer(404, {"error": self.path})

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) or b"{}"
        COUNTS[self.path] = COUNTS.get(self.path, 0) + 1
        if self.path.endswith("/render"):
            # The router asks every worker to render the same prompt; the stand-ins share one
            # process (and interpreter), so the first renders and the others answer its bytes:
            # what is timed is the router's wait for N answers, not N Pythons parsing JSON.
            data = RENDERED.get(raw)
            if data is None:
                data = RENDERED[raw] = json.dumps(_rendered(json.loads(raw))).encode()
                while len(RENDERED) > 64:
                    RENDERED.pop(next(iter(RENDERED)))
            self._send(200, data)
            return
        body = json.loads(raw)
        if self.path == "/v1/chat/completions" and body.get("stream"):
            self._stream(int(body.get("max_tokens") or 1))
        elif self.path == "/v1/chat/completions":
            self._answer(200, ANSWER)
        else:
            self._answer(404, {"error": self.path})

    def log_message(self, *args):
        pass


def serve(addresses: list[tuple[str, int]]) -> None:
    """The stand-in workers, one threaded server per (host, port), until killed."""
    import threading

    for address in addresses:
        server = http.server.ThreadingHTTPServer(address, _Worker)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


class _Client:
    """Kept-alive connections with TCP_NODELAY, one per server; `fresh` opens one per request."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self.connections: dict[str, http.client.HTTPConnection] = {}

    def _connection(self, base: str) -> http.client.HTTPConnection:
        connection = self.connections.get(base)
        if connection is None or self.fresh:
            if connection is not None:
                connection.close()
            host, port = base.removeprefix("http://").split(":")
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.connect()
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connections[base] = connection
        return connection

    def post(self, base: str, body: bytes) -> float:
        """Seconds from sending the request to the end of its answer (status 200 asserted)."""
        return self.stream(base, body)[1]

    def stream(self, base: str, body: bytes) -> tuple[float, float]:
        """(seconds to the answer's first body bytes, seconds to its end)."""
        connection = self._connection(base)
        started = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read1(1)
        first = time.perf_counter() - started
        response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"{base}: HTTP {response.status}")
        return first, elapsed

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()


def _bodies(rng: random.Random, count: int, stream: bool = False) -> list[bytes]:
    return [
        json.dumps(
            {
                "model": routingbench.MODEL,
                "messages": [{"role": "user", "content": routingbench.random_text(rng, PROMPT_CHARACTERS)}],
                "max_tokens": STREAM_TOKENS if stream else 1,
                "stream": stream,
            }
        ).encode()
        for _ in range(count)
    ]


def _wait(condition, timeout: float, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise RuntimeError(f"{what}: exited {process.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout:.0f} s: {log.read_text()[-2000:]}")
        time.sleep(0.2)


@contextlib.contextmanager
def workers(net: str, count: int, workdir: Path) -> Iterator[list[str]]:
    """`count` stand-in workers at net.10, net.11, ... (one process)."""
    hosts = [f"{net}.{10 + index}" for index in range(count)]
    log = workdir / "workers.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "labkit.cluster.routerhop", "serve", *hosts],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
    urls = [f"http://{host}:{WORKER_PORT}" for host in hosts]
    try:
        for url in urls:
            _wait(
                lambda url=url: local.http_status(f"{url}/health") == 200, 60, f"stand-in {url}", process, log
            )
        yield urls
    finally:
        local.kill_group(process)


@contextlib.contextmanager
def running_router(net: str, urls: list[str], policy: str, workdir: Path) -> Iterator[str]:
    host = f"{net}.1"
    extra = {}
    if policy == "kv_aware":
        # Static sources no publisher serves: the policy's lookups on an empty index.
        extra = {
            "kv_event_sources": {url: f"tcp://{host}:{5600 + index}" for index, url in enumerate(urls)},
            "kv_event_block_size": 16,
            "kv_event_model": routingbench.MODEL,
        }
    argv = router.command(
        urls, host=host, port=ROUTER_PORT, metrics_port=ROUTER_METRICS_PORT, policy=policy, **extra
    )
    log = workdir / f"router-{policy}-{len(urls)}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{host}:{ROUTER_PORT}"
    try:
        _wait(lambda: local.http_status(f"{base}/health") == 200, 120, f"the router ({policy})", process, log)
        yield base
    finally:
        local.kill_group(process)


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _counts(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/counts", timeout=10) as response:
        return json.loads(response.read())


def _interleaved(client: _Client, urls: list[str], base: str, bodies: list[bytes], streamed: bool):
    """Each request straight to a worker (in turn) and through the router, one after the other, so
    that both see the same load on a shared machine: (direct, routed) timings."""
    direct, routed = [], []
    for index, body in enumerate(bodies):
        send = client.stream if streamed else client.post
        direct.append(send(urls[index % len(urls)], body))
        routed.append(send(base, body))
    return direct, routed


def measure(
    counts: tuple[int, ...] = WORKER_COUNTS,
    policies: tuple[str, ...] = POLICIES,
    requests: int = REQUESTS,
    workdir: Path | None = None,
    log=print,
) -> dict:
    """Per worker count and policy, requests interleaved straight to a worker and through the
    router: their medians and p90s, the hop (median routed - median direct), the render calls
    the router made per request, a fresh connection per request through the router, and
    streamed answers (first bytes, end)."""
    import tempfile

    directory = Path(workdir or tempfile.mkdtemp(prefix="qcl-routerhop-"))
    directory.mkdir(parents=True, exist_ok=True)
    net = f"127.83.{os.getpid() % 250}"
    router.ensure_venv()
    rng = random.Random(7)
    load = os.getloadavg()[0]
    results: dict[str, dict[str, dict]] = {policy: {} for policy in policies}
    for count in counts:
        with workers(net, count, directory) as urls:
            for policy in policies:
                with running_router(net, urls, policy, directory) as base:
                    client = _Client()
                    for body in _bodies(rng, WARM_UP):
                        client.post(base, body)
                        client.post(urls[0], body)
                    before = _counts(urls[0])
                    direct, routed = _interleaved(client, urls, base, _bodies(rng, requests), streamed=False)
                    after = _counts(urls[0])
                    streams = _bodies(rng, max(1, requests // 8), stream=True)
                    direct_streamed, routed_streamed = _interleaved(
                        client, urls, base, streams, streamed=True
                    )
                    client.close()
                    fresh_client = _Client(fresh=True)
                    fresh = [fresh_client.post(base, body) for body in _bodies(rng, max(1, requests // 4))]
                    fresh_client.close()
                renders = sum(
                    value - before.get(path, 0) for path, value in after.items() if path.endswith("/render")
                )
                figures = {
                    "directP50Ms": _ms(direct, 0.5),
                    "directP90Ms": _ms(direct, 0.9),
                    "routedP50Ms": _ms(routed, 0.5),
                    "routedP90Ms": _ms(routed, 0.9),
                    "hopMs": round(1000 * (statistics.median(routed) - statistics.median(direct)), 3),
                    "renderCallsPerRequest": round(renders / requests, 2),
                    "freshConnectionP50Ms": _ms(fresh, 0.5),
                    "streamedDirectP50Ms": [
                        _ms([f for f, _ in direct_streamed], 0.5),
                        _ms([t for _, t in direct_streamed], 0.5),
                    ],
                    "streamedRoutedP50Ms": [
                        _ms([f for f, _ in routed_streamed], 0.5),
                        _ms([t for _, t in routed_streamed], 0.5),
                    ],
                }
                results[policy][str(count)] = figures
                log(
                    f"{policy:12} {count:2} workers: direct p50 {figures['directP50Ms']} ms, routed p50 "
                    f"{figures['routedP50Ms']} p90 {figures['routedP90Ms']} ms: hop {figures['hopMs']} ms, "
                    f"{figures['renderCallsPerRequest']} render calls a request; fresh connection "
                    f"{figures['freshConnectionP50Ms']} ms; streamed {STREAM_TOKENS} tokens (first, end) "
                    f"direct {figures['streamedDirectP50Ms']} routed {figures['streamedRoutedP50Ms']} ms"
                )
    return {
        "setup": {
            "where": f"loopback: vllm-router {router.VERSION} before stand-in workers that answer at once",
            "requests": requests,
            "promptCharacters": PROMPT_CHARACTERS,
            "client": "sequential, kept-alive, TCP_NODELAY, one write per request; direct and routed "
            "interleaved",
            "loadAverage1m": round(load, 1),
            "cpus": os.cpu_count(),
        },
        "routerHopMs": {
            policy: {n: f["hopMs"] for n, f in by_count.items()} for policy, by_count in results.items()
        },
        "detail": results,
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"] and len(args) >= 2:
        serve([(host, WORKER_PORT) for host in args[1:]])
        return 0
    if args[:1] == ["measure"]:
        print(json.dumps(measure(), indent=2))
        return 0
    print("usage: python -m labkit.cluster.routerhop serve HOST... | measure", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
