"""The routing benchmark's workloads, client and figures, against any base URL: `least-conn`
against vLLM's router (`cache-aware`) on real vLLM replicas (labkit/cluster/routinglab.py runs them).

- Workloads (`WORKLOADS`, pure and seeded): `shared-prefix` (tenants with a long shared context
  asking short questions), `multi-turn` (sessions whose history grows turn by turn, each turn
  sent after the previous answer, with that answer in the history), `no-reuse` (random prompts,
  the null case). Sized against the replicas' KV cache (`KV_CACHE_BYTES`): each one's working
  set fits the cluster's cache but not one replica's.
- The client streams chat completions with the standard library (threads, http.client, TLS with
  the lab's CA, the API key), `CONCURRENCY` at a time, and times the first token.
- The figures come from vLLM's own counters, read from every replica before and after a run:
  the cluster's prefix-cache hit rate (vllm:prefix_cache_hits / vllm:prefix_cache_queries, in
  tokens) and each replica's uncached prompt tokens (vllm:prompt_tokens - hits), whose busiest
  over the mean is `busiestReplicaRatio`.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import statistics
import string
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from labkit.models import servermetrics

MODEL = "Qwen/Qwen3-32B"
# vLLM's CPU build caches full 128-token blocks (vllm/platforms/cpu.py); the tiny Qwen3
# (labkit/models/tinymodel.py: 2 layers x 2 KV heads x head_dim 32 x 2 (K and V) x bf16) costs
# 512 bytes of KV per token.
KV_BYTES_PER_TOKEN = 512
# Each replica's KV cache: 32,768 usable tokens (the rendered --max-model-len; vLLM's KV
# manager keeps one 128-token block out of use, so one block more is given: with exactly 16 MiB
# vLLM 0.32 refuses to start, "the estimated maximum model length is 32640"). Every workload's
# working set is ~1.4-1.5x one replica's cache (it does not fit one) and ~0.7-0.75x the two
# replicas' 65,536 tokens (it fits the cluster's). Without that pressure least_conn replicas end
# up holding every prefix and routing saves only each prefix's first miss.
KV_CACHE_BYTES = (32768 + 128) * KV_BYTES_PER_TOKEN
KV_TOKENS_PER_REPLICA = 32768
# Requests in flight at once (a closed loop): two per replica.
CONCURRENCY = 4
# Answers are short (the prompt's prefill is what routing saves); `ignore_eos` makes every
# answer this long, so output throughput compares like with like.
MAX_TOKENS = 16
# The tiny model's tokenizer is byte-level with 518 tokens (labkit/models/tinymodel.py): random lower
# case letters and spaces come to ~0.93 tokens a character (measured), so a text of N
# characters is ~N tokens; the figures use vLLM's own token counts.
ALPHABET = string.ascii_lowercase + "      "


def random_text(rng: random.Random, characters: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(characters)).strip() or "x"


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    working_set_tokens: int
    build: Callable[[random.Random], list[list[dict[str, Any]]]]  # chains; see Chain


# A workload is a list of chains: each chain's requests go one after another (a session's
# turns), chains run CONCURRENCY at a time. A request is its messages; a turn marked `reply`
# gets the previous answer appended to its history before it is sent.


def shared_prefix(rng: random.Random, tenants: int = 12, context: int = 4000, requests: int = 96) -> list:
    """`tenants` long shared contexts (>= 3.5k tokens: on the tiny model a cold 7k-token prefill
    costs ~180 ms against ~13 ms cached; at 1.8k the difference drowns in noise), each asked short
    questions in random order; every request stands alone."""
    contexts = [f"tenant {index}: " + random_text(rng, context) for index in range(tenants)]
    chains = []
    for _ in range(requests):
        tenant = rng.randrange(tenants)
        question = random_text(rng, 40)
        chains.append(
            [
                {
                    "messages": [
                        {"role": "system", "content": contexts[tenant]},
                        {"role": "user", "content": question},
                    ]
                }
            ]
        )
    return chains


def multi_turn(
    rng: random.Random, sessions: int = 10, opening: int = 1200, turn: int = 600, turns: int = 7
) -> list:
    """`sessions` conversations: an opening message, then `turns` - 1 more, each ~`turn` tokens,
    each sent with the whole history so far (the answers included), so the history grows to
    ~opening + (turns - 1) x turn tokens."""
    chains = []
    for index in range(sessions):
        chain = [
            {"messages": [{"role": "user", "content": f"session {index}: " + random_text(rng, opening)}]}
        ]
        chain += [
            {"reply": True, "messages": [{"role": "user", "content": random_text(rng, turn)}]}
            for _ in range(turns - 1)
        ]
        chains.append(chain)
    rng.shuffle(chains)
    return chains


def no_reuse(rng: random.Random, requests: int = 48, length: int = 4000) -> list:
    """Prompts of ~`length` tokens that share nothing (each starts with its own random text)."""
    return [[{"messages": [{"role": "user", "content": random_text(rng, length)}]}] for _ in range(requests)]


WORKLOADS: dict[str, Workload] = {
    "shared-prefix": Workload(
        "shared-prefix", "12 tenants x 4,000-token context, 96 questions", 12 * 4000, shared_prefix
    ),
    "multi-turn": Workload(
        "multi-turn", "10 sessions x 7 turns, history to ~4,800 tokens", 10 * 4800, multi_turn
    ),
    "no-reuse": Workload("no-reuse", "48 random 4,000-token prompts", 48 * 4000, no_reuse),
}


# ---------------------------------------------------------------- the client


@dataclass(frozen=True)
class Endpoint:
    """Where the requests go: a base URL (http or https), the API key, the CA to trust."""

    base_url: str
    api_key: str | None = field(default=None, repr=False)
    ca_file: str | None = None

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme == "https":
            context = ssl.create_default_context(cafile=self.ca_file)
            return http.client.HTTPSConnection(
                url.hostname, url.port or 443, timeout=timeout, context=context
            )
        return http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)

    def path(self, path: str) -> str:
        return urllib.parse.urlsplit(self.base_url).path.rstrip("/") + path


@dataclass
class Result:
    ok: bool
    status: int
    ttft: float | None
    seconds: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    answer: str = ""
    error: str = ""


def complete(
    endpoint: Endpoint, messages: list[dict[str, Any]], timeout: float = 300.0, max_tokens: int | None = None
) -> Result:
    """One streamed chat completion: the time to its first token, its usage, its text."""
    body = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens or MAX_TOKENS,
        "ignore_eos": True,  # vLLM's sampling extension: every answer MAX_TOKENS long
        "temperature": 0,
        # Qwen3's template with thinking off: the text lands in `content` (with the qwen3
        # reasoning parser a random model never closes </think>).
        "chat_template_kwargs": {"enable_thinking": False},
    }
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    started = time.monotonic()
    result = Result(False, 0, None, 0.0)
    conn = endpoint.connection(timeout)
    try:
        conn.request("POST", endpoint.path("/v1/chat/completions"), json.dumps(body), headers)
        response = conn.getresponse()
        result.status = response.status
        if response.status != 200:
            result.error = response.read(500).decode(errors="replace")
            return result
        text, done = [], False
        while line := response.readline():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning") or ""
                if piece and result.ttft is None:
                    result.ttft = time.monotonic() - started
                text.append(piece)
            if event.get("usage"):
                result.prompt_tokens = event["usage"]["prompt_tokens"]
                result.completion_tokens = event["usage"]["completion_tokens"]
        result.answer = "".join(text)
        result.ok = done and result.ttft is not None
        if not result.ok:
            result.error = "stream ended without [DONE]" if not done else "no token"
    except (OSError, http.client.HTTPException, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        result.seconds = time.monotonic() - started
        conn.close()
    return result


def run_chains(
    endpoint: Endpoint, chains: list, concurrency: int = CONCURRENCY
) -> tuple[list[Result], float]:
    """Every chain's requests in order, `concurrency` chains at a time (threads; they inherit
    the caller's network namespace); the results and the wall time."""
    results: list[Result] = []
    lock = threading.Lock()
    pending: Iterator = iter(chains)

    def worker() -> None:
        while True:
            with lock:
                chain = next(pending, None)
            if chain is None:
                return
            history: list[dict[str, Any]] = []
            for request in chain:
                messages = [*history, *request["messages"]] if request.get("reply") else request["messages"]
                result = complete(endpoint, messages)
                with lock:
                    results.append(result)
                if not result.ok:
                    break  # a session whose turn failed stops; its error is counted
                history = [*messages, {"role": "assistant", "content": result.answer}]

    started = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.monotonic() - started


# ---------------------------------------------------------------- vLLM's counters

# The last one counts the requests each replica finished (vllm/v1/metrics/loggers.py
# `vllm:request_success`, by finished_reason, summed here): how the endpoint spread them.
COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
)


def counters(metrics_text: str) -> dict[str, float]:
    """COUNTERS summed over their labels (one model, one engine per replica here)."""
    found = servermetrics.summed(metrics_text)
    return {name: found.get(name, 0.0) for name in COUNTERS}


def figures(
    results: list[Result],
    seconds: float,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """One run's figures (the issue's names); `before`/`after`: each replica's counters."""
    hits = {replica: after[replica][COUNTERS[0]] - before[replica][COUNTERS[0]] for replica in after}
    queries = {replica: after[replica][COUNTERS[1]] - before[replica][COUNTERS[1]] for replica in after}
    prompts = {replica: after[replica][COUNTERS[2]] - before[replica][COUNTERS[2]] for replica in after}
    uncached = {replica: prompts[replica] - hits[replica] for replica in after}
    finished = {
        replica: after[replica].get(COUNTERS[3], 0.0) - before[replica].get(COUNTERS[3], 0.0)
        for replica in after
    }
    mean_uncached = statistics.fmean(uncached.values()) if uncached else 0.0
    ttfts = sorted(result.ttft for result in results if result.ok and result.ttft is not None)
    errors = [result for result in results if not result.ok]
    return {
        "requests": len(results),
        "errors": len(errors),
        # None without the replicas' counters (an endpoint whose replicas cannot be read).
        "prefixCacheHitRate": (
            round(sum(hits.values()) / sum(queries.values()), 4) if sum(queries.values()) else 0.0
        )
        if after
        else None,
        "ttftP50Seconds": round(_quantile(ttfts, 0.5), 4) if ttfts else None,
        "ttftP90Seconds": round(_quantile(ttfts, 0.9), 4) if ttfts else None,
        "outputTokensPerSecond": round(sum(result.completion_tokens for result in results) / seconds, 2),
        "busiestReplicaRatio": round(max(uncached.values()) / mean_uncached, 3) if mean_uncached else None,
        "seconds": round(seconds, 1),
        "promptTokens": sum(result.prompt_tokens for result in results),
        "uncachedPromptTokens": {replica: int(value) for replica, value in sorted(uncached.items())},
        "requestsPerReplica": {replica: int(value) for replica, value in sorted(finished.items())},
        "firstErrors": [f"{result.status} {result.error}"[:200] for result in errors[:3]],
    }


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted `values`, linearly interpolated (numpy's default)."""
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def run(
    endpoint: Endpoint,
    workload: str,
    seed: int,
    read_counters: Callable[[], dict[str, dict[str, float]]],
    concurrency: int = CONCURRENCY,
) -> dict[str, Any]:
    """One run of `workload` (its content drawn from `seed`) through `endpoint`; `read_counters`
    reads every replica's COUNTERS (labkit/cluster/routinglab.py reads them where the replicas are)."""
    chains = WORKLOADS[workload].build(random.Random(seed))
    before = read_counters()
    results, seconds = run_chains(endpoint, chains, concurrency)
    return figures(results, seconds, before, read_counters())


# ---------------------------------------------------------------- interleaved, median of runs

POLICIES = ("least-conn", "cache-aware")
# Every policy a benchmark may compare (the loopback one adds kv-aware: routinglab.up runs its
# router); a run's seed keeps its policy's place here, so adding one moves no other's prompts.
ALL_POLICIES = ("least-conn", "cache-aware", "kv-aware")
ROUTED = ("cache-aware", "kv-aware")
MEDIAN_OF = (
    "prefixCacheHitRate",
    "ttftP50Seconds",
    "ttftP90Seconds",
    "outputTokensPerSecond",
    "busiestReplicaRatio",
)


def schedule(
    rounds: int, workloads: list[str], policies: tuple[str, ...] = POLICIES
) -> list[tuple[int, str, str]]:
    """(round, policy, workload) in the order they run: policies interleaved round by round,
    their order alternating, so that none always runs on a machine another warmed."""
    order = []
    for index in range(rounds):
        ordered = policies if index % 2 == 0 else tuple(reversed(policies))
        order += [(index, policy, workload) for policy in ordered for workload in workloads]
    return order


def seed_of(round_index: int, policy: str, workload: str) -> int:
    """A seed per run: no run's prompts are another's, so no run finds its prefixes cached by
    the run before it (whatever that left is only something to evict, for every policy)."""
    return 1000 * round_index + 100 * ALL_POLICIES.index(policy) + sorted(WORKLOADS).index(workload)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the runs (errors and requests summed), the runs beside."""
    summary: dict[str, Any] = {"runs": len(runs)}
    summary["requests"] = sum(run["requests"] for run in runs)
    summary["errors"] = sum(run["errors"] for run in runs)
    for key in MEDIAN_OF:
        values = [run[key] for run in runs if run.get(key) is not None]
        summary[key] = round(statistics.median(values), 4) if values else None
    summary["each"] = [
        {
            **{key: run[key] for key in (*MEDIAN_OF, "requests", "errors", "seconds")},
            # Per replica, where the replicas' counters were read (by any tool).
            **{key: run[key] for key in ("requestsPerReplica", "uncachedPromptTokens") if run.get(key)},
        }
        for run in runs
    ]
    return summary


# The goals on cache-aware's figure over least-conn's: (workload, figure, its name, bound, at most).
RATIO_GOALS = (
    ("shared-prefix", "ttftP50Seconds", "TTFT p50", 0.8, True),
    ("multi-turn", "ttftP50Seconds", "TTFT p50", 0.9, True),
    ("no-reuse", "outputTokensPerSecond", "throughput", 0.9, False),
)


def verdicts(workloads: dict[str, dict[str, Any]]) -> list[str]:
    """Each goal of the benchmark, met or missed by how much."""
    lines = []

    def pairs(name: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """(routed policy, least-conn's summary, its summary) for each routed policy measured."""
        both = workloads.get(name) or {}
        if "least-conn" not in both:
            return []
        return [(policy, both["least-conn"], both[policy]) for policy in ROUTED if policy in both]

    def check(label: str, value: float | None, bound: float, at_most: bool) -> None:
        if value is None:
            lines.append(f"{label}: no figure")
            return
        met = value <= bound if at_most else value >= bound
        lines.append(
            f"{label}: {value:.3f} ({'<=' if at_most else '>='} {bound:.3f}) {'met' if met else 'MISSED'}"
        )

    def named(policy: str, label: str) -> str:
        # cache-aware's lines read as they always did; the others name their policy.
        return label if policy == "cache-aware" else f"{label} ({policy})"

    for policy, lc, ca in pairs("shared-prefix"):
        check(named(policy, "shared-prefix hit rate"), ca["prefixCacheHitRate"], 0.75, at_most=False)
        check(
            named(policy, "shared-prefix hit rate over least-conn's + 0.15"),
            ca["prefixCacheHitRate"],
            lc["prefixCacheHitRate"] + 0.15,
            at_most=False,
        )
    for workload, key, what, bound, at_most in RATIO_GOALS:
        for policy, lc, ca in pairs(workload):
            ratio = ca[key] / lc[key] if lc[key] and ca[key] is not None else None
            check(named(policy, f"{workload} {what} / least-conn's"), ratio, bound, at_most)
    for name, both in workloads.items():
        for policy, summary in both.items():
            if summary["errors"]:
                lines.append(f"{name} {policy}: {summary['errors']} errors MISSED")
        for policy in ROUTED:
            if policy in both:
                check(
                    f"{name} {policy} busiest replica / mean",
                    both[policy]["busiestReplicaRatio"],
                    1.25,
                    at_most=True,
                )
    return lines
