"""The stand-in model server's life as vLLM 0.33 lives it (labkit/models/modelserver.py docstring):
refused while loading, /health and /v1/models 200 while draining, new requests that render a
prompt 500 after SIGTERM, past --shutdown-timeout the API port closed and requests held
unanswered until their clients leave, a multi-node head that waits for its headless members.
On loopback (no root needed); `shutdown()` is what the server's SIGTERM handler calls."""

from __future__ import annotations

import json
import socket
import threading

from labkit.cluster import probes
from labkit.models import modelserver
from tests.helpers.standin_server import free_port, serving
from tests.helpers.wait import wait_until


def sigterm(instance: modelserver.ModelServer) -> None:
    """What the server's SIGTERM handler does, on its own loop."""
    instance.loop.call_soon_threadsafe(instance.shutdown)


def test_while_loading_the_port_refuses_connections_then_health_answers_200():
    settings = modelserver.Settings(node="n", load_delay=0.5)
    with serving(settings, [], loaded=False) as (port, _):
        first = probes.get("127.0.0.1", port, "/health")
        assert first.status == 0 and "ConnectionRefused" in first.error  # no 503: nothing listens
        wait_until(lambda: probes.get("127.0.0.1", port, "/health").status, what="loaded", timeout=10,
                   done=lambda status: status == 200)


def _stream_in_background(port: int, tokens: int, delay: float) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["stream"] = probes.stream(
            "127.0.0.1", port, headers={"X-Lab-Token-Delay": str(delay)}, max_tokens=tokens, timeout=3
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_draining_keeps_health_200_answers_new_requests_500_and_finishes_what_fits():
    settings = modelserver.Settings(node="n", shutdown_timeout=5.0)
    with serving(settings) as (port, instance):
        thread, out = _stream_in_background(port, tokens=10, delay=0.05)
        wait_until(lambda: instance.stats.running, what="the stream in flight", timeout=5)
        sigterm(instance)
        wait_until(lambda: instance.draining, what="draining", timeout=5)
        assert probes.get("127.0.0.1", port, "/health").status == 200
        new = probes.chat("127.0.0.1", port)
        assert new.status == 500 and json.loads(new.body)["error"] == {
            "message": modelserver.SHUTDOWN_ERROR,
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        # Only what renders a prompt fails: the rest answers as before (measured on vLLM).
        assert probes.request("127.0.0.1", port, "POST", "/tokenize").status == 500
        assert probes.get("127.0.0.1", port, "/v1/models").status == 200
        assert probes.get("127.0.0.1", port, "/version").status == 200
        assert probes.get("127.0.0.1", port, "/metrics").status == 200
        thread.join(timeout=10)
        assert out["stream"].done and out["stream"].tokens == 10  # it fit in the timeout
        wait_until(lambda: instance.exited.is_set(), what="exit once drained", timeout=5)


def test_past_the_shutdown_timeout_the_port_closes_and_a_stream_is_held_until_its_client_leaves():
    settings = modelserver.Settings(node="n", shutdown_timeout=0.3)
    with serving(settings) as (port, instance):
        thread, out = _stream_in_background(port, tokens=200, delay=0.02)
        wait_until(lambda: instance.stats.running, what="the stream in flight", timeout=5)
        sigterm(instance)
        wait_until(lambda: instance.held.is_set(), what="held past the timeout", timeout=5)
        sigterm(instance)  # a second SIGTERM changes nothing
        # uvicorn's shutdown closed the listener: a new connection is refused ...
        refused = wait_until(
            lambda: probes.get("127.0.0.1", port, "/health"),
            what="the API port closed",
            timeout=5,
            done=lambda reply: "ConnectionRefused" in (reply.error or ""),
        )
        assert refused.status == 0
        # ... while the process stays up for the client it holds.
        assert not instance.exited.is_set()
        thread.join(timeout=10)
        stream = out["stream"]
        # The client gave up (its 3 s read timeout): no [DONE], no error event, never closed.
        assert not stream.done and "timed out" in (stream.error or "")
        assert 0 < stream.tokens < 200
        # Its client gone, nothing holds the process: it exits, as vLLM's does.
        wait_until(lambda: instance.exited.is_set(), what="exit once the held client left", timeout=5)


def test_a_multinode_head_loads_only_once_its_headless_members_joined_its_master_port():
    master = free_port()
    settings = modelserver.Settings(node="head", master_port=master, members=1)
    with serving(settings, [], loaded=False) as (port, instance):
        assert probes.tcp_connect("127.0.0.1", master).open  # the TCPStore listens at once
        # (that probe's connection came and went: a member that leaves is not counted)
        wait_until(lambda: not instance.joined, what="the probe gone", timeout=5)
        assert probes.get("127.0.0.1", port, "/health").status == 0
        member = socket.create_connection(("127.0.0.1", master))
        member.sendall(modelserver.MEMBER_HELLO + b"worker-1\n")
        try:
            wait_until(lambda: probes.get("127.0.0.1", port, "/health").status, what="loaded",
                       timeout=10, done=lambda status: status == 200)
        finally:
            member.close()


def test_every_route_of_the_release_is_served():
    with serving(modelserver.Settings(node="n")) as (port, _):
        routes = modelserver.OTHER_VLLM_ROUTES
        statuses = {r: probes.request("127.0.0.1", port, "POST", r).status for r in routes}
    assert [route for route, status in statuses.items() if status != 200] == []
