"""The routing benchmark's workloads as guidellm runs them (labkit/cluster/guidellmbench.py, its
environment labkit/models/guidellmenv.py): the scenario it is given (every field one of
guidellm 0.8.1's schemas), the key, CA and offline tokenizer it gets from the environment, its own
JSON report (tests/data/guidellm/, from a real run on the loopback routing lab) read as the
benchmark's figures, and the real guidellm against the stand-in server on loopback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from labkit.cluster import guidellmbench, routingbench, routinglab

DATA = Path(__file__).parent / "data" / "guidellm"


def test_shared_prefix_is_guidellms_synthetic_data_in_the_benchmarks_shape():
    spec = guidellmbench.scenario("https://lb:443/", "shared-prefix", 7, "/models/tiny", "/r.json")["spec"]
    assert spec["backend"]["target"] == "https://lb:443"
    assert spec["backend"]["request_format"] == "/v1/chat/completions"
    assert spec["backend"]["model"] == routingbench.MODEL
    assert spec["backend"]["verify"] is True  # guidellm's default would not check the certificate
    assert "api_key" not in spec["backend"]  # the key goes through the environment only
    (data,) = spec["data"]
    assert data == {
        "kind": "synthetic_text",
        "prefix_count": 12,
        "prefix_tokens": 4000,
        "prompt_tokens": 40,
        "output_tokens": routingbench.MAX_TOKENS,
    }
    assert spec["profile"] == {"kind": "concurrent", "streams": [routingbench.CONCURRENCY]}
    assert spec["constraints"] == [{"kind": "max_requests", "count": 96}]
    assert spec["tokenizer"] == {"kind": "huggingface_auto", "model": "/models/tiny"}
    assert spec["seed"] == {"kind": "static", "value": 7}
    assert spec["outputs"] == [{"kind": "json", "path": "/r.json"}]
    multi = guidellmbench.scenario("http://x", "multi-turn", 7, "t", "/r")["spec"]
    assert multi["data"][0]["turns"] == 7 and multi["constraints"][0]["count"] == 70
    with pytest.raises(ValueError, match="workload 'long-context'"):
        guidellmbench.scenario("http://x", "long-context", 7, "t", "/r")
    assert guidellmbench.argv("/env/bin/guidellm", "/tmp/s.json") == [
        "/env/bin/guidellm", "run", "--scenario", "/tmp/s.json", "--disable-console",
    ]  # fmt: skip


def test_every_tool_runs_the_workloads_it_has_data_for():
    assert all(routinglab.supports("guidellm", workload) for workload in routingbench.WORKLOADS)
    assert not routinglab.supports("vllm-bench", "multi-turn")
    with pytest.raises(ValueError, match="routing tool 'guidelm'"):
        routinglab.run_once("guidelm", routingbench.Endpoint("http://x"), "shared-prefix", 1, None)


def test_the_key_the_ca_and_an_offline_tokenizer_come_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/lab/standins")
    endpoint = routingbench.Endpoint("https://lb", api_key="sk-1", ca_file="/ca.pem")
    env = guidellmbench.environment(endpoint, str(tmp_path))
    assert env[guidellmbench.KEY_VARIABLE] == "sk-1" and env["SSL_CERT_FILE"] == "/ca.pem"
    assert env["HF_HUB_OFFLINE"] == "1" and "PYTHONPATH" not in env
    # A tokenizer named by its Hub id (a user's cluster): the user's own environment decides.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    env = guidellmbench.environment(routingbench.Endpoint("http://x"), "Qwen/Qwen3-32B")
    assert "HF_HUB_OFFLINE" not in env


def test_its_report_and_the_replicas_counters_make_the_benchmarks_figures():
    report = json.loads((DATA / "report-shared-prefix.json").read_text())
    names = routingbench.COUNTERS
    before = {"a": dict.fromkeys(names, 0.0), "b": dict.fromkeys(names, 0.0)}
    after = {
        "a": {names[0]: 600.0, names[1]: 1000.0, names[2]: 1000.0, names[3]: 60.0},
        "b": {names[0]: 200.0, names[1]: 1000.0, names[2]: 1000.0, names[3]: 36.0},
    }
    figures = guidellmbench.figures_of(report, before, after, 10.0)
    # As the run that wrote it printed them (least-conn, docs/routing.md).
    assert figures["tool"] == "guidellm"
    assert (figures["requests"], figures["errors"]) == (96, 0)
    assert (figures["ttftP50Seconds"], figures["ttftP90Seconds"]) == (0.0903, 0.5722)
    assert figures["outputTokensPerSecond"] == 164.74 and figures["seconds"] == 9.3
    assert figures["prefixCacheHitRate"] == 0.4
    assert figures["uncachedPromptTokens"] == {"a": 400, "b": 800}
    assert figures["requestsPerReplica"] == {"a": 60, "b": 36}  # vllm:request_success_total
    each = routingbench.summarize([figures])["each"][0]
    assert each["requestsPerReplica"] == {"a": 60, "b": 36} and each["uncachedPromptTokens"]["b"] == 800
    # An endpoint whose replicas it cannot read: no hit rate, guidellm's figures still.
    assert guidellmbench.figures_of(report, {}, {}, 10.0)["prefixCacheHitRate"] is None


def test_the_environment_pins_guidellm_and_the_cpu_torch_and_is_keyed_by_the_list(tmp_path, monkeypatch):
    from labkit.models import guidellmenv

    lines = [
        line.strip()
        for line in guidellmenv.REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+_-]+", line) for line in lines), lines
    assert f"guidellm=={guidellmenv.VERSION}" in lines and "torch==2.13.0+cpu" in lines
    assert not [line for line in lines if line.lower().startswith(("nvidia", "triton", "cuda"))]
    pinned = tmp_path / "requirements.txt"
    pinned.write_text("guidellm==0.8.1\n")
    monkeypatch.setattr(guidellmenv, "REQUIREMENTS", pinned)
    monkeypatch.setenv("QCL_LAB_CACHE", str(tmp_path / "cache"))
    key = guidellmenv.venv_key()
    assert guidellmenv.venv_dir() == tmp_path / "cache" / f"guidellm-{key}"
    pinned.write_text("guidellm==0.8.2\n")
    assert guidellmenv.venv_key() != key
