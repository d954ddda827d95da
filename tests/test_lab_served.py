"""What the lab's check counts as reaching a model server: vLLM's own /metrics counters
(labkit/models/servermetrics.py), which the stand-in writes as vLLM does, read the same way on both."""

from __future__ import annotations

from labkit.cluster import probes, served
from labkit.models import modelserver, servermetrics
from tests.helpers.standin_server import serving

# As vLLM 0.32's /metrics writes it (prometheus_client): label order method, status, handler.
REAL = """# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{method="GET",status="2xx",handler="/v1/models"} 3.0
http_requests_total{method="POST",status="2xx",handler="/v1/chat/completions"} 5.0
http_requests_total{method="POST",status="4xx",handler="/v1/chat/completions"} 1.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-32B"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-32B"} 3.0
"""


def test_the_releases_counters_are_read_by_handler_and_summed():
    wanted = {("GET", "/v1/models"): 3.0, ("POST", "/v1/chat/completions"): 6.0}
    assert servermetrics.by_handler(REAL) == wanted
    assert servermetrics.total(REAL, servermetrics.SUCCESS) == 5.0
    declared_only = "# HELP http_requests_total x\n# TYPE http_requests_total counter\n"
    assert servermetrics.by_handler(declared_only) == {}  # before its first request: 0, not absent


def test_a_server_without_the_counters_is_not_counted_as_nothing_reached():
    """A vacuous 0 would pass `none reaches a model server` without measuring anything."""
    before = {"master": served.Served(None, None, None)}
    assert served.reached(before, before) is None
    assert served.counted(None).startswith("not counted")


def test_a_request_that_reached_a_server_is_counted_and_named():
    before = {"master": served.Served({("GET", "/v1/models"): 3.0}, 5.0, None)}
    after = {"master": served.Served({("GET", "/v1/models"): 3.0, ("POST", "none"): 1.0}, 5.0, None)}
    assert served.reached(before, after) == 1
    assert served.leaked(before, after) == {"POST none": 1.0}


def test_the_stand_in_counts_as_vllms_instrumentator_and_confirms_its_pause():
    settings = modelserver.Settings(node="n1", tokens=3)
    with serving(settings) as (port, _):
        for path in ("/v1/models", "/health", "/metrics", "/v1/responses/resp_lab", "/nope", "/v1/../me"):
            probes.request("127.0.0.1", port, "GET", path)
        probes.chat("127.0.0.1", port, max_tokens=2)
        streamed = probes.stream("127.0.0.1", port, headers={modelserver.THINK_HEADER: "0.2"})
        text = probes.get("127.0.0.1", port, "/metrics").body.decode()
    assert servermetrics.by_handler(text) == {
        ("GET", "/v1/models"): 1.0,
        ("GET", "/v1/responses/{response_id}"): 1.0,
        ("GET", "none"): 2.0,  # /nope, /v1/../me: no route
        ("POST", "/v1/chat/completions"): 2.0,
    }
    assert servermetrics.total(text, servermetrics.SUCCESS) == 2.0
    assert streamed.ok and streamed.think == 0.2 and streamed.longest_silence >= 0.2
