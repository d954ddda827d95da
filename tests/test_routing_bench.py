"""The routing benchmark without a server (labkit/cluster/routingbench.py), and the lab's router without
running it (labkit/models/router.py, its image in labkit/images/standins.py)."""

from __future__ import annotations

import random
import re

from labkit.cluster import routingbench
from labkit.images import standins
from labkit.models import router

METRICS = """# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-32B"} 3000.0
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-32B"} 4000.0
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-32B"} 4100.0
vllm:prompt_tokens_created{engine="0",model_name="Qwen/Qwen3-32B"} 1.7e9
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-32B"} 5.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-32B"} 2.0
"""


def _tokens(chains) -> int:
    """A workload's prompt text in characters: ~tokens for the tiny model's byte-level tokenizer."""
    return sum(
        len(message["content"]) for chain in chains for request in chain for message in request["messages"]
    )


def test_counters_read_vllms_totals_and_nothing_else():
    assert routingbench.counters(METRICS) == {
        "vllm:prefix_cache_hits_total": 3000.0,
        "vllm:prefix_cache_queries_total": 4000.0,
        "vllm:prompt_tokens_total": 4100.0,
        "vllm:request_success_total": 7.0,  # every finished_reason
    }


def test_the_figures_come_from_the_counters_deltas_of_every_replica():
    zero = dict.fromkeys(routingbench.COUNTERS, 0.0)
    before = {"a": zero, "b": zero}
    after = {
        "a": {
            "vllm:prefix_cache_hits_total": 900,
            "vllm:prefix_cache_queries_total": 1000,
            "vllm:prompt_tokens_total": 1000,
        },
        "b": {
            "vllm:prefix_cache_hits_total": 100,
            "vllm:prefix_cache_queries_total": 1000,
            "vllm:prompt_tokens_total": 1000,
        },
    }
    results = [routingbench.Result(True, 200, ttft, 1.0, 1000, 16) for ttft in (0.1, 0.2, 0.3, 0.4, 0.5)]
    results.append(routingbench.Result(False, 500, None, 1.0, error="boom"))
    figures = routingbench.figures(results, 2.0, before, after)
    assert figures["requests"] == 6 and figures["errors"] == 1
    assert figures["prefixCacheHitRate"] == 0.5  # (900 + 100) / (1000 + 1000)
    # Uncached prompt tokens: a 100, b 900; the busiest over the mean (500).
    assert figures["busiestReplicaRatio"] == 1.8
    assert figures["ttftP50Seconds"] == 0.3
    assert figures["outputTokensPerSecond"] == 40.0  # 5 x 16 tokens in 2 s


def test_every_working_set_fits_the_cluster_but_not_one_replica():
    replica = routingbench.KV_TOKENS_PER_REPLICA
    assert (replica + 128) * routingbench.KV_BYTES_PER_TOKEN == routingbench.KV_CACHE_BYTES
    for name in ("shared-prefix", "multi-turn"):
        working_set = routingbench.WORKLOADS[name].working_set_tokens
        assert 1.3 * replica <= working_set <= 0.8 * 2 * replica, name
    contexts = routingbench.shared_prefix(random.Random(1))
    # >= 3.5k tokens: ~0.93 tokens a character with the tiny model's tokenizer (measured).
    assert min(len(chain[0]["messages"][0]["content"]) for chain in contexts) * 0.93 >= 3500


def test_multi_turn_sends_each_turn_with_the_history_so_far():
    chains = routingbench.multi_turn(random.Random(2))
    assert len(chains) == 10 and {len(chain) for chain in chains} == {7}
    assert all(not chain[0].get("reply") and all(turn["reply"] for turn in chain[1:]) for chain in chains)
    assert 4000 <= _tokens(chains) / len(chains) <= 5000  # what a session adds up to, answers aside


def test_no_two_runs_send_the_same_prompts():
    seeds = {
        routingbench.seed_of(index, policy, workload)
        for index, policy, workload in routingbench.schedule(3, list(routingbench.WORKLOADS))
    }
    assert len(seeds) == 3 * 2 * 3


def test_the_policies_alternate_which_goes_first():
    order = routingbench.schedule(3, ["w"])
    assert [policy for _index, policy, _workload in order] == [
        "least-conn", "cache-aware", "cache-aware", "least-conn", "least-conn", "cache-aware",
    ]  # fmt: skip


def test_the_router_environment_pins_the_release_and_every_dependency():
    lines = [
        line.strip()
        for line in router.REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+_-]+", line) for line in lines), lines
    assert f"vllm-router=={router.VERSION}" in lines
    names = {line.split("==")[0].lower().replace("_", "-") for line in lines}
    # What the wheel declares (its METADATA Requires-Dist), each pinned.
    assert {"setproctitle", "aiohttp", "orjson", "uvicorn", "fastapi", "requests"} <= names


def test_the_router_cache_key_follows_the_pinned_list(tmp_path, monkeypatch):
    pinned = tmp_path / "requirements.txt"
    pinned.write_text("vllm-router==0.1.17\n")
    monkeypatch.setattr(router, "REQUIREMENTS", pinned)
    monkeypatch.setenv("QCL_LAB_CACHE", str(tmp_path / "cache"))
    key = router.venv_key()
    assert router.venv_dir() == tmp_path / "cache" / f"vllm-router-{key}"
    pinned.write_text("vllm-router==0.1.18\n")
    assert router.venv_key() != key


def test_the_router_image_serves_the_port_its_command_names():
    container = standins.Container.from_inputs(
        "router-router",
        {
            "image": f"vllm/vllm-router:v{router.VERSION}",
            "command": [
                "vllm-router",
                "--host",
                "127.0.0.1",
                "--port",
                "30000",
                "--prometheus-port",
                "29000",
            ],
        },
    )
    assert standins.stand_in_for(container).kind == "router"
    assert standins.serves(container) == [30000]


def test_the_lab_file_carries_the_kv_size_and_the_engine_cores_only_when_set():
    image = "vllm/vllm-openai:v0.33.0"
    plain = standins.stand_in_for_image(image).spec(image, standins.LabKnobs())
    sized = standins.stand_in_for_image(image).spec(
        image, standins.LabKnobs(kv_cache_bytes=1024, engine_cores={"10.0.0.2": 1})
    )

    def lab_file(spec) -> str:
        return next(text for path, text, _mode in spec.files if path == "/etc/qcl-lab/image.json")

    assert "kv_cache_bytes" not in lab_file(plain) and "engine_cores" not in lab_file(plain)
    assert '"kv_cache_bytes": 1024' in lab_file(sized)
    assert '"engine_cores": {"10.0.0.2": 1}' in lab_file(sized)
