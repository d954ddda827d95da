"""loadBalancer.routing: its values, the router's port row, and every refusal naming the key."""

from __future__ import annotations

import pytest

from qwen_cluster import ports
from qwen_cluster.config import ConfigError, validate

BASE_ROWS = [
    {"name": "model-service", "port": 5000, "scope": "clients"},
    {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
]


def errors_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(raw)
    return caught.value.errors


@pytest.mark.parametrize("target", ["aws_raw", "bare_metal_raw"])
def test_routing_defaults_to_least_conn_without_a_router_row(target, request):
    cluster = validate(request.getfixturevalue(target))
    assert cluster.load_balancer.routing == "least-conn"
    assert cluster.router_port is None
    assert ports.ROUTER not in {entry.name for entry in cluster.ports}


def test_cache_aware_routing_adds_the_router_row_member_only(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    cluster = validate(bare_metal_raw)
    assert cluster.router_port == 30000
    row = next(entry for entry in cluster.ports if entry.name == ports.ROUTER)
    assert row.scope is ports.Scope.CLUSTER


def test_a_written_table_gets_the_router_row_too(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    bare_metal_raw["ports"] = BASE_ROWS
    assert validate(bare_metal_raw).router_port == 30000


def test_a_written_router_row_moves_the_router(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    bare_metal_raw["ports"] = [*BASE_ROWS, {"name": "router", "port": 6200, "scope": "cluster"}]
    assert validate(bare_metal_raw).router_port == 6200


def test_an_unknown_routing_is_refused_naming_the_key(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "round-robin"}
    assert errors_of(bare_metal_raw) == [
        "loadBalancer.routing 'round-robin': Input should be 'least-conn', 'cache-aware' or 'kv-aware'"
    ]


def test_a_router_row_clients_may_reach_is_refused(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    bare_metal_raw["ports"] = [*BASE_ROWS, {"name": "router", "port": 30000, "scope": "monitoring"}]
    assert errors_of(bare_metal_raw) == [
        "ports entry router (30000, scope monitoring) must be a single port with scope cluster for "
        "loadBalancer.routing cache-aware: the router's admin routes share its listener, so no client "
        "may reach it"
    ]


def test_a_taken_router_port_asks_for_a_router_row(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    bare_metal_raw["ports"] = [*BASE_ROWS, {"name": "other", "port": 30000, "scope": "cluster"}]
    assert errors_of(bare_metal_raw) == [
        "loadBalancer.routing cache-aware needs a ports entry named router, and its default port 30000 "
        "is taken by other (30000); add {name: router, port: <free port>, scope: cluster, required: false}"
    ]


def test_the_router_metrics_port_must_stay_clear_of_the_table(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    bare_metal_raw["ports"] = [*BASE_ROWS, {"name": "extra", "port": 29000, "scope": "cluster"}]
    assert errors_of(bare_metal_raw) == [
        "ports[2].port 29000 (extra) includes 29000, where the router's metrics listen on loopback "
        "(loadBalancer.routing cache-aware)"
    ]


def test_least_conn_leaves_the_router_ports_free(bare_metal_raw):
    bare_metal_raw["ports"] = [*BASE_ROWS, {"name": "extra", "port": 29000, "scope": "cluster"}]
    assert validate(bare_metal_raw).router_port is None


def test_cache_aware_routing_is_accepted_on_aws_with_the_router_and_its_workers_rows(aws_raw):
    aws_raw["loadBalancer"] = {"routing": "cache-aware"}
    cluster = validate(aws_raw)
    assert (cluster.router_port, cluster.router_worker_port) == (30000, 30001)
    rows = {entry.name: entry for entry in cluster.ports}
    assert rows[ports.ROUTER].scope is rows[ports.ROUTER_WORKER].scope is ports.Scope.CLUSTER
    # The router on the master, for every node's proxy.
    assert cluster.router_node == cluster.master


def test_bare_metal_has_no_router_worker_row(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "cache-aware"}
    cluster = validate(bare_metal_raw)
    assert cluster.router_worker_port is None
    assert ports.ROUTER_WORKER not in {entry.name for entry in cluster.ports}


def test_a_router_worker_row_clients_may_reach_is_refused_on_aws(aws_raw):
    aws_raw["loadBalancer"] = {"routing": "cache-aware"}
    aws_raw["ports"] = [*BASE_ROWS, {"name": "router-worker", "port": "30001-30002", "scope": "admin"}]
    assert errors_of(aws_raw) == [
        "ports entry router-worker (30001-30002, scope admin) must be a single port with scope cluster "
        "for loadBalancer.routing cache-aware: the proxies check no key there, so no client may reach it"
    ]


def test_a_taken_router_worker_port_asks_for_its_row_on_aws(aws_raw):
    aws_raw["loadBalancer"] = {"routing": "cache-aware"}
    aws_raw["ports"] = [*BASE_ROWS, {"name": "other", "port": 30001, "scope": "cluster"}]
    assert errors_of(aws_raw) == [
        "loadBalancer.routing cache-aware needs a ports entry named router-worker, and its default "
        "port 30001 is taken by other (30001); add {name: router-worker, port: <free port>, scope: cluster, "
        "required: false}"
    ]


def test_the_scale_out_flag_is_the_programs_refused_in_vllm_flags(bare_metal_raw):
    bare_metal_raw["model"] = {"vllmFlags": {"--enable-scale-out": True}}
    assert errors_of(bare_metal_raw) == [
        "model.vllmFlags --enable-scale-out True is set by the program from loadBalancer.routing "
        "(cache-aware, kv-aware: vLLM's router tokenizes through it); remove it"
    ]
