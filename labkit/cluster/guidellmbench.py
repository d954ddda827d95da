"""The routing benchmark's workloads driven by guidellm (vllm-project/guidellm 0.8.1, the cached
environment of labkit/models/guidellmenv.py), against any OpenAI endpoint: the lab's or a user's
own cluster (URL, the key from the environment, the CA), with the same figures as
labkit/cluster/routingbench.py (`figures`) and labkit/cluster/fieldbench.py (`vllm bench serve`).

Each workload is guidellm's own synthetic data (`synthetic_text`, guidellm/schemas/data/
deserializers/synthetic.py SyntheticTextDataArgs), shaped like routingbench.WORKLOADS:

- shared-prefix: `prefix_count` 12 prefixes of `prefix_tokens` 4,000 tokens (one bucket; each
  request draws one at random, guidellm/data/deserializers/synthetic.py _create_prefix_iter),
  sent as the system message before a 40-token question (guidellm/backends/openai/
  request_handlers.py: `prefix_column` becomes `{"role": "system"}`), 96 requests; the shape
  of inference-perf's shared-prefix generator too.
- multi-turn: 10 conversations of `turns` 7, a 1,200-token opening (`first_prompt_tokens`) then
  600-token turns, each sent with the whole history, the answers included (request_handlers.py
  _build_history_messages): 70 requests.
- no-reuse: 4,000-token prompts (each begins with text of its own, synthetic.py _create_prompt),
  48 requests.

Every answer is MAX_TOKENS long (guidellm sends `max_completion_tokens` with `ignore_eos` when
the data gives `output_tokens`), routingbench.CONCURRENCY in flight (`concurrent` profile),
streamed chat completions. The run is one scenario file (`guidellm run --scenario`); the key
reaches guidellm through its settings' environment, the CA through httpx's, and its figures come
from its own JSON report (`outputs: json`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labkit.cluster import routingbench

TOOL = "guidellm"
# (synthetic_text fields, requests) per workload, mirroring routingbench.WORKLOADS.
DATASETS: dict[str, tuple[dict[str, Any], int]] = {
    "shared-prefix": (
        {
            "prefix_count": 12,
            "prefix_tokens": 4000,
            "prompt_tokens": 40,
            "output_tokens": routingbench.MAX_TOKENS,
        },
        96,
    ),
    "multi-turn": (
        {
            "turns": 7,
            "first_prompt_tokens": 1200,
            "prompt_tokens": 600,
            "output_tokens": routingbench.MAX_TOKENS,
        },
        70,  # 10 conversations of 7 turns (max_requests counts each turn)
    ),
    "no-reuse": ({"prompt_tokens": 4000, "output_tokens": routingbench.MAX_TOKENS}, 48),
}
# guidellm's settings read the scenario's fields from the environment too (pydantic-settings,
# guidellm/schemas/benchmark/entrypoints.py BenchmarkScenario: env_prefix "GUIDELLM__", nested
# by "__"), merged under the scenario file's: the key stays off the command line and out of the
# file. The report writes it as "**********" (a SecretStr).
KEY_VARIABLE = "GUIDELLM__SPEC__BACKEND__API_KEY"


def scenario(base_url: str, workload: str, seed: int, tokenizer: str, report: str) -> dict[str, Any]:
    """guidellm's scenario (`guidellm run --scenario FILE`: the BenchmarkScenario schema) for
    `workload` through `base_url`."""
    if workload not in DATASETS:
        raise ValueError(f"workload {workload!r}: guidellm runs {sorted(DATASETS)}")
    data, requests = DATASETS[workload]
    return {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": base_url.rstrip("/"),
                "model": routingbench.MODEL,
                "request_format": "/v1/chat/completions",
                # guidellm's default is False (guidellm/schemas/backends/openai_http.py): an
                # endpoint's certificate would go unchecked. True: httpx checks it against
                # SSL_CERT_FILE when set (the CA; httpx/_config.py create_ssl_context), certifi's
                # roots otherwise.
                "verify": True,
            },
            "profile": {"kind": "concurrent", "streams": [routingbench.CONCURRENCY]},
            "constraints": [{"kind": "max_requests", "count": requests}],
            # A path: the served model's tokenizer counts the synthetic prompts' tokens.
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "data": [{"kind": "synthetic_text", **data}],
            "seed": {"kind": "static", "value": seed},
            "outputs": [{"kind": "json", "path": report}],
            # Every request's timings and token counts stay in the statistics; 0 leaves out
            # each request's prompt and answer (GenerativeMetricsArgs.sample_size).
            "metrics": {"kind": "generative", "sample_size": 0},
        }
    }


def argv(guidellm: str, scenario_file: str) -> list[str]:
    return [guidellm, "run", "--scenario", scenario_file, "--disable-console"]


def environment(endpoint: routingbench.Endpoint, tokenizer: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the lab's own packages would shadow the environment's
    if endpoint.api_key:
        env[KEY_VARIABLE] = endpoint.api_key
    if endpoint.ca_file:
        env["SSL_CERT_FILE"] = endpoint.ca_file
    if Path(tokenizer).is_dir():
        # A local tokenizer (the lab's tiny model): nothing to fetch from the Hugging Face Hub,
        # and transformers must not try (no network here but package registries).
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    return env


def figures_of(report: dict[str, Any], before: dict, after: dict, seconds: float) -> dict[str, Any]:
    """guidellm's JSON report (its one benchmark) and the replicas' counters as routingbench's
    figures. TTFT: its completed requests' percentiles, as its console's "Request Latency
    Statistics (Completed Requests)"; output throughput: the "total" status mean of
    output_tokens_per_second, its console's "Server Throughput Statistics" (guidellm/benchmark/
    outputs/console.py)."""
    (benchmark,) = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    replicas = routingbench.figures([], seconds, before, after) if after else {}
    p50, p90 = (ttft["percentiles"][key] if ttft["count"] else None for key in ("p50", "p90"))
    return {
        "tool": TOOL,
        "requests": int(totals["total"]),
        "errors": int(totals["errored"]) + int(totals["incomplete"]),
        "prefixCacheHitRate": replicas.get("prefixCacheHitRate"),
        "ttftP50Seconds": round(p50 / 1000, 4) if p50 is not None else None,
        "ttftP90Seconds": round(p90 / 1000, 4) if p90 is not None else None,
        "outputTokensPerSecond": round(float(metrics["output_tokens_per_second"]["total"]["mean"]), 2),
        "busiestReplicaRatio": replicas.get("busiestReplicaRatio"),
        "uncachedPromptTokens": replicas.get("uncachedPromptTokens"),
        "requestsPerReplica": replicas.get("requestsPerReplica"),
        "seconds": round(float(benchmark.get("duration", seconds)), 1),
    }


def run(
    guidellm: str,
    endpoint: routingbench.Endpoint,
    workload: str,
    seed: int,
    tokenizer: str,
    read_counters: Callable[[], dict[str, dict[str, float]]] | None = None,
    keep_report: Path | None = None,
) -> dict[str, Any]:
    """One run of `workload` by guidellm through `endpoint`; `read_counters` (None for an
    endpoint whose replicas it cannot read) reads every replica's routingbench.COUNTERS.
    `keep_report`: where to copy guidellm's own JSON report."""
    with tempfile.TemporaryDirectory(prefix="qcl-guidellm-") as directory:
        report = Path(directory) / "report.json"
        scenario_file = Path(directory) / "scenario.json"
        spec = scenario(endpoint.base_url, workload, seed, tokenizer, str(report))
        scenario_file.write_text(json.dumps(spec))
        before = read_counters() if read_counters else {}
        started = time.monotonic()
        done = subprocess.run(
            argv(guidellm, str(scenario_file)),
            env=environment(endpoint, tokenizer),
            capture_output=True,
            text=True,
            cwd=directory,  # guidellm writes nothing else, but a stray default output lands here
        )
        seconds = time.monotonic() - started
        after = read_counters() if read_counters else {}
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(f"guidellm exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
        if keep_report:
            keep_report.write_text(report.read_text())
        return figures_of(json.loads(report.read_text()), before, after, seconds)
