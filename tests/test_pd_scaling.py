"""The prefill/decode rehearsal's arithmetic (labkit/cluster/pdlab.py), without servers: the link
a shaped rate stands for, and the bytes a decode server pulls for a prompt."""

from __future__ import annotations

import pytest

from labkit.cluster import pdlab


def test_a_model_making_kv_as_fast_as_qwen3_32b_on_an_h100_gets_the_link_itself():
    assert pdlab.equivalent_mbit(100, pdlab.qwen_kv_gbps()) == pytest.approx(100_000)


def test_the_lab_link_scales_with_the_tiny_models_kv_rate():
    # The tiny model's KV at 22.9 Mbit/s (5,599 prefill tokens/s x 512 B, measured under load)
    # keeps Qwen3-32B's share of the prefill on 10 Gbit/s (~1.58) at ~14.5 Mbit/s.
    lab_link = pdlab.equivalent_mbit(10, 0.0229)
    assert lab_link == pytest.approx(14.49, abs=0.01)
    assert 0.0229 * 1000 / lab_link == pytest.approx(pdlab.qwen_kv_gbps() / 10)


def test_a_decode_server_pulls_every_block_the_prompt_touches():
    # Measured: 1,371 prompt tokens, 11 blocks of 128, 720,896 bytes on vllm:nixl_bytes_transferred.
    assert pdlab.pulled_bytes(1371, 512) == 720_896
    assert pdlab.pulled_bytes(1280, 512) == 10 * 128 * 512
