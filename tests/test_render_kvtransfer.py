"""The NIXL settings a disaggregated node's vLLM gets: its role's --kv-transfer-config and the
side channel's and transport's environment."""

from __future__ import annotations

import json

from qwen_cluster.config import validate
from qwen_cluster.render import kvtransfer

POOLS = {"prefill": {"nodes": ["master", "worker-1"]}, "decode": {"nodes": ["worker-2", "worker-3"]}}


def test_prefill_produces_and_decode_consumes_with_the_chosen_connector_and_policy(bare_metal_raw):
    bare_metal_raw["serving"] = {
        "mode": "disaggregated",
        **POOLS,
        "kvTransfer": {"connector": "push", "loadFailurePolicy": "recompute"},
    }
    bare_metal_raw["bareMetal"]["gpuModel"] = "H100"
    cluster = validate(bare_metal_raw)
    by_node = {node.name: kvtransfer.for_node(cluster, node) for node in cluster.nodes}
    assert by_node["master"][0] == {
        "kv_connector": "NixlPushConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    assert by_node["worker-2"][0]["kv_role"] == "kv_consumer"
    assert by_node["worker-2"][1] == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "192.168.1.102",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "UCX_TCP_PORT_RANGE": "5601-5680",
    }


def test_ucx_over_tcp_names_the_device(bare_metal_raw):
    bare_metal_raw["serving"] = {"mode": "disaggregated", **POOLS}
    bare_metal_raw["bareMetal"]["gpuModel"] = "H100"
    cluster = validate(bare_metal_raw)
    _, env = kvtransfer.for_node(cluster, cluster.nodes[0], tcp_device="eth1")
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "eth1"


def test_aws_nodes_use_libfabric_on_efa_only(aws_raw):
    aws_raw["serving"] = {"mode": "disaggregated", **POOLS}
    cluster = validate(aws_raw)
    config, env = kvtransfer.for_node(cluster, cluster.nodes[3])
    assert config["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}
    assert env["FI_PROVIDER"] == "efa" and "UCX_TCP_PORT_RANGE" not in env


def test_aggregated_nodes_get_nothing(aws_raw):
    cluster = validate(aws_raw)
    assert kvtransfer.for_node(cluster, cluster.nodes[0]) is None


def test_the_flag_is_stable_json():
    config = kvtransfer.kv_transfer_config(
        "decode", connector="pull", backend="ucx", load_failure_policy="fail"
    )
    flag = kvtransfer.kv_transfer_flag(config)
    assert json.loads(flag) == config and " " not in flag
    assert flag == kvtransfer.kv_transfer_flag(dict(reversed(list(config.items()))))
