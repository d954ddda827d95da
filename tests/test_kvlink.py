"""The KV link arithmetic: bytes per token from the model's geometry, the prefill rate from the
GPU's datasheet, and what the prefill->decode path must carry."""

from __future__ import annotations

import pytest

from qwen_cluster import catalog, kvlink
from qwen_cluster.config import validate

POOLS = {"prefill": {"nodes": ["master", "worker-1"]}, "decode": {"nodes": ["worker-2", "worker-3"]}}


def test_qwen3_32b_holds_256_kib_of_kv_per_token_in_bf16_and_128_in_fp8():
    model = catalog.MODELS["Qwen/Qwen3-32B"]
    assert model.kv_bytes_per_token() == 256 * 1024
    assert model.kv_bytes_per_token(kvlink.kv_dtype_bytes("fp8")) == 128 * 1024
    assert kvlink.kv_dtype_bytes(None) == kvlink.kv_dtype_bytes("auto") == 2


def test_an_h100_prefills_about_7_5k_tokens_a_second_making_about_16_gbit_of_kv():
    model = catalog.MODELS["Qwen/Qwen3-32B"]
    rate = kvlink.prefill_tokens_per_second(catalog.GPUS["H100"], model)
    assert rate == pytest.approx(7538, rel=0.001)
    assert kvlink.kv_gbps(rate, model.kv_bytes_per_token()) == pytest.approx(15.8, abs=0.1)


def test_a_4k_prompt_is_one_gib_86_ms_at_100_gbit():
    seconds = kvlink.transfer_seconds(4096, 256 * 1024, 100)
    assert seconds == pytest.approx(0.0859, abs=0.0005)


def test_aggregated_stacks_have_no_demand(bare_metal_raw):
    assert kvlink.demand(validate(bare_metal_raw)) is None


def test_25_gbit_nics_cannot_carry_eight_h100s_of_kv(bare_metal_raw):
    bare_metal_raw["serving"] = {"mode": "disaggregated", **POOLS}
    bare_metal_raw["bareMetal"]["gpuModel"] = "H100"
    bare_metal_raw["model"] = {"tensorParallel": 8}
    demand = kvlink.demand(validate(bare_metal_raw))
    assert demand.kv_gbps_per_prefill_node == pytest.approx(126.5, abs=0.1)
    assert not demand.carried and demand.share == pytest.approx(126.5 / 25, rel=0.01)
    assert "bareMetal.nicSpeedGbps" in demand.figures() and "126.5 Gbit/s" in demand.figures()


def test_fewer_decode_nodes_receive_the_whole_prefill_pool(bare_metal_raw):
    bare_metal_raw["serving"] = {
        "mode": "disaggregated",
        "prefill": {"nodes": ["master", "worker-1", "worker-2"]},
        "decode": {"nodes": ["worker-3"]},
    }
    bare_metal_raw["bareMetal"].update(gpuModel="H100", nicSpeedGbps=150)
    demand = kvlink.demand(validate(bare_metal_raw))
    assert demand.prefill_share < 1 < demand.decode_share
    assert not demand.carried


def test_a_measured_rate_replaces_the_datasheet_estimate(bare_metal_raw):
    bare_metal_raw["serving"] = {"mode": "disaggregated", **POOLS}
    bare_metal_raw["serving"]["prefill"] = {**POOLS["prefill"], "tokensPerSecondPerGpu": 1000}
    demand = kvlink.demand(validate(bare_metal_raw))
    assert demand.tokens_per_second_per_gpu == 1000
    assert "serving.prefill.tokensPerSecondPerGpu" in demand.figures()


def test_p5_carries_it_with_the_transfer_under_a_tenth(aws_raw):
    aws_raw["aws"]["instanceType"] = "p5.48xlarge"
    aws_raw["model"] = {"tensorParallel": 8}
    aws_raw["serving"] = {"mode": "disaggregated", **POOLS}
    demand = kvlink.demand(validate(aws_raw))
    assert demand.carried and demand.share < kvlink.TRANSFER_SHARE
