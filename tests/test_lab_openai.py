"""Someone else's code checks the stand-in's protocol: the `openai` package streams a chat
completion from the lab's client namespace through the lab's nginx to the stand-in servers.

Needs root and the lab's binaries (CI runs as root with them). The client runs under
`ip netns exec <client namespace>`, whose only link is the lab bridge (checked first: no route
off the lab), and is given the lab load balancer's address and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cluster import blueprint, check, lifecycle
from labkit.hosts import netns
from labkit.models import modelserver
from qwen_cluster.ports import Vantage

LABEL = f"o{os.getpid() % 100000}"
BINARIES = ("ip", "nginx", "nft", "ufw", "sysctl")
MISSING = netns.missing_requirements() + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")
CLIENT = Path(__file__).parent / "helpers" / "lab_openai_client.py"
THINK_SECONDS = 0.6
MAX_TOKENS = 6  # as lab_openai_client.MAX_TOKENS asks
PROMPT = "how many nodes answer this prompt"


@pytest.fixture(scope="module")
def seen():
    """The lab (onprem, two nodes) up, the real client run once in the client namespace."""
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=2, label=LABEL)
    try:
        up = lifecycle.up(lab_plan, lifecycle.Options(token_delay=0.02))
        assert up.ok, [(step.node, step.step, step.detail[-300:]) for step in up.steps if not step.ok]
        client = lab_plan.vantage(Vantage.CLIENT).namespace
        contained = [r for r in check.containment(lab_plan) if r.source in ("client", "host")]
        assert contained and all(r.ok for r in contained), contained
        # The lab's endpoint is locked: its key, over TLS from the lab's CA.
        access = lifecycle.client_access(lab_plan)
        base_url = f"https://{lab_plan.load_balancer.ip}:{lab_plan.cluster.load_balancer.port}/v1"
        # A bare environment: no proxy or other OPENAI_* variable can point the client elsewhere.
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": "/nonexistent",
            "NO_PROXY": "*",
            "OPENAI_API_KEY": access.api_key,
        }
        result = subprocess.run(
            ["ip", "netns", "exec", client, sys.executable, str(CLIENT), base_url,
             lab_plan.cluster.model.name, str(THINK_SECONDS), access.ca_file],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        yield lab_plan, json.loads(result.stdout)
    finally:
        lifecycle.down(LABEL)


def _content_chunks(stream: list[dict]) -> list[dict]:
    return [entry for entry in stream if entry["chunk"]["choices"] and entry["chunk"]["choices"][0]["delta"]]


def test_the_streamed_answer_is_the_stand_ins_tokens_in_order(seen):
    lab_plan, report = seen
    chunks = [entry["chunk"] for entry in report["stream"]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert text == "".join(modelserver.completion_tokens(PROMPT, MAX_TOKENS))
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1  # one id for the whole stream
    assert {chunk["model"] for chunk in chunks} == {lab_plan.cluster.model.name}
    # Served by a replica behind nginx (the stand-in names its node in system_fingerprint).
    assert {chunk["system_fingerprint"] for chunk in chunks} <= {node.name for node in lab_plan.cluster.nodes}
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    # Cut by max_tokens: vLLM's "length", on the last token's chunk.
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_the_stream_ends_with_the_usage_the_client_asked_for(seen):
    _, report = seen
    last = report["stream"][-1]["chunk"]
    assert last["choices"] == []
    words = len(PROMPT.split())
    assert last["usage"]["completion_tokens"] == MAX_TOKENS
    assert last["usage"]["prompt_tokens"] == words
    assert last["usage"]["total_tokens"] == MAX_TOKENS + words


def test_tokens_reach_the_client_as_they_come_not_when_the_answer_is_done(seen):
    # The first chunk arrives before the thinking pause ends (nginx does not buffer), and the
    # tokens after it: the client saw the stream live.
    _, report = seen
    content = _content_chunks(report["stream"])
    first, tokens = content[0]["at"], [entry["at"] for entry in content[1:]]
    assert first < THINK_SECONDS <= tokens[0]
    assert tokens == sorted(tokens) and tokens[-1] - tokens[0] > 0.02 * (len(tokens) - 2)


def test_a_plain_completion_parses_with_its_usage(seen):
    _, report = seen
    plain = report["plain"]
    assert plain["object"] == "chat.completion"
    (choice,) = plain["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "".join(modelserver.completion_tokens(PROMPT, MAX_TOKENS)).strip()
    assert plain["usage"] == {
        "prompt_tokens": len(PROMPT.split()),
        "completion_tokens": MAX_TOKENS,
        "total_tokens": len(PROMPT.split()) + MAX_TOKENS,
        "completion_tokens_details": None,
        "prompt_tokens_details": None,
    }


def test_the_model_list_has_the_served_model_with_its_creation_time(seen):
    lab_plan, report = seen
    (card,) = report["models"]
    assert card["id"] == lab_plan.cluster.model.name and card["object"] == "model"
    assert isinstance(card["created"], int) and card["created"] > 0


def test_a_model_nobody_serves_is_the_clients_not_found_error(seen):
    lab_plan, report = seen
    unknown = report["unknown_model"]
    assert (unknown["raised"], unknown["status"]) == ("NotFoundError", 404)
    served = lab_plan.cluster.model.name
    assert unknown["message"].endswith(f"The model `no-such-model` does not exist. Valid aliases: {served}.")
