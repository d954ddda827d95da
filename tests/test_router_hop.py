"""The router's own cost (labkit/cluster/routerhop.py) on its smallest setting: the real router
(vllm-router from PyPI) before two stand-in workers on loopback. What it shows: round_robin asks
no worker anything before it chooses, while cache_aware renders every prompt on every worker
(the fan-out that grows the hop with the worker count), and every figure the benchmark prints
is there."""

from __future__ import annotations

from labkit.cluster import routerhop


def test_the_prefix_policy_renders_each_prompt_on_every_worker_and_round_robin_on_none(tmp_path):
    figures = routerhop.measure(
        counts=(2,),
        policies=("round_robin", "cache_aware"),
        requests=10,
        workdir=tmp_path,
        log=lambda _: None,
    )
    detail = figures["detail"]
    assert detail["round_robin"]["2"]["renderCallsPerRequest"] == 0
    assert detail["cache_aware"]["2"]["renderCallsPerRequest"] == 2
    assert set(figures["routerHopMs"]) == {"round_robin", "cache_aware"}
    for row in (detail["round_robin"]["2"], detail["cache_aware"]["2"]):
        assert row["routedP50Ms"] > 0 and row["directP50Ms"] > 0
        first, end = row["streamedRoutedP50Ms"]
        # Every token of the streamed answer came through (16 tokens, 5 ms apart at the worker).
        assert end >= routerhop.STREAM_TOKENS * routerhop.TOKEN_SECONDS * 1000 > first
