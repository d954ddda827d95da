"""Disaggregated stacks rendered by the real program under Pulumi's mocks: on bare metal the model
containers with their pool's NIXL settings, the router in P/D mode, nginx's worker listeners and a
rollout that never calls the P/D router's admin routes; on AWS the model-server document's P/D
membership and each node's parameters."""

from __future__ import annotations

import base64
import json

import pytest

from qwen_cluster import tags
from qwen_cluster.render import nginx, router
from tests.helpers.aws_stacks import render as render_aws
from tests.helpers.aws_stacks import variant
from tests.helpers.baremetal import ONPREM_DISAGGREGATED, disaggregated_stack
from tooling import offline

POOLS = {
    "mode": "disaggregated",
    "prefill": {"nodes": ["master", "worker-1"]},
    "decode": {"nodes": ["worker-2", "worker-3"]},
}


@pytest.fixture(scope="module")
def onprem() -> offline.Render:
    return offline.render(disaggregated_stack(), "onprem")


@pytest.fixture(scope="module")
def prod() -> offline.Render:
    return render_aws(variant("prod", serving=POOLS), "prod")


def _envs(container) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in container.inputs["envs"])


def test_each_model_container_takes_its_pools_role(onprem):
    roles = {}
    for node in ONPREM_DISAGGREGATED.nodes:
        command = onprem.named(f"{node.name}-model-vllm").inputs["command"][0]
        flag = command.split("'--kv-transfer-config=", 1)[1].split("'", 1)[0]
        roles[node.name] = json.loads(flag)["kv_role"]
    producer, consumer = "kv_producer", "kv_consumer"
    assert roles == {"master": producer, "worker-1": producer, "worker-2": consumer, "worker-3": consumer}


def test_each_model_container_advertises_its_own_side_channel(onprem):
    env = _envs(onprem.named("worker-3-model-vllm"))
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.1.103"
    assert env["UCX_TCP_PORT_RANGE"] == "5601-5680"


def test_the_router_container_runs_in_pd_mode(onprem):
    container = onprem.named("router-router")
    assert container.inputs["command"] == router.command(ONPREM_DISAGGREGATED)
    assert "--vllm-pd-disaggregation" in container.inputs["command"]
    assert {"label": tags.CONTAINER_ROLE_LABEL, "value": tags.ROUTER_CONTAINER} in container.inputs["labels"]


def test_nginx_carries_a_worker_listener_per_replica(onprem):
    script = onprem.named("load-balancer-config").inputs["create"]
    for index in range(4):
        assert f"listen 127.1.0.{index + 1}:5000;" in script
    assert nginx.drain_marker(nginx.CONTAINER_CONF_DIR, "192.168.1.100") in script


def test_the_rollout_marks_drains_and_never_calls_the_admin_routes(onprem):
    drain = onprem.named("worker-1-drain").inputs["update"]
    ready = onprem.named("worker-1-ready").inputs["update"]
    assert "worker_url=http://127.1.0.2:5000" in drain and "\npd_leave\n" in drain
    assert "\npd_join\n" in ready
    assert "/add_worker" not in drain + ready and "/remove_worker" not in drain + ready


def test_the_aws_document_takes_replicas_out_through_their_proxy(prod):
    content = json.loads(prod.named("model-server-document").inputs["content"])
    run = "\n".join(content["mainSteps"][0]["inputs"]["runCommand"])
    assert "drain_conf=/etc/qwen-cluster/proxy/drain.conf" in run and "router_wait_state unhealthy" in run
    assert "/add_worker" not in run.split("router_leave() {", 1)[1].split("}", 1)[0]


def test_each_aws_proxy_reads_its_drain_file(prod):
    parameters = prod.named("node-proxy-worker-2").inputs["parameters"]
    conf = base64.b64decode(parameters["NginxConf"]).decode()
    assert f"include {nginx.CONTAINER_CONF_DIR}/drain*.conf;" in conf
