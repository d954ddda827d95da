"""The port table and who may reach what."""

from __future__ import annotations

import pytest

from qwen_cluster import ports
from qwen_cluster.config import validate
from qwen_cluster.ports import Peer, PortRange, Target, Vantage


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (5000, PortRange(5000, 5000)),
        ("5000", PortRange(5000, 5000)),
        ("6000-6100", PortRange(6000, 6100)),
        (" 1 - 65535 ", PortRange(1, 65535)),
    ],
)
def test_parse_port_range(text, expected):
    assert ports.parse_port_range(text) == expected


@pytest.mark.parametrize("bad", [0, 65536, "6100-6000", "abc", "1-2-3", True, 5.5])
def test_parse_port_range_refuses(bad):
    with pytest.raises(ValueError):
        ports.parse_port_range(bad)


def test_default_table_is_the_guides_plus_prometheus_and_alertmanager():
    assert [(e.name, str(e.port), e.scope.value, e.required) for e in ports.DEFAULT_PORTS] == [
        ("model-service", "5000", "clients", True),
        ("inter-node", "6000-6100", "cluster", True),
        ("monitoring", "8000", "monitoring", False),
        ("prometheus", "9090", "monitoring", False),
        ("alertmanager", "9093", "monitoring", False),
    ]


def test_exposure_is_members_only_between_nodes_and_lb_only_for_the_model(aws_raw):
    rules = {rule.name: rule for rule in validate(aws_raw).exposures()}
    assert set(rules) == {
        "cluster-all",
        "model-service",
        "monitoring",
        "prometheus",
        "alertmanager",
        "listener",
    }
    assert rules["cluster-all"].peer is Peer.NODES and rules["cluster-all"].all_traffic
    assert rules["model-service"].peer is Peer.LOAD_BALANCER and rules["model-service"].ports == PortRange(
        5000, 5000
    )
    assert rules["monitoring"].cidrs == ("10.20.0.0/16",)
    assert rules["listener"].target is Target.LOAD_BALANCER and rules["listener"].cidrs == ("10.0.0.0/8",)
    assert all(rule.description for rule in rules.values())


def test_ssh_only_with_an_admin_path(aws_raw, bare_metal_raw):
    assert "ssh" not in {rule.name for rule in validate(aws_raw).exposures()}
    aws_raw["aws"]["bastion"] = True
    assert "ssh" in {rule.name for rule in validate(aws_raw).exposures()}
    ssh = next(rule for rule in validate(bare_metal_raw).exposures() if rule.name == "ssh")
    assert ssh.cidrs == ("203.0.113.10/32",) and ssh.ports == PortRange(22, 22)


def test_monitoring_closed_when_no_monitoring_cidrs(aws_raw):
    aws_raw["access"]["monitoringCidrs"] = []
    assert "monitoring" not in {rule.name for rule in validate(aws_raw).exposures()}


def test_rules_do_not_grow_with_the_node_count(aws_raw):
    from tests.helpers.configs import nodes

    small = validate(aws_raw).exposures()
    aws_raw["nodes"] = nodes(64, prefix="192.168.")
    aws_raw["network"]["cidr"] = "192.168.0.0/17"
    assert len(validate(aws_raw).exposures()) == len(small)


def test_reachability_intruder_gets_nothing_a_member_gets(bare_metal_raw):
    cluster = validate(bare_metal_raw)
    plan = ports.reachability(cluster.ports, listener_port=80, ssh_to_nodes=True)
    opened = {(e.vantage, e.name, e.port) for e in plan if e.open}
    assert (Vantage.NODE, "inter-node", 6000) in opened and (Vantage.NODE, "inter-node", 6100) in opened
    assert (Vantage.LOAD_BALANCER, "model-service", 5000) in opened
    assert (Vantage.CLIENT, "model-service", 5000) not in opened
    assert (Vantage.CLIENT, "listener", 80) in opened
    assert (Vantage.MONITORING, "monitoring", 8000) in opened
    assert (Vantage.ADMIN, "ssh", 22) in opened
    assert not [e for e in plan if e.open and e.vantage in (Vantage.INTRUDER, Vantage.OUTSIDER)]


def test_prometheus_and_alertmanager_are_admitted_on_the_monitoring_node_only(bare_metal_raw):
    cluster = validate(bare_metal_raw)
    by_name = {rule.name: rule for rule in cluster.exposures()}
    assert by_name["prometheus"].node == by_name["alertmanager"].node == cluster.monitoring_node.name
    # Every node's metrics endpoint stays on every node.
    assert by_name["monitoring"].node is None


def test_prometheus_rows_admitted_nowhere_without_prometheus(bare_metal_raw):
    cluster = validate({**bare_metal_raw, "monitoring": {"prometheus": False}})
    assert not [rule for rule in cluster.exposures() if rule.name in ("prometheus", "alertmanager")]


def test_reachability_expects_prometheus_open_on_the_monitoring_node_only(bare_metal_raw):
    cluster = validate(bare_metal_raw)
    plan = ports.reachability(cluster.ports, listener_port=80, ssh_to_nodes=True, monitoring_node="master")
    (row,) = [e for e in plan if e.vantage is Vantage.MONITORING and e.name == "prometheus"]
    assert (row.open_on("master"), row.open_on("worker-1")) == (True, False)
    (member,) = [e for e in plan if e.vantage is Vantage.NODE and e.name == "alertmanager"]
    assert member.open_on("worker-1")
