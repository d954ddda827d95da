"""The routing benchmark's workloads driven by vLLM's own benchmark client, `vllm bench serve`
(the vLLM CPU environment's, labkit/models/realvllm.py), against any OpenAI endpoint: the lab's
or a user's own cluster (URL, the key from the environment, the CA), with the same figures as
labkit/cluster/routingbench.py (`figures`: hit rate and uncached prompt tokens per replica
from the replicas' own counters where they can be read, TTFT p50/p90, output throughput, errors).

- shared-prefix: `--dataset-name prefix_repetition`, the shape of routingbench.shared_prefix
  (12 prefixes of ~4,000 tokens, a ~40-token question each, 96 requests, 16 output tokens) and
  of inference-perf's shared-prefix generator (groups of prompts sharing a system prompt).
- no-reuse: `--dataset-name random`, 48 prompts of 4,000 tokens.
- multi-turn: `vllm bench serve` has no conversation dataset in 0.32 (its `--dataset-name`
  choices); routingbench's own client drives it.

`vllm bench serve` reads the key from OPENAI_API_KEY (its openai backends send
`Authorization: Bearer`) and trusts the CA through SSL_CERT_FILE (aiohttp's default SSL context,
OpenSSL's default paths); it writes its figures as JSON (`--save-result`).
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

# (dataset flags) per workload, mirroring routingbench.WORKLOADS.
DATASETS: dict[str, list[str]] = {
    "shared-prefix": [
        "--dataset-name=prefix_repetition",
        "--prefix-repetition-num-prefixes=12",
        "--prefix-repetition-prefix-len=4000",
        "--prefix-repetition-suffix-len=40",
        f"--prefix-repetition-output-len={routingbench.MAX_TOKENS}",
        "--num-prompts=96",
    ],
    "no-reuse": [
        "--dataset-name=random",
        "--random-input-len=4000",
        f"--random-output-len={routingbench.MAX_TOKENS}",
        "--num-prompts=48",
    ],
}


def argv(
    vllm: str, base_url: str, workload: str, seed: int, tokenizer: str, result_dir: str, result_file: str
) -> list[str]:
    """`vllm bench serve` for `workload` through `base_url` (chat completions, streamed),
    routingbench.CONCURRENCY in flight, every answer MAX_TOKENS long (`--ignore-eos`)."""
    if workload not in DATASETS:
        raise ValueError(f"workload {workload!r}: vllm bench serve runs {sorted(DATASETS)}")
    return [
        vllm,
        "bench",
        "serve",
        "--backend=openai-chat",
        f"--base-url={base_url.rstrip('/')}",
        "--endpoint=/v1/chat/completions",
        f"--model={routingbench.MODEL}",
        f"--tokenizer={tokenizer}",
        f"--max-concurrency={routingbench.CONCURRENCY}",
        f"--seed={seed}",
        "--ignore-eos",
        "--temperature=0",
        "--percentile-metrics=ttft",
        "--metric-percentiles=50,90",
        "--disable-tqdm",
        "--save-result",
        f"--result-dir={result_dir}",
        f"--result-filename={result_file}",
        *DATASETS[workload],
    ]


def environment(endpoint: routingbench.Endpoint) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the lab's own packages would shadow the environment's
    if endpoint.api_key:
        env["OPENAI_API_KEY"] = endpoint.api_key
    if endpoint.ca_file:
        env["SSL_CERT_FILE"] = endpoint.ca_file
    return env


def figures_of(result: dict[str, Any], before: dict, after: dict, seconds: float) -> dict[str, Any]:
    """vllm bench serve's JSON and the replicas' counters as routingbench's figures."""
    replicas = routingbench.figures([], seconds, before, after) if after else {}
    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", 0) or (result.get("num_prompts", completed) - completed))
    p50, p90 = result.get("median_ttft_ms") or result.get("p50_ttft_ms"), result.get("p90_ttft_ms")
    return {
        "tool": "vllm bench serve",
        "requests": completed + failed,
        "errors": failed,
        "prefixCacheHitRate": replicas.get("prefixCacheHitRate"),
        "ttftP50Seconds": round(p50 / 1000, 4) if p50 is not None else None,
        "ttftP90Seconds": round(p90 / 1000, 4) if p90 is not None else None,
        "outputTokensPerSecond": round(float(result.get("output_throughput", 0.0)), 2),
        "busiestReplicaRatio": replicas.get("busiestReplicaRatio"),
        "uncachedPromptTokens": replicas.get("uncachedPromptTokens"),
        "requestsPerReplica": replicas.get("requestsPerReplica"),
        "seconds": round(float(result.get("duration", seconds)), 1),
    }


def run(
    vllm: str,
    endpoint: routingbench.Endpoint,
    workload: str,
    seed: int,
    tokenizer: str,
    read_counters: Callable[[], dict[str, dict[str, float]]] | None = None,
) -> dict[str, Any]:
    """One run of `workload` by `vllm bench serve` through `endpoint`; `read_counters` (None for
    an endpoint whose replicas it cannot read) reads every replica's routingbench.COUNTERS."""
    with tempfile.TemporaryDirectory(prefix="qcl-vllm-bench-") as directory:
        command = argv(vllm, endpoint.base_url, workload, seed, tokenizer, directory, "result.json")
        before = read_counters() if read_counters else {}
        started = time.monotonic()
        done = subprocess.run(command, env=environment(endpoint), capture_output=True, text=True)
        seconds = time.monotonic() - started
        after = read_counters() if read_counters else {}
        path = Path(directory) / "result.json"
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"vllm bench serve exited {done.returncode}: {done.stderr[-2000:]}")
        return figures_of(json.loads(path.read_text()), before, after, seconds)
