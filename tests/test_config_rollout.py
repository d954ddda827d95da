"""rollout.maxUnavailable: a count or a percentage of the replicas, resolved as Kubernetes does
(rounded down, at least 1), never more than the replicas; and the lanes it makes."""

from __future__ import annotations

import pytest

from qwen_cluster.config import ConfigError, validate
from qwen_cluster.topology import lanes, previous_in_lane
from tests.helpers.configs import nodes


def cluster(raw: dict, count: int = 4, **rollout):
    network = {**raw["network"], "cidr": "192.168.0.0/17"}
    return validate({**raw, "network": network, "nodes": nodes(count, "192.168."), "rollout": rollout})


def errors_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(raw)
    return caught.value.errors


def test_the_default_is_a_quarter_of_the_replicas_rounded_down(aws_raw):
    assert cluster(aws_raw, 16).max_unavailable == 4
    assert cluster(aws_raw, 7).max_unavailable == 1


def test_the_default_lets_at_least_one_replica_out(aws_raw):
    assert cluster(aws_raw, 2).max_unavailable == 1


def test_a_count_is_taken_as_written(aws_raw):
    assert cluster(aws_raw, 16, maxUnavailable=3).max_unavailable == 3


def test_a_count_arriving_as_a_float_over_grpc_is_a_count(aws_raw):
    assert cluster(aws_raw, 16, maxUnavailable=3.0).max_unavailable == 3


def test_a_count_above_the_replicas_is_every_replica(aws_raw):
    assert cluster(aws_raw, 4, maxUnavailable=10).max_unavailable == 4


def test_a_percentage_rounds_down(aws_raw):
    assert cluster(aws_raw, 10, maxUnavailable="33%").max_unavailable == 3


def test_a_percentage_counts_replicas_not_nodes(aws_raw):
    raw = {**aws_raw, "model": {"pipelineParallel": 2}}
    assert cluster(raw, 16, maxUnavailable="50%").max_unavailable == 4


NOT_A_COUNT = 'is not a count or a percentage from 1% to 100% (e.g. "25%")'
TOO_FEW = "at least 1 replica must be allowed out, or nothing could change"
WRITE = 'write a count of replicas (e.g. 2) or a percentage (e.g. "25%")'


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, f"rollout.maxUnavailable 0: {TOO_FEW}"),
        (-2, f"rollout.maxUnavailable -2: {TOO_FEW}"),
        ("0%", f"rollout.maxUnavailable '0%' {NOT_A_COUNT}"),
        ("150%", f"rollout.maxUnavailable '150%' {NOT_A_COUNT}"),
        ("a quarter", f"rollout.maxUnavailable 'a quarter' {NOT_A_COUNT}"),
        (True, f"rollout.maxUnavailable True: {WRITE}"),
    ],
)
def test_a_bad_value_is_refused_naming_the_key_and_the_value(aws_raw, value, message):
    assert errors_of({**aws_raw, "rollout": {"maxUnavailable": value}}) == [message]


def test_replica_i_rolls_in_lane_i_mod_the_width(aws_raw):
    replicas = cluster(aws_raw, 10, maxUnavailable=3).rollout_lanes
    assert [[replica.index for replica in lane] for lane in replicas] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_a_lane_is_ceil_replicas_over_width_long(aws_raw):
    replicas = cluster(aws_raw, 16).topology.replicas
    assert max(len(lane) for lane in lanes(replicas, 5)) == 4
    assert previous_in_lane(replicas[7], 5) == 2 and previous_in_lane(replicas[4], 5) is None


def disaggregated_cluster(raw: dict, prefill: int, decode: int, **rollout):
    """`prefill` + `decode` nodes, the first ones prefill (H100s: bare metal needs a GPU)."""
    found = nodes(prefill + decode, "192.168.")
    names = [node["name"] for node in found]
    network = {**raw["network"], "cidr": "192.168.0.0/17"}
    raw = {**raw, "network": network, "nodes": found, "rollout": rollout}
    raw["serving"] = {
        "mode": "disaggregated",
        "prefill": {"nodes": names[:prefill]},
        "decode": {"nodes": names[prefill:]},
    }
    return validate(raw)


def out_at_once(cluster) -> dict[str, int]:
    """The most replicas of each pool the lanes can have out at once: one per lane."""
    pools: dict[str, int] = {}
    for lane in cluster.rollout_lanes:
        pool = cluster.serving.pool_of(lane[0].head.name)
        assert {cluster.serving.pool_of(replica.head.name) for replica in lane} == {pool}
        pools[pool] = pools.get(pool, 0) + 1
    return pools


def test_disaggregated_lanes_never_take_a_whole_pool_out(aws_raw):
    found = disaggregated_cluster(aws_raw, 2, 2, maxUnavailable=4)
    assert out_at_once(found) == {"prefill": 1, "decode": 1}


def test_disaggregated_lanes_keep_max_unavailable(aws_raw):
    found = disaggregated_cluster(aws_raw, 6, 10, maxUnavailable=4)
    assert sum(out_at_once(found).values()) == 4
    assert [[replica.index for replica in lane] for lane in found.rollout_lanes][0] == [0, 3]


def test_each_disaggregated_replica_follows_the_one_before_it_in_its_lane(aws_raw):
    found = disaggregated_cluster(aws_raw, 3, 3, maxUnavailable=2)
    assert [[replica.index for replica in lane] for lane in found.rollout_lanes] == [[0, 1, 2], [3, 4, 5]]
    replicas = found.topology.replicas
    assert [found.previous_in_lane(replica) for replica in replicas] == [None, 0, 1, None, 3, 4]
