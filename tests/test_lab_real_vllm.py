"""The lab with the real vLLM (labkit/models/realvllm.py: its CPU build serving the tiny Qwen3 model) as
every replica's model server, inside the vLLM image the lab builds for the tag, on each node's
own Docker engine: two nodes up, the `openai` client streaming a chat completion through the
locked endpoint (nginx, the lab's key over TLS), `check` green on the real server (and red once
a non-member reaches one of its member-only listeners). The image bump under client load on the
real server (200 s of the suite's 15 minutes) is `make bench`'s (labkit/bench.py lab_real_model,
figures in docs/lab.md); here the rollout runs on the stand-in (tests/test_lab_upgrade.py), which
tests/test_real_vllm.py holds to the real server's load, drain and shutdown.

Needs root, the lab's binaries and Docker (CI runs as root with them; `make system`), and the
cached real-vLLM environment (built through the project's own step when missing).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import cli as lab_cli
from labkit.cluster import blueprint, check, lifecycle, renderers
from labkit.hosts import netns
from labkit.images import standins
from labkit.models import realvllm
from qwen_cluster.ports import Vantage
from qwen_cluster.render.firewall import Rule

LABEL = f"r{os.getpid() % 100000}"
BINARIES = ("ip", "nginx", "nft", "ufw", "sysctl", "dockerd", "docker-registry")
MISSING = (
    netns.missing_requirements()
    + standins.missing_requirements()
    + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
)
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")
CLIENT = Path(__file__).parent / "helpers" / "lab_openai_client.py"


@pytest.fixture(scope="module")
def lab():
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=2, label=LABEL)
    # Both engines on one core, as before engine cores became the lab's default: the suite's other
    # workers run their labs beside this module. A clean-clone run with an engine on each core had
    # probes time out in two other lab modules; that the cores caused it is likely, not proven.
    options = lifecycle.Options(clock_scale=realvllm.REAL_MODEL_CLOCK, real_model=True, engine_cores=False)
    try:
        up = lifecycle.up(lab_plan, options)
        assert up.ok, [(step.node, step.step, step.detail[-500:]) for step in up.steps if not step.ok]
        yield lab_plan, options
    finally:
        lifecycle.down(LABEL)


def test_openai_streams_from_the_real_server_through_the_locked_endpoint(lab):
    lab_plan, _options = lab
    access = lifecycle.client_access(lab_plan)
    base_url = f"https://{lab_plan.load_balancer.ip}:{lab_plan.cluster.load_balancer.port}/v1"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/nonexistent",
        "NO_PROXY": "*",
        "OPENAI_API_KEY": access.api_key,
    }
    result = subprocess.run(
        ["ip", "netns", "exec", lab_plan.vantage(Vantage.CLIENT).namespace, sys.executable, str(CLIENT),
         base_url, lab_plan.cluster.model.name, "0", access.ca_file],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    chunks = [entry["chunk"] for entry in report["stream"]]
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert {chunk["model"] for chunk in chunks} == {"Qwen/Qwen3-32B"}
    # vLLM's own answer (the stand-in names its node here; vLLM its version).
    assert any(str(chunk.get("system_fingerprint") or "").startswith("vllm-") for chunk in chunks)
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    assert finishes[-1] in ("length", "stop")
    assert [card["id"] for card in report["models"]] == ["Qwen/Qwen3-32B"]
    assert report["models"][0]["owned_by"] == "vllm"


def test_check_is_green_on_the_real_server_and_says_what_it_cannot_prove(lab, capsys):
    """The same check as on the stand-in: who served a request is what each replica's vLLM
    counts (http_requests_total, vllm:request_success_total), the real server's member-only
    listeners are the port table's unpinned ones, and the silent pause it cannot hold is named."""
    lab_plan, _options = lab
    status = lab_cli.main(["check", "onprem", "--label", LABEL, "--nodes", "2", "--real-model", "--json"])
    document = json.loads(capsys.readouterr().out)
    failures = [(r["group"], r["what"], r["observed"]) for r in document["results"] if r["status"] == "fail"]
    assert status == 0 and document["ok"] and not failures, failures
    rows = {(r["group"], r["source"], r["what"]): r for r in document["results"]}
    spread = rows[("load balancer", "client", f"{check.SPREAD_PER_HEAD * 2} requests")]
    assert re.fullmatch(r"master [1-9]\d*, worker-1 [1-9]\d*", spread["observed"]), spread
    stream = [r for r in document["results"] if r["what"].startswith("stream")]
    assert len(stream) == 1 and "cannot be told to pause" in stream[0]["what"], stream
    assert "[DONE]" in stream[0]["observed"]
    allowed = [r for r in document["results"] if r["expected"] == "reaches a model server"]
    reached = {r["what"]: r["observed"] for r in allowed}
    assert len(reached) == 7, reached
    assert "vLLM counts no /health" in reached.pop("GET /health with the key")
    assert all(observed.endswith("reached 1") for observed in reached.values()), reached
    carried = rows[("endpoint", "model servers", "Authorization headers received")]
    assert carried["observed"].startswith("not counted by vLLM"), carried
    for node in ("master", "worker-1"):
        scanned = rows[("listeners", node, "TCP listeners on non-loopback addresses (ss)")]
        assert "unpinned of the model server (VLLM::" in scanned["observed"], scanned


def test_a_member_only_listener_reached_from_a_non_member_turns_check_red(lab):
    """The fault the listeners check exists for: master's firewall also admits the intruder (an
    unused address on the node segment) to one of the model server's unpinned listeners."""
    lab_plan, _options = lab
    master = lab_plan.node("master")
    server = check.model_server_pids(lab_plan, master)
    leaking = next(lst for lst in check.listening(lab_plan, master) if check.unpinned(master, lst, server))
    intruder = lab_plan.vantage(Vantage.INTRUDER)
    rules = [*renderers.firewall_rules(lab_plan.cluster, "master"),
             Rule("leak", f"{intruder.ip}/32", str(leaking.port), "tcp")]  # fmt: skip
    try:
        opened = lifecycle.firewall(lab_plan, master, rules=rules)
        assert opened.ok, opened.detail
        results = check.listeners(lab_plan)
    finally:
        restored = lifecycle.firewall(lab_plan, master)
    assert restored.ok, restored.detail
    failed = {r.source: r.observed for r in results if not r.ok}
    assert set(failed) == {"intruder"}, failed
    assert f"not promised: master:{leaking.port}" in failed["intruder"]
    assert all(r.ok for r in check.listeners(lab_plan))
