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
