"""What a model server exposes on /metrics, as vLLM's API server does, and the lab's reading of it:
the stand-in (labkit/models/modelserver.py) writes it, `check` reads it, the same way on both engines.

vLLM attaches prometheus-fastapi-instrumentator to its app (vllm/entrypoints/serve/instrumentator/
metrics.py: `Instrumentator(excluded_handlers=[...]).add().instrument(app)`). Its default metric
`http_requests_total` (prometheus_fastapi_instrumentator/metrics.py `default`: labels method,
status, handler) counts a request once it is answered (middleware.py `__call__`, in `finally`):
`handler` is the route's template (`/v1/responses/{response_id}`), `none` for a path no route has
(should_group_untemplated), `status` grouped (`2xx`, should_group_status_codes), and a request is
not counted when an excluded pattern is found (`re.search`) in its handler, or, untemplated, in
its raw path. The engine's own `vllm:request_success_total` (vllm/v1/metrics/loggers.py,
labelled finished_reason) counts the requests it finished.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

# vLLM's bounds for vllm:time_to_first_token_seconds (a subset; +Inf is the count).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM's FinishReason, in order (vllm/v1/engine/__init__.py FINISH_REASON_STRINGS).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# The release's core metric families (vllm/v1/metrics/loggers.py PrometheusStatLogger: the ones
# labelled model_name and engine, always registered), by type. Counters are exposed with
# prometheus_client's `_total` suffix, as the real /metrics shows them.
VLLM_FAMILIES: dict[str, str] = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_num_preemptions": "histogram",
}
# The stand-in's "KV cache": this many concurrent requests fill it.
KV_SLOTS = 64
REQUESTS = "http_requests_total"
REQUESTS_HELP = "Total number of requests by method, status and handler."
SUCCESS = "vllm:request_success_total"
# vLLM 0.32/0.33's excluded_handlers (vllm/entrypoints/serve/instrumentator/metrics.py): requests
# to these are never counted, by the stand-in either.
EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
UNTEMPLATED = "none"


def _pattern(template: str) -> re.Pattern[str]:
    """Starlette's path matching for a template with `{name}` parameters (one path segment)."""
    parts = re.split(r"(\{[^}]+\})", template)
    return re.compile("".join("[^/]+" if part.startswith("{") else re.escape(part) for part in parts) + "$")


def handler(path: str, templates: Iterable[str]) -> tuple[str, bool]:
    """The template of the first route that matches `path` (templated), else the raw path."""
    for template in templates:
        if _pattern(template).match(path):
            return template, True
    return path, False


def excluded(name: str) -> bool:
    return any(re.search(pattern, name) for pattern in EXCLUDED_HANDLERS)


def count(counts: Counter, method: str, path: str, status: int, templates: Iterable[str]) -> None:
    """One answered request into `counts` ((method, status group, handler) -> n), as the
    instrumentator counts it."""
    name, templated = handler(path, templates)
    if excluded(name):
        return
    counts[(method, f"{str(status)[0]}xx", name if templated else UNTEMPLATED)] += 1


def exposition(counts: Counter) -> list[str]:
    lines = [f"# HELP {REQUESTS} {REQUESTS_HELP}", f"# TYPE {REQUESTS} counter"]
    for (method, status, name), value in sorted(counts.items()):
        lines.append(f'{REQUESTS}{{method="{method}",status="{status}",handler="{label(name)}"}} {value:.1f}')
    return lines


def _parsed(text: str) -> list:
    """Every sample of a Prometheus text exposition, read by prometheus_client's own parser (the
    one reading of /metrics in the lab). Imported here, not with the module: the stand-in model
    server imports this module for its names inside the lab's image, whose packages are
    standins.APP_PACKAGES (no prometheus_client); only the host reads expositions."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one metric in a Prometheus text exposition: (labels, value)."""
    return [(dict(sample.labels), sample.value) for sample in _parsed(text) if sample.name == name]


def summed(text: str) -> dict[str, float]:
    """Every sample name of an exposition with its values summed over their labels (one engine and
    one model per server in the lab), histogram buckets left out (their _sum and _count stay)."""
    found: dict[str, float] = {}
    for sample in _parsed(text):
        if not sample.name.endswith("_bucket"):
            found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def declared(text: str, name: str) -> bool:
    """The exposition has the metric, maybe with no sample yet (a labelled counter before its
    first count: prometheus_client writes its HELP and TYPE lines only)."""
    return re.search(rf"^# TYPE {re.escape(name)} ", text, re.M) is not None or bool(samples(text, name))


def by_handler(text: str) -> dict[tuple[str, str], float] | None:
    """http_requests_total summed by (method, handler); None when the server has no such metric."""
    if not declared(text, REQUESTS):
        return None
    counts: dict[tuple[str, str], float] = {}
    for labels, value in samples(text, REQUESTS):
        key = (labels.get("method", "?"), labels.get("handler", "?"))
        counts[key] = counts.get(key, 0.0) + value
    return counts


def total(text: str, name: str) -> float | None:
    """The sum of a metric's samples; None when the exposition has no such metric."""
    return sum(value for _, value in samples(text, name)) if declared(text, name) else None


def vllm_families(stats, model: str) -> list[str]:
    """VLLM_FAMILIES with the stand-in's own counts (labkit/models/modelserver.py Stats) where it has them
    (0 elsewhere)."""
    labels = f'model_name="{model}",engine="0"'
    values = {
        "vllm:num_requests_running": stats.running,
        "vllm:num_requests_waiting": max(0, stats.running - KV_SLOTS),
        "vllm:kv_cache_usage_perc": min(stats.running, KV_SLOTS) / KV_SLOTS,
        "vllm:prompt_tokens": stats.prompt_tokens,
        "vllm:generation_tokens": stats.tokens,
        "vllm:num_preemptions": 0,
    }
    lines: list[str] = []
    for name, kind in VLLM_FAMILIES.items():
        exposed = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {exposed} vLLM's {name} (stand-in).", f"# TYPE {exposed} {kind}"]
        if name == "vllm:request_success":
            # One series per FinishReason, from the start (vllm/v1/metrics/loggers.py
            # counter_request_success; names from vllm/v1/engine/__init__.py).
            for reason in FINISH_REASONS:
                lines.append(f'{exposed}{{{labels},finished_reason="{reason}"}} {stats.finished[reason]}')
        elif name == "vllm:time_to_first_token_seconds":
            lines += histogram(
                name, labels, TTFT_BUCKETS, stats.ttft_buckets, stats.ttft_sum, stats.ttft_count
            )
        elif kind == "histogram":
            lines += histogram(name, labels, (), [], 0.0, 0)
        else:
            lines.append(f"{exposed}{{{labels}}} {values[name]:g}")
    return lines


def histogram(name: str, labels: str, buckets: tuple[float, ...], counts: list[int], total: float, n: int):
    for bound, count in zip(buckets, counts, strict=True):
        yield f'{name}_bucket{{{labels},le="{bound}"}} {count}'

    yield f'{name}_bucket{{{labels},le="+Inf"}} {n}'
    yield f"{name}_sum{{{labels}}} {total:.6f}"
    yield f"{name}_count{{{labels}}} {n}"


def label(value: str) -> str:
    """A Prometheus label value: a client's path may hold quotes, backslashes, anything."""
    printable = "".join(char if char.isprintable() else "?" for char in value)
    return printable.replace("\\", "\\\\").replace('"', '\\"')
