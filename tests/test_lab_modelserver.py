"""The stand-in model server and the HTTP probes, on loopback (no root needed)."""

from __future__ import annotations

import http.client
import json

import pytest

from labkit import modelserver, probes
from tests.helpers.standin_server import free_port, serving


@pytest.fixture(scope="module")
def server():
    hold = free_port()
    settings = modelserver.Settings(node="node-a", token_delay=0.01, think=0.0, tokens=5)
    with serving(settings, [hold]) as (port, instance):
        yield port, hold, instance


def test_models_lists_the_served_model(server):
    port, _, _ = server
    reply = probes.get("127.0.0.1", port, "/v1/models")
    assert reply.status == 200
    assert json.loads(reply.body)["data"][0]["id"] == "Qwen/Qwen3-32B"


def test_chat_completion_is_deterministic_and_names_the_node(server):
    port, _, _ = server
    first = probes.chat("127.0.0.1", port, "same prompt")
    second = probes.chat("127.0.0.1", port, "same prompt")
    assert first.ok and first.node == "node-a"
    content = [json.loads(reply.body)["choices"][0]["message"]["content"] for reply in (first, second)]
    assert content[0] == content[1] and len(content[0].split()) == 5


def test_stream_sends_a_first_event_before_a_silent_thinking_pause(server):
    port, _, _ = server
    result = probes.stream("127.0.0.1", port, headers={"X-Lab-Think": "0.5"})
    assert result.ok and result.tokens == 5
    assert result.first_event < 0.3 < 0.5 <= result.end
    assert result.longest_silence >= 0.5


def test_health_and_prometheus_metrics(server):
    port, hold, _ = server
    assert probes.get("127.0.0.1", port, "/health").status == 200
    probes.chat("127.0.0.1", port)
    text = probes.get("127.0.0.1", hold, "/metrics").body.decode()
    assert "# TYPE lab_requests_total counter" in text
    assert 'path="/v1/chat/completions",status="200"' in text
    assert "vllm:generation_tokens_total" in text


def test_hold_port_accepts_but_serves_no_model(server):
    _, hold, _ = server
    assert probes.tcp_connect("127.0.0.1", hold).open
    assert probes.chat("127.0.0.1", hold).body and b"choices" not in probes.chat("127.0.0.1", hold).body


def test_bad_request_body_is_a_400_and_unknown_path_a_404(server):
    port, _, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", "/v1/chat/completions", "not json", {"Content-Type": "application/json"})
    assert conn.getresponse().status == 400
    conn.close()
    assert probes.get("127.0.0.1", port, "/nowhere").status == 404


def test_closed_port_is_refused():
    result = probes.tcp_connect("127.0.0.1", free_port(), timeout=0.5)
    assert not result.open and result.detail == "refused"


def test_an_image_tagged_unhealthy_never_opens_its_port():
    settings = modelserver.Settings(node="node-b", image="vllm/vllm-openai:v0.33.1-unhealthy")
    with serving(settings, []) as (port, _):
        reply = probes.get("127.0.0.1", port, "/health")
        assert reply.status == 0 and "ConnectionRefused" in reply.error


@pytest.mark.parametrize(
    ("image", "never"),
    [
        ("vllm/vllm-openai:v0.33.1-unhealthy", True),
        ("registry:5000/vllm-unhealthy", False),  # the repository, not the tag
        ("vllm/vllm-openai:v0.33.1", False),
        ("vllm/vllm-openai:v0.33.1-unhealthy@sha256:0abc", True),
    ],
)
def test_only_the_tag_makes_an_image_unhealthy(image, never):
    assert modelserver.never_healthy(image) is never
