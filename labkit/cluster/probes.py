"""Probes: plain functions that measure from wherever they are called.

Call them through `netns.call_in(namespace, ...)` to measure from inside a namespace;
the tests also call them on loopback.
"""

from __future__ import annotations

import base64
import errno
import http.client
import json
import re
import socket
import ssl
import subprocess
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

from qwen_cluster.render.verify import IPERF_STREAMS


@dataclass(frozen=True)
class ClientAccess:
    """How a client reaches the endpoint: the API key it sends (None: none) and the CA it trusts
    for TLS (None: plain HTTP). The key is never in a repr or a report."""

    api_key: str | None = field(default=None, repr=False)
    ca_file: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def connection(self, ip: str, port: int, timeout: float) -> http.client.HTTPConnection:
        if self.ca_file is None:
            return http.client.HTTPConnection(ip, port, timeout=timeout)
        context = ssl.create_default_context(cafile=self.ca_file)
        return http.client.HTTPSConnection(ip, port, timeout=timeout, context=context)


PLAIN = ClientAccess()


@dataclass(frozen=True)
class Connect:
    open: bool
    detail: str  # "connected", "refused", "timeout", "unreachable: ..."
    seconds: float


def tcp_connect(ip: str, port: int, timeout: float = 1.0) -> Connect:
    """Open if the handshake completes. A firewall DROP shows as a timeout, a REJECT or a
    missing listener as refused; the lab keeps a listener on every probed port, so only the
    firewall can make a connection fail."""
    started = time.monotonic()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect((ip, port))
        return Connect(True, "connected", time.monotonic() - started)
    except TimeoutError:
        return Connect(False, "timeout", time.monotonic() - started)
    except ConnectionRefusedError:
        return Connect(False, "refused", time.monotonic() - started)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return Connect(False, f"unreachable: {name}", time.monotonic() - started)
    finally:
        sock.close()


@dataclass(frozen=True)
class Handshake:
    accepted: bool
    detail: str  # the version agreed, or OpenSSL's reason for the failure


TLS_VERSIONS = {
    "TLSv1": ssl.TLSVersion.TLSv1,
    "TLSv1.1": ssl.TLSVersion.TLSv1_1,
    "TLSv1.2": ssl.TLSVersion.TLSv1_2,
    "TLSv1.3": ssl.TLSVersion.TLSv1_3,
}


def tls_handshake(ip: str, port: int, version: str, timeout: float = 3.0) -> Handshake:
    """A TLS handshake offering `version` alone. The client's own floor is lowered
    (SECLEVEL=0) so that it really offers TLS 1.0/1.1: a refusal is then the server's
    (`TLSV1_ALERT_PROTOCOL_VERSION`, `UNSUPPORTED_PROTOCOL`), not this client's
    (`NO_PROTOCOLS_AVAILABLE`)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated: that is what is tested
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = context.maximum_version = TLS_VERSIONS[version]
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        with socket.create_connection((ip, port), timeout=timeout) as raw, context.wrap_socket(raw) as tls:
            return Handshake(True, str(tls.version()))
    except ssl.SSLError as exc:
        return Handshake(False, str(exc.reason or exc))
    except OSError as exc:
        return Handshake(False, f"{type(exc).__name__}: {exc}")


@dataclass
class Reply:
    status: int
    node: str | None
    body: bytes = b""
    seconds: float = 0.0
    error: str | None = None
    image: str | None = None  # the stand-in's X-Lab-Image: which version answered

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


def _request(
    ip: str,
    port: int,
    method: str,
    path: str,
    body: str | None,
    headers: dict[str, str],
    timeout: float,
    access: ClientAccess = PLAIN,
) -> Reply:
    started = time.monotonic()
    conn = access.connection(ip, port, timeout)
    try:
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        data = response.read()
        return Reply(
            response.status,
            response.getheader("X-Lab-Node"),
            data,
            time.monotonic() - started,
            image=response.getheader("X-Lab-Image"),
        )
    except (OSError, http.client.HTTPException) as exc:
        return Reply(0, None, b"", time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def chat(
    ip: str,
    port: int,
    prompt: str = "hello",
    *,
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
    max_tokens: int | None = None,
    access: ClientAccess = PLAIN,
) -> Reply:
    """One non-streaming chat completion (a real model without `max_tokens` may write until its
    context is full)."""
    request = {"model": "Qwen/Qwen3-32B", "messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    body = json.dumps(request)
    headers = {"Content-Type": "application/json", **access.headers(), **(headers or {})}
    return _request(ip, port, "POST", "/v1/chat/completions", body, headers, timeout, access)


def get(ip: str, port: int, path: str, *, timeout: float = 5.0, access: ClientAccess = PLAIN) -> Reply:
    return _request(ip, port, "GET", path, None, access.headers(), timeout, access)


CHAT_PROBE = {"messages": [{"role": "user", "content": "probe"}], "max_tokens": 4}
# A body each generation route accepts: vLLM's router parses a body before it forwards it (in P/D
# mode a chat body on /v1/completions is its 422, "missing field `prompt`", measured), and vLLM
# answers a body of another route's shape 400. (vllm/entrypoints/openai/completion/protocol.py
# CompletionRequest.prompt; responses/protocol.py ResponsesRequest.input, max_output_tokens.)
PROBE_BODIES: dict[str, dict] = {
    "/v1/chat/completions": CHAT_PROBE,
    "/v1/completions": {"prompt": "probe", "max_tokens": 4},
    "/v1/responses": {"input": "probe", "max_output_tokens": 4},
}


def request(
    ip: str,
    port: int,
    method: str,
    path: str,
    *,
    timeout: float = 5.0,
    access: ClientAccess = PLAIN,
    headers: dict[str, str] | None = None,
) -> Reply:
    """Any method and path, sent as written (no normalisation: `/v1/../metrics` goes as is). A
    POST carries a small body of the route's own shape (PROBE_BODIES; a chat body elsewhere),
    bounded for a real model."""
    body = json.dumps(PROBE_BODIES.get(path, CHAT_PROBE)) if method == "POST" else None
    sent = {**access.headers(), **(headers or {})}
    if body:
        sent["Content-Type"] = "application/json"
    return _request(ip, port, method, path, body, sent, timeout, access)


def post(
    ip: str,
    port: int,
    path: str,
    *,
    timeout: float = 5.0,
    basic_auth: str | None = None,
    access: ClientAccess = PLAIN,
) -> Reply:
    """An empty POST (an admin route such as Prometheus's /-/quit); `basic_auth`: "user:password";
    `access`: its CA for https (the API key it may hold is not sent)."""
    headers = {}
    if basic_auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(basic_auth.encode()).decode()
    return _request(ip, port, "POST", path, "", headers, timeout, access)


@dataclass
class Stream:
    status: int
    node: str | None
    first_event: float | None  # seconds from sending to the first SSE event
    end: float | None  # seconds to the [DONE] event
    tokens: int
    longest_silence: float
    done: bool
    error: str | None = None
    image: str | None = None
    think: float | None = None  # the pause the stand-in says it held (X-Lab-Think); vLLM: None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.done


def stream(
    ip: str,
    port: int,
    prompt: str = "hello",
    *,
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
    max_tokens: int | None = None,
    access: ClientAccess = PLAIN,
) -> Stream:
    """A streamed chat completion read event by event: when did the first one arrive, did
    [DONE] arrive, and how long was the longest silence in between."""
    request = {"model": "Qwen/Qwen3-32B", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    body = json.dumps(request)
    started = time.monotonic()
    conn = access.connection(ip, port, timeout)
    result = Stream(0, None, None, None, 0, 0.0, False)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body,
            {"Content-Type": "application/json", **access.headers(), **(headers or {})},
        )
        response = conn.getresponse()
        result.status, result.node = response.status, response.getheader("X-Lab-Node")
        result.image = response.getheader("X-Lab-Image")
        think = response.getheader("X-Lab-Think")
        result.think = float(think) if think else None
        last = time.monotonic()
        while True:
            line = response.readline()
            if not line:
                break
            now = time.monotonic()
            if not line.startswith(b"data:"):
                continue
            result.longest_silence = max(result.longest_silence, now - last)
            last = now
            if result.first_event is None:
                result.first_event = now - started
            payload = line[5:].strip()
            if payload == b"[DONE]":
                result.done, result.end = True, now - started
                break
            chunk = json.loads(payload)
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            # vLLM's qwen3 reasoning parser puts thinking text in `reasoning` (0.32/0.33).
            if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                result.tokens += 1
        if not result.done:
            result.error = "stream ended without [DONE] (cut)"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return result


@dataclass
class Spread:
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values()) + len(self.failures)


def spread(
    ip: str,
    port: int,
    requests: int,
    *,
    timeout: float = 10.0,
    access: ClientAccess = PLAIN,
    max_tokens: int | None = None,
) -> Spread:
    """Send `requests` chat completions and count which node answered each (the stand-in's
    X-Lab-Node; `?` for a server that names none, as vLLM)."""
    result = Spread()
    for index in range(requests):
        reply = chat(ip, port, f"request {index}", timeout=timeout, access=access, max_tokens=max_tokens)
        if reply.ok:
            result.counts[reply.node or "?"] += 1
        else:
            result.failures.append(reply.error or f"HTTP {reply.status}")
    return result


_REPLY_RTT = re.compile(r" time=([\d.]+) ?ms")


def ping_rtt_ms(namespace: str, ip: str, count: int = 5) -> float | None:
    """The median RTT in ms of the replies (None: no reply), as the rendered verify script
    holds it to maxLatencyMs (ping needs a raw socket: run as a process in the namespace)."""
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, "ping", "-n", "-c", str(count), "-i", "0.05", "-W", "1", ip],
        capture_output=True,
        text=True,
        timeout=30,
    )
    replies = sorted(float(rtt) for rtt in _REPLY_RTT.findall(done.stdout))
    return replies[(len(replies) - 1) // 2] if replies else None


def iperf3_gbps(
    namespace: str, ip: str, *, seconds: float = 1.0, port: int = 5201, streams: int = IPERF_STREAMS
) -> tuple[float | None, str]:
    """Receiver-side throughput in Gbit/s of a TCP iperf3 run from `namespace` to `ip`, with as
    many parallel streams as the verify script (one stream is one core's and one flow's)."""
    argv = ["iperf3", "-c", ip, "-p", str(port), "-t", str(seconds), "-P", str(streams), "-J"]
    argv += ["--connect-timeout", "2000"]
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", namespace, *argv], capture_output=True, text=True, timeout=seconds + 15
        )
    except subprocess.TimeoutExpired:
        return None, f"iperf3 gave no result within {seconds + 15:g} s"
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return None, (done.stderr or done.stdout).strip()[:200]
    if "error" in report:
        return None, str(report["error"])
    bits = report["end"]["sum_received"]["bits_per_second"]
    return bits / 1e9, "ok"
