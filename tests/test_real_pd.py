"""Prefill/decode disaggregation over NIXL with the real parts (labkit/cluster/pdlab.py): a prefill
vLLM CPU server and a decode server in namespaces of their own on a lab switch, NIXL's UCX backend
on TCP across the veths, vLLM's router in P/D mode in a third namespace with the client.

One rehearsal per run (module fixture: two real servers and the router); the shaped links, the
`recompute` policy, a wrong side-channel host and the expired lease are in
`scripts/bench.py --only pd` (docs/lab.md, "Prefill and decode over NIXL").
"""

from __future__ import annotations

import random
import re

import pytest

from labkit.cluster import pdlab
from labkit.hosts import netns
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.skipif(
    bool(netns.missing_requirements()), reason="; ".join(netns.missing_requirements())
)
# Characters of a prompt: ~1.4k tokens of the tiny model, 11 blocks of 128.
CHARACTERS = 1500


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with pdlab.up(decode_policy="fail", workdir=tmp_path_factory.mktemp("pd")) as started:
        yield started


def _failed_transfers(lab: pdlab.Lab) -> float:
    return lab.metrics(pdlab.DECODE).get("vllm:nixl_num_failed_transfers_total", 0.0)


def _received_bytes(node: pdlab.Node) -> int:
    """What the node's lab NIC has received (`ip -s link`)."""
    shown = netns.run(["ip", "-n", node.namespace, "-s", "-j", "link", "show", pdlab.MEMBER_IF]).stdout
    return int(re.search(r'"rx":\{"bytes":(\d+)', shown).group(1))


# First in the module: the side channel serves only the handshake, and a decode server that has
# shaken hands with the prefill server keeps its metadata and never asks again.
def test_a_decode_server_that_cannot_reach_the_side_channel_fails_the_request_under_the_fail_policy(lab):
    rng = random.Random(1)
    failed = _failed_transfers(lab)
    lab.firewall_side_channel(True)
    try:
        # Whole, not streamed: a stream's status (200) is sent before the failure, which then
        # comes as an error event (docs/lab.md).
        refused = lab.complete(lab.router_url, pdlab.prompt(rng, CHARACTERS), 4, stream=False)
    finally:
        lab.firewall_side_channel(False)
    assert refused.status == 500, (refused.status, refused.error, lab.log_tail("decode"))
    assert "Failing 1 request(s) due to KV load failure" in lab.log_tail("decode", 200_000)
    wait_until(
        lambda: _failed_transfers(lab), what="the decode server counts the failed handshake", timeout=30,
        done=lambda count: count > failed,
    )  # fmt: skip
    # The next request, the side channel open again, is served.
    served = lab.complete(lab.router_url, pdlab.prompt(rng, CHARACTERS), 4)
    assert served.ok, (served.status, served.error)


def test_the_disaggregated_answer_is_the_aggregated_one_and_its_kv_crossed_the_wire(lab):
    rng = random.Random(2)
    text = pdlab.prompt(rng, CHARACTERS)
    # The prefill server asked without kv_transfer_params is a plain server: the reference.
    reference = lab.aggregated(text)
    assert reference.ok, (reference.status, reference.error)
    received = _received_bytes(pdlab.DECODE)
    pulled = pdlab.disaggregated(lab, text)
    assert pulled.completion.ok, (pulled.completion.status, pulled.completion.error)
    # Token for token and log-prob for log-prob (the tiny model's text alone proves nothing).
    assert pulled.completion.tokens == reference.tokens
    assert pulled.completion.logprobs == reference.logprobs
    # Every block the prompt touches, pulled once, counted as the decode server's external hits.
    tokens = pulled.completion.prompt_tokens
    assert pulled.transfers == 1
    assert pulled.bytes == pdlab.pulled_bytes(tokens, pdlab.tiny_model().kv_bytes_per_token())
    assert pulled.external_hits == tokens
    # ... over the decode node's lab NIC.
    assert _received_bytes(pdlab.DECODE) - received >= pulled.bytes
