"""The offline mocks answer invokes as the stack's own provider would: in the stack's region."""

from __future__ import annotations

import pytest

from tests.helpers.aws_stacks import variant
from tooling import offline, stackfile

ZONES = "aws:index/getAvailabilityZones:getAvailabilityZones"


@pytest.mark.parametrize(("stack", "region"), [("dev", "us-west-2"), ("prod", "us-east-1")])
def test_the_nlb_s_second_subnet_is_in_a_zone_of_the_stack_s_own_region(stack, region):
    internet_facing = variant(stack, loadBalancer={"scheme": "internet-facing"})
    result = offline.render(internet_facing, stack)
    assert result.error is None, result.error
    assert [token for token, _ in result.invokes].count(ZONES) == 1
    nodes_zone = result.named("network-nodes").inputs["availabilityZone"]
    second = result.named("network-public-b").inputs["availabilityZone"]
    assert nodes_zone == f"{region}a" and second == f"{region}b"


def test_the_region_is_the_provider_s_else_the_zone_s():
    """The provider answers in aws:region; a stack without one has its region in its zone."""
    prod = stackfile.read("prod")
    assert offline.stack_region(prod) == prod["aws:region"] == "us-east-1"
    in_frankfurt = {"qwen-cluster:aws": {"availabilityZone": "eu-central-1b"}}
    assert offline.stack_region(in_frankfurt) == "eu-central-1"
    assert offline.stack_region({**in_frankfurt, "aws:region": "eu-west-1"}) == "eu-west-1"
    assert offline.stack_region(stackfile.read("onprem")) == offline.FALLBACK_REGION


def test_zone_ids_abbreviate_the_region_as_aws_does():
    assert offline.availability_zones("us-east-1") == {
        "names": ["us-east-1a", "us-east-1b", "us-east-1c"],
        "zoneIds": ["use1-az1", "use1-az2", "use1-az3"],
    }
    assert offline.availability_zones("ap-southeast-2")["zoneIds"][0] == "apse2-az1"
    assert offline.availability_zones("eu-central-1")["zoneIds"][0] == "euc1-az1"
