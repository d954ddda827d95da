"""serving: aggregated by default; disaggregated pools, backend, side-channel hosts and NIXL's port
rows, each refusal naming the key and the value."""

from __future__ import annotations

import copy

import pytest

from qwen_cluster import ports
from qwen_cluster.config import ConfigError, validate

POOLS = {"prefill": {"nodes": ["master", "worker-1"]}, "decode": {"nodes": ["worker-2", "worker-3"]}}


def errors_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(raw)
    return caught.value.errors


def disaggregated(raw: dict, **serving) -> dict:
    raw["serving"] = {"mode": "disaggregated", **copy.deepcopy(POOLS), **serving}
    if raw["target"] == "bare-metal":
        raw["bareMetal"]["gpuModel"] = "H100"
    return raw


@pytest.mark.parametrize("target", ["aws_raw", "bare_metal_raw"])
def test_serving_defaults_to_aggregated_without_nixl_rows_or_router(target, request):
    cluster = validate(request.getfixturevalue(target))
    assert cluster.serving.mode == "aggregated"
    assert not cluster.disaggregated and cluster.kv_backend is None and cluster.router_port is None
    names = {entry.name for entry in cluster.ports}
    assert ports.KV_SIDE_CHANNEL not in names and ports.KV_DATA not in names


def test_disaggregated_bare_metal_gets_side_channel_and_ucx_rows_and_the_router(bare_metal_raw):
    cluster = validate(disaggregated(bare_metal_raw))
    rows = {entry.name: entry for entry in cluster.ports}
    assert str(rows[ports.KV_SIDE_CHANNEL].port) == "5600"
    assert str(rows[ports.KV_DATA].port) == "5601-5680"
    assert {rows[name].scope for name in (ports.KV_SIDE_CHANNEL, ports.KV_DATA)} == {ports.Scope.CLUSTER}
    assert cluster.kv_backend == "ucx"
    assert cluster.router_port == 30000
    assert [cluster.serving.pool_of(node.name) for node in cluster.nodes] == [
        "prefill",
        "prefill",
        "decode",
        "decode",
    ]


def test_disaggregated_aws_uses_libfabric_and_has_no_ucx_range(aws_raw):
    cluster = validate(disaggregated(aws_raw))
    names = {entry.name for entry in cluster.ports}
    assert cluster.kv_backend == "libfabric"
    assert ports.KV_SIDE_CHANNEL in names and ports.KV_DATA not in names
    assert {ports.ROUTER, ports.ROUTER_WORKER} <= names


def test_ucx_on_efa_is_refused(aws_raw):
    errors = errors_of(disaggregated(aws_raw, kvTransfer={"backend": "ucx"}))
    assert any("serving.kvTransfer.backend ucx on aws" in error for error in errors)


def test_tcp_only_disaggregation_on_aws_is_refused(aws_raw):
    aws_raw["aws"]["efa"] = False
    errors = errors_of(disaggregated(aws_raw))
    assert any("needs aws.efa true" in error for error in errors)


def test_libfabric_on_bare_metal_is_refused(bare_metal_raw):
    errors = errors_of(disaggregated(bare_metal_raw, kvTransfer={"backend": "libfabric"}))
    assert any("serving.kvTransfer.backend libfabric on bare metal" in error for error in errors)


def test_a_pool_with_no_nodes_is_refused(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    raw["serving"]["decode"] = {"nodes": []}
    raw["serving"]["prefill"] = {"nodes": ["master", "worker-1", "worker-2", "worker-3"]}
    assert "serving.decode.nodes is empty: each pool needs at least one node" in errors_of(raw)


def test_a_missing_pool_is_refused(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    del raw["serving"]["decode"]
    assert any(error.startswith("serving.decode is required") for error in errors_of(raw))


def test_pools_split_the_nodes_exactly(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    raw["serving"]["prefill"] = {"nodes": ["master", "worker-2", "ghost"]}
    raw["serving"]["decode"] = {"nodes": ["worker-2"]}
    errors = errors_of(raw)
    assert "serving.prefill.nodes[2] ghost is not one of the nodes" in errors
    assert "node worker-2 is in both serving.prefill and serving.decode" in errors
    assert any(error.startswith("nodes worker-1, worker-3 are in neither") for error in errors)


@pytest.mark.parametrize("host", ["localhost", "0.0.0.0", "127.0.0.1", "::1"])
def test_a_side_channel_host_the_peer_cannot_reach_is_refused(bare_metal_raw, host):
    errors = errors_of(disaggregated(bare_metal_raw, kvTransfer={"sideChannelHosts": {"worker-2": host}}))
    assert any("sideChannelHosts.worker-2" in error and "advertises" in error for error in errors), errors


def test_side_channel_hosts_default_to_the_node_ip_and_name_nodes(bare_metal_raw):
    cluster = validate(
        disaggregated(bare_metal_raw, kvTransfer={"sideChannelHosts": {"worker-2": "10.9.0.2"}})
    )
    hosts = {node.name: cluster.kv_side_channel_host(node) for node in cluster.nodes}
    assert hosts == {"master": "192.168.1.100", "worker-1": "192.168.1.101", "worker-2": "10.9.0.2",
                     "worker-3": "192.168.1.103"}  # fmt: skip
    errors = errors_of(disaggregated(bare_metal_raw, kvTransfer={"sideChannelHosts": {"ghost": "10.9.0.2"}}))
    assert "serving.kvTransfer.sideChannelHosts.ghost is not one of the nodes" in errors


def test_pools_set_while_aggregated_are_refused(bare_metal_raw):
    bare_metal_raw["serving"] = {"prefill": {"nodes": ["master"]}}
    assert any(
        "serving.prefill is set but serving.mode is aggregated" in e for e in errors_of(bare_metal_raw)
    )


def test_pipeline_parallel_is_refused_with_disaggregation(bare_metal_raw):
    bare_metal_raw["model"] = {"pipelineParallel": 2}
    errors = errors_of(disaggregated(bare_metal_raw))
    assert any("needs model.pipelineParallel 1 (it is 2)" in error for error in errors)


def test_a_pool_tensor_parallel_is_checked_like_the_model_s(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    raw["serving"]["decode"]["tensorParallel"] = 16
    errors = errors_of(raw)
    assert any(
        e.startswith("serving.decode.tensorParallel 16 is more than the 8 GPUs per node") for e in errors
    )


def test_bare_metal_needs_a_gpu_or_a_measured_rate(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    del raw["bareMetal"]["gpuModel"]
    assert any("needs bareMetal.gpuModel" in error for error in errors_of(raw))
    raw["serving"]["prefill"]["tokensPerSecondPerGpu"] = 5000
    assert validate(raw).serving.prefill.tokens_per_second_per_gpu == 5000


def test_an_unknown_gpu_is_refused_by_name(bare_metal_raw):
    bare_metal_raw["bareMetal"]["gpuModel"] = "H900"
    assert any(
        "bareMetal.gpuModel" in e and "'H900' is not in the catalog" in e for e in errors_of(bare_metal_raw)
    )


def test_a_ucx_range_too_small_for_the_ranks_is_refused(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    raw["ports"] = [
        {"name": "model-service", "port": 5000, "scope": "clients"},
        {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
        {"name": "kv-side-channel", "port": 5600, "scope": "cluster"},
        {"name": "kv-data", "port": "5601-5610", "scope": "cluster"},
    ]
    errors = errors_of(raw)
    assert any("kv-data (5601-5610) holds 10 ports" in e and "at least 20" in e for e in errors), errors


def test_nixl_rows_open_to_clients_are_refused(bare_metal_raw):
    raw = disaggregated(bare_metal_raw)
    raw["ports"] = [
        {"name": "model-service", "port": 5000, "scope": "clients"},
        {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
        {"name": "kv-side-channel", "port": 5600, "scope": "monitoring"},
    ]
    errors = errors_of(raw)
    assert any("kv-side-channel (5600, scope monitoring) must have scope cluster" in e for e in errors), (
        errors
    )
