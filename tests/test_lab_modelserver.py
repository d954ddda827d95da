"""The stand-in model server and the HTTP probes, on loopback (no root needed)."""

from __future__ import annotations

import http.client
import json

import pytest

from labkit.cluster import probes
from labkit.models import modelserver
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


def test_the_model_card_is_vllms(server):
    """The fields of vLLM's ModelCard, as the real server fills them (tests/test_real_vllm.py
    compares the keys with the real server's)."""
    port, _, _ = server
    (card,) = json.loads(probes.get("127.0.0.1", port, "/v1/models").body)["data"]
    assert card["owned_by"] == "vllm" and card["root"] == "Qwen/Qwen3-32B" and card["parent"] is None
    assert card["max_model_len"] == modelserver.DEFAULT_MAX_MODEL_LEN
    (permission,) = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")


def _post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_model_nobody_serves_is_vllms_404(server):
    port, _, _ = server
    status, body = _post(port, {"model": "nobody/x", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `nobody/x` does not exist. Valid aliases: Qwen/Qwen3-32B.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_an_answer_cut_by_max_tokens_ends_with_length_and_one_the_stand_in_ends_with_stop(server):
    port, _, _ = server
    messages = [{"role": "user", "content": "hi"}]
    _, cut = _post(port, {"messages": messages, "max_tokens": 3})
    _, whole = _post(port, {"messages": messages})
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 5
    text = probes.get("127.0.0.1", port, "/metrics").body.decode()
    assert 'finished_reason="length"} ' in text and 'finished_reason="abort"} 0' in text


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
    nowhere = probes.get("127.0.0.1", port, "/nowhere")
    assert nowhere.status == 404 and json.loads(nowhere.body) == {"detail": "Not Found"}  # FastAPI's


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
