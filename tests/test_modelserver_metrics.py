"""The stand-in model server's /metrics speaks vLLM's names, which the alert rules read."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from labkit.cluster import probes
from labkit.models import modelserver, servermetrics
from qwen_cluster.render.monitoring import alerts
from tests.helpers.standin_server import serving
from tooling import stackfile


def test_metrics_use_vllms_names_and_parse_with_prometheus_client():
    settings = modelserver.Settings(node="n1", token_delay=0.0, think=0.05, tokens=3)
    with serving(settings) as (port, _):
        probes.stream("127.0.0.1", port, "hello")
        probes.chat("127.0.0.1", port, "hello")
        text = probes.get("127.0.0.1", port, "/metrics").body.decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    total = next(s.value for s in ttft.samples if s.name.endswith("_sum"))
    assert count == 2 and total >= 0.1  # both answers waited the 50 ms thinking pause
    # Every vLLM series the alert rules read is one the stand-in serves.
    rules = " ".join(alert.expr for alert in alerts.alerts(stackfile.load("onprem")))
    read = set(re.findall(r"vllm:[a-z_]+", rules))
    served = {s.name for family in families.values() for s in family.samples}
    assert read and read <= served


def test_the_stand_in_exposes_the_releases_core_families_and_the_alerts_read_only_those():
    settings = modelserver.Settings(node="n1")
    with serving(settings) as (port, _):
        text = probes.get("127.0.0.1", port, "/metrics").body.decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}
    # prometheus_client's parser names a counter family without its _total suffix.
    assert families == servermetrics.VLLM_FAMILIES
    rules = " ".join(alert.expr for alert in alerts.alerts(stackfile.load("onprem")))
    read = {re.sub(r"_(bucket|sum|count|total)$", "", name) for name in re.findall(r"vllm:[a-z_]+", rules)}
    assert read <= set(servermetrics.VLLM_FAMILIES)
