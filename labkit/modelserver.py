"""A stand-in for vLLM's OpenAI-compatible server: small, deterministic, stdlib only.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions (JSON, or SSE with
`"stream": true`), GET /metrics (Prometheus text), and every other route vLLM serves
(OTHER_VLLM_ROUTES: tokenizer, admin and control routes), answered 200 with `{"served": path}`
so that a request the load balancer should have refused shows up here: every request is
counted by path and status (`lab_requests_total`), and one that carries an Authorization header
is counted apart (`lab_requests_with_authorization_total`: the load balancer strips the key).
Every answer names the node that served it (`X-Lab-Node` header, `system_fingerprint`), so
the lab can see how the load balancer spreads requests. A streamed answer sends its first
chunk at once, then stays silent for the "thinking" pause (Qwen3's thinking mode), then sends
one token per `token_delay`.
Requests may override both with `X-Lab-Think` / `X-Lab-Token-Delay` headers (seconds).
Like vLLM loading its weights, it answers 503 (`/health` and completions) for `load_delay`
seconds after it starts; `image` (the container image it stands in for) is in every answer's
`X-Lab-Image` header, so a rehearsal can see which replicas run the new version. An image
whose tag ends in `-unhealthy` stands for a release that never loads: it answers 503 for ever,
so a rollout to it stops at its first health gate (`lab.py upgrade --change
model.image=vllm/vllm-openai:v0.33.1-unhealthy`).

Held to the protocol by the real `openai` client (tests/test_lab_openai.py), where it answers
as vLLM does: a model it does not serve is a 404 `NotFoundError`; `max_completion_tokens` (the
client's name) counts like `max_tokens`; `stream_options.include_usage` ends the stream with a
usage chunk with empty `choices`; model cards carry `created`; usage counts the prompt's words.

Run: python -m labkit.modelserver --node master --port 5000 [--hold 22,6000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from qwen_cluster.render.vllm import HEALTH_PATH

# The tag suffix of an image whose stand-in never passes /health (a broken release).
UNHEALTHY_TAG_SUFFIX = "-unhealthy"


def never_healthy(image: str) -> bool:
    """An image reference (`repository:tag`, maybe `@digest`) whose tag ends in the suffix."""
    reference = image.split("@", 1)[0]
    _, _, tag = reference.rpartition(":")
    return "/" not in tag and tag.endswith(UNHEALTHY_TAG_SUFFIX)

DEFAULT_MODEL = "Qwen/Qwen3-32B"
MAX_BODY = 1 << 20
# vLLM's bounds for vllm:time_to_first_token_seconds (a subset; +Inf is the count).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM's routes besides /health, /metrics, /v1/models and /v1/chat/completions, across the v0.11
# line and later releases (vllm/entrypoints/openai/api_server.py and the routers it registers):
# the stand-in serves them all, so that a leak through the load balancer is seen.
OTHER_VLLM_ROUTES = (
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/messages",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/tokenize",
    "/detokenize",
    "/get_tokenizer_info",
    "/invocations",
    "/ping",
    "/load",
    "/version",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/server_info",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/pause",
    "/resume",
    "/is_paused",
    "/update_weights",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/docs",
    "/openapi.json",
    "/redoc",
)
# The lab's endpoint check marks its requests with this header: a marked request that reaches a
# stand-in is counted by path (`lab_probe_requests_total`), whatever else scrapes the server.
PROBE_HEADER = "x-lab-probe"
# The stand-in's "KV cache": this many concurrent requests fill it.
KV_SLOTS = 64
WORDS = ("the", "cluster", "answers", "every", "prompt", "token", "by", "token", "through", "nginx")


@dataclass
class Settings:
    node: str
    model: str = DEFAULT_MODEL
    token_delay: float = 0.0
    think: float = 0.0
    tokens: int = 8
    load_delay: float = 0.0
    image: str = ""


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    requests: Counter = field(default_factory=Counter)  # (path, status) -> count
    tokens: int = 0
    running: int = 0
    with_authorization: int = 0  # requests that carried an Authorization header
    probed: Counter = field(default_factory=Counter)  # path -> requests marked X-Lab-Probe
    # Time to first token, as vLLM's histogram: cumulative counts per bucket bound, sum, count.
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_sum: float = 0.0
    ttft_count: int = 0

    def first_token(self, seconds: float) -> None:
        for index, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_buckets[index] += 1
        self.ttft_sum += seconds
        self.ttft_count += 1


def completion_tokens(prompt: str, count: int) -> list[str]:
    """The same prompt always yields the same tokens."""
    seed = sum(prompt.encode()) if prompt else 0
    return [WORDS[(seed + index) % len(WORDS)] + " " for index in range(count)]


class ModelServer:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.stats = Stats()
        self.servers: list[asyncio.base_events.Server] = []
        never = never_healthy(settings.image)
        self.loaded_at = float("inf") if never else time.monotonic() + settings.load_delay

    @property
    def loaded(self) -> bool:
        return time.monotonic() >= self.loaded_at

    async def start(self, host: str, port: int | None, hold: list[int] = ()) -> None:
        if port is not None:
            self.servers.append(
                await asyncio.start_server(self._connection(api=True), host, port, reuse_address=True)
            )
        for extra in hold:
            self.servers.append(
                await asyncio.start_server(self._connection(api=False), host, extra, reuse_address=True)
            )

    def _connection(self, *, api: bool):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while await self._one_request(reader, writer, api=api):
                    pass
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                pass
            finally:
                writer.close()

        return handle

    async def _one_request(self, reader, writer, *, api: bool) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        body = await reader.readexactly(length) if length else b""
        keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        path = path.split("?", 1)[0]
        if "authorization" in headers:
            self.stats.with_authorization += 1
        if PROBE_HEADER in headers:
            self.stats.probed[path] += 1
        if api and not self.loaded and path in (HEALTH_PATH, "/v1/chat/completions", "/v1/models"):
            loading = {"status": "loading", "node": self.settings.node}
            await self._send_json(writer, 503, loading, keep_alive, path)
        elif path == HEALTH_PATH and method == "GET":
            await self._send_json(writer, 200, {"status": "ok", "node": self.settings.node}, keep_alive, path)
        elif path == "/metrics" and method == "GET":
            await self._send(
                writer, 200, self.metrics().encode(), "text/plain; version=0.0.4", keep_alive, path
            )
        elif not api:
            await self._send_json(writer, 200, {"held": True, "node": self.settings.node}, keep_alive, path)
        elif path == "/v1/models" and method == "GET":
            card = {
                "id": self.settings.model,
                "object": "model",
                "created": int(self.stats.started),  # required by the OpenAI schema
                "owned_by": "qwen-cluster-lab",
                "root": self.settings.model,
            }
            models = {"object": "list", "data": [card]}
            await self._send_json(writer, 200, models, keep_alive, path)
        elif path == "/v1/chat/completions" and method == "POST":
            try:
                request = json.loads(body or b"{}")
                if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
                    raise ValueError
            except ValueError:
                error = {
                    "error": {"message": "body must be JSON with a messages list", "type": "invalid_request"}
                }
                await self._send_json(writer, 400, error, keep_alive, path)
                return keep_alive
            model = request.get("model") or self.settings.model  # vLLM: omitted = the served one
            if model != self.settings.model:
                # vLLM's OpenAIServing._check_model: same message, type and status.
                error = {
                    "error": {
                        "message": f"The model `{model}` does not exist.",
                        "type": "NotFoundError",
                        "param": None,
                        "code": 404,
                    }
                }
                await self._send_json(writer, 404, error, keep_alive, path)
                return keep_alive
            think = float(headers.get("x-lab-think", self.settings.think))
            delay = float(headers.get("x-lab-token-delay", self.settings.token_delay))
            self.stats.running += 1
            try:
                if request.get("stream"):
                    await self._stream(writer, request, think, delay, version)
                    return False
                await self._complete(writer, request, think, delay, keep_alive)
            finally:
                self.stats.running -= 1
        elif path in OTHER_VLLM_ROUTES:
            await self._send_json(writer, 200, {"served": path, "node": self.settings.node}, keep_alive, path)
        else:
            await self._send_json(
                writer, 404, {"error": {"message": f"no route {method} {path}"}}, keep_alive, path
            )
        return keep_alive

    def _tokens(self, request: dict) -> list[str]:
        messages = request.get("messages") or [{}]
        prompt = str(messages[-1].get("content", "")) if isinstance(messages[-1], dict) else ""
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        count = int(limit or self.settings.tokens)
        return completion_tokens(prompt, max(1, min(count, 4096)))

    @staticmethod
    def _usage(request: dict, completion: int) -> dict:
        """Words stand in for tokens: the prompt's count grows with the prompt, as a tokenizer's does."""
        prompt = sum(
            len(str(message.get("content") or "").split())
            for message in request.get("messages") or []
            if isinstance(message, dict)
        )
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, kind: str) -> dict:
        return {
            "id": f"chatcmpl-lab-{self.settings.node}-{sum(self.stats.requests.values())}",
            "object": kind,
            "created": int(time.time()),
            "model": self.settings.model,
            "system_fingerprint": self.settings.node,
        }

    async def _complete(self, writer, request, think, delay, keep_alive) -> None:
        tokens = self._tokens(request)
        await asyncio.sleep(think + delay * len(tokens))
        self.stats.first_token(think + delay)
        self.stats.tokens += len(tokens)
        answer = {
            **self._envelope("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(tokens).strip()},
                    "finish_reason": "stop",
                }
            ],
            "usage": self._usage(request, len(tokens)),
        }
        await self._send_json(writer, 200, answer, keep_alive, "/v1/chat/completions")

    async def _stream(self, writer, request, think, delay, version) -> None:
        chunked = version == "HTTP/1.1"
        head = [
            "HTTP/1.1 200 OK" if chunked else "HTTP/1.0 200 OK",
            "Content-Type: text/event-stream",
            "Cache-Control: no-cache",
            f"X-Lab-Node: {self.settings.node}",
            f"X-Lab-Image: {self.settings.image}",
            "Connection: close",
        ]
        if chunked:
            head.append("Transfer-Encoding: chunked")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        self.stats.requests[("/v1/chat/completions", 200)] += 1

        async def event(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n" if chunked else payload)
            await writer.drain()

        options = request.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        envelope = self._envelope("chat.completion.chunk")  # one id for the whole stream

        def chunk(delta: dict, finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            extra = {"usage": None} if include_usage else {}
            return json.dumps({**envelope, "choices": [choice], **extra})

        tokens = self._tokens(request)
        started = time.monotonic()
        await event(chunk({"role": "assistant", "content": ""}))
        await asyncio.sleep(think)  # silent: no byte until the first token
        for index, token in enumerate(tokens):
            await asyncio.sleep(delay)
            await event(chunk({"content": token}))
            if index == 0:
                self.stats.first_token(time.monotonic() - started)
            self.stats.tokens += 1
        await event(chunk({"content": ""}, "stop"))
        if include_usage:
            await event(json.dumps({**envelope, "choices": [], "usage": self._usage(request, len(tokens))}))
        await event("[DONE]")
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _send_json(self, writer, status, data, keep_alive, path) -> None:
        await self._send(writer, status, json.dumps(data).encode(), "application/json", keep_alive, path)

    async def _send(
        self, writer, status, body: bytes, content_type: str, keep_alive: bool, path: str
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"X-Lab-Node: {self.settings.node}\r\nX-Lab-Image: {self.settings.image}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        self.stats.requests[(path, status)] += 1

    def metrics(self) -> str:
        node = self.settings.node
        lines = [
            "# HELP lab_requests_total HTTP requests served, by path and status.",
            "# TYPE lab_requests_total counter",
        ]
        for (path, status), count in sorted(self.stats.requests.items()):
            labels = f'node="{node}",path="{_label(path)}",status="{status}"'
            lines.append(f"lab_requests_total{{{labels}}} {count}")
        lines += [
            "# HELP lab_probe_requests_total Requests marked X-Lab-Probe.",
            "# TYPE lab_probe_requests_total counter",
        ]
        for path, count in sorted(self.stats.probed.items()):
            lines.append(f'lab_probe_requests_total{{node="{node}",path="{_label(path)}"}} {count}')
        lines += [
            "# HELP lab_requests_with_authorization_total Requests that carried an Authorization header.",
            "# TYPE lab_requests_with_authorization_total counter",
            f'lab_requests_with_authorization_total{{node="{node}"}} {self.stats.with_authorization}',
        ]
        # vLLM's own names and types (docs.vllm.ai, "Production Metrics"), so the cluster's
        # alert rules read the stand-in as they read vLLM.
        model = f'model_name="{self.settings.model}"'
        stats = self.stats
        lines += [
            "# HELP vllm:generation_tokens_total Tokens generated.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{model}}} {stats.tokens}",
            "# HELP vllm:num_requests_running Requests being answered now.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{model}}} {stats.running}",
            "# HELP vllm:num_requests_waiting Requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{model}}} {max(0, stats.running - KV_SLOTS)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{model}}} {min(stats.running, KV_SLOTS) / KV_SLOTS:g}",
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            *(
                f'vllm:time_to_first_token_seconds_bucket{{{model},le="{bound}"}} {count}'
                for bound, count in zip(TTFT_BUCKETS, stats.ttft_buckets, strict=True)
            ),
            f'vllm:time_to_first_token_seconds_bucket{{{model},le="+Inf"}} {stats.ttft_count}',
            f"vllm:time_to_first_token_seconds_sum{{{model}}} {stats.ttft_sum:.6f}",
            f"vllm:time_to_first_token_seconds_count{{{model}}} {stats.ttft_count}",
            "# HELP process_start_time_seconds Start time of the process.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.stats.started:.3f}",
        ]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value: a client's path may hold quotes, backslashes, anything."""
    printable = "".join(char if char.isprintable() else "?" for char in value)
    return printable.replace("\\", "\\\\").replace('"', '\\"')


async def serve(settings: Settings, host: str, port: int | None, hold: list[int]) -> None:
    server = ModelServer(settings)
    await server.start(host, port, hold)
    print(f"model stand-in {settings.node} on {host}:{port} (hold {hold})", flush=True)
    await asyncio.gather(*(srv.serve_forever() for srv in server.servers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, help="the API port (none: only hold the --hold ports)")
    parser.add_argument("--hold", default="", help="comma-separated extra ports that only accept")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--think", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds of 503 before it serves")
    parser.add_argument("--image", default="", help="the image it stands in for (X-Lab-Image)")
    args = parser.parse_args(argv)
    hold = [int(port) for port in args.hold.split(",") if port.strip() and int(port) != args.port]
    settings = Settings(
        args.node, args.model, args.token_delay, args.think, args.tokens, args.load_delay, args.image
    )
    asyncio.run(serve(settings, args.host, args.port, hold))


if __name__ == "__main__":
    main()
