"""The pack's normalization of resource properties: protocols, ports, peers, host firewalls, scripts."""

import base64
import json

import pytest
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, unknown_checking_proxy

from policies import normalized as net
from qwen_cluster.ports import PortRange


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("-1", "all"),
        ("all", "all"),
        ("ALL", "all"),
        ("tcp", "tcp"),
        ("TCP", "tcp"),
        ("6", "tcp"),
        ("17", "udp"),
    ],
)
def test_protocol_spellings_normalize(spelling, name):
    assert net.protocol_name(spelling) == name


@pytest.mark.parametrize(
    ("protocol", "low", "high", "span"),
    [
        ("all", None, None, None),
        ("all", 0, 0, None),
        ("tcp", 0, 65535, None),
        ("tcp", -1, -1, None),
        ("tcp", None, None, None),
        ("tcp", 6000, 6100, PortRange(6000, 6100)),
        ("tcp", 5000, None, PortRange(5000, 5000)),
    ],
)
def test_port_spans_cover_every_spelling_of_all_ports(protocol, low, high, span):
    assert net.port_span(protocol, low, high) == span


def test_inline_ingress_with_mixed_ipv4_and_ipv6_cidrs_lists_every_peer():
    props = {
        "ingress": [
            {
                "protocol": "6",
                "fromPort": 6000,
                "toPort": 6100,
                "cidrBlocks": ["10.42.1.0/24", "0.0.0.0/0"],
                "ipv6CidrBlocks": ["::/0"],
                "description": "mixed",
            }
        ]
    }
    (rule,) = net.rules_of(net.SECURITY_GROUP, "sg", props)
    assert rule.protocol == "tcp" and rule.ports == PortRange(6000, 6100)
    assert [str(peer) for peer in rule.peers] == ["10.42.1.0/24", "0.0.0.0/0", "::/0"]
    assert rule.group == "sg" and rule.direction == "ingress"


def test_security_group_rule_referencing_its_own_group_is_a_self_rule():
    props = {
        "type": "egress",
        "protocol": "-1",
        "fromPort": 0,
        "toPort": 0,
        "securityGroupId": "a",
        "self": True,
    }
    (rule,) = net.rules_of(net.SECURITY_GROUP_RULE, "r", props)
    assert rule.direction == "egress" and rule.all_traffic and rule.peers[0].kind == "self"


def test_vpc_rule_resolves_groups_through_the_resolver():
    props = {"securityGroupId": "x-id", "referencedSecurityGroupId": "x-id", "ipProtocol": "-1"}
    (rule,) = net.rules_of(net.INGRESS_RULE, "r", props, lambda prop, value: value.removesuffix("-id"))
    assert rule.group == "x" and rule.peers[0].kind == "self" and rule.ports is None


def test_unknown_values_in_preview_do_not_stop_the_other_checks():
    props = unknown_checking_proxy(
        {
            "securityGroupId": UNKNOWN_STRING_VALUE,
            "cidrIpv4": "0.0.0.0/0",
            "ipProtocol": "tcp",
            "fromPort": 22,
        }
    )
    (rule,) = net.rules_of(net.INGRESS_RULE, "r", props)
    assert rule.group == "<unknown>" and str(rule.peers[0]) == "0.0.0.0/0" and rule.opens(22)


def test_gpu_nodes_are_tagged_or_of_a_gpu_family():
    assert net.is_gpu_node(net.INSTANCE, {"instanceType": "t3.large", "tags": {net.ROLE_TAG: "gpu-node"}})
    assert net.is_gpu_node(net.INSTANCE, {"instanceType": "p5.48xlarge"})
    assert not net.is_gpu_node(net.INSTANCE, {"instanceType": "t3.large"})
    asg = {
        "tags": [{"key": net.ROLE_TAG, "value": "gpu-node", "propagateAtLaunch": True}],
        "desiredCapacity": 3,
    }
    assert net.is_gpu_node(net.AUTOSCALING_GROUP, asg) and net.node_count(net.AUTOSCALING_GROUP, asg) == 3


def _document(**rule):
    return {
        "schema": net.FIREWALL_SCHEMA,
        "host": "h",
        "address": "192.168.1.100",
        "nicSpeedGbps": 25,
        "rules": [{"action": "allow", "description": "d", **rule}],
    }


@pytest.mark.parametrize("as_text", [True, False])
def test_firewall_documents_are_read_as_json_text_or_objects(as_text):
    document = _document(protocol="tcp", ports="6000-6100", sources=["192.168.1.0/24"])
    props = {"triggers": ["unrelated", json.dumps(document) if as_text else document]}
    (parsed,) = net.firewall_documents(props)
    assert parsed.host == "h" and parsed.nic_speed_gbps == 25
    assert (
        parsed.rules[0].ports == PortRange(6000, 6100) and str(parsed.rules[0].sources[0]) == "192.168.1.0/24"
    )


@pytest.mark.parametrize("key", ["create", "update"])
def test_firewall_documents_are_read_from_the_script_that_writes_them(key):
    """The bare-metal target carries the document in its firewall script, not in `triggers`."""
    from qwen_cluster.render import firewall

    document = _document(protocol="tcp", ports="6000-6100", sources=["192.168.1.0/24"])
    rules = [firewall.Rule("ssh", "203.0.113.10/32", "22", "tcp")]
    text = firewall.apply_script(rules, "nftables", node_ip="192.168.1.100", document=document)
    (parsed,) = net.firewall_documents({key: text, "triggers": ["192.168.1.100", "nftables"]})
    assert parsed.host == "h" and parsed.rules[0].ports == PortRange(6000, 6100)
    assert net.firewall_documents({key: text.replace("QWEN_FIREWALL_DOCUMENT", "OTHER")}) == []


def test_a_firewall_rule_without_sources_admits_the_world():
    (parsed,) = net.firewall_documents({"triggers": [_document(protocol="tcp", ports=5000)]})
    assert {str(source) for source in parsed.rules[0].sources} == {"0.0.0.0/0", "::/0"}


def test_deny_rules_open_nothing_and_bad_entries_are_reported():
    document = _document(protocol="tcp", ports="70000", sources=["x"])
    document["rules"].append({"action": "deny", "protocol": "all", "sources": ["0.0.0.0/0"]})
    (parsed,) = net.firewall_documents({"triggers": [document]})
    assert parsed.rules == () and len(parsed.problems) == 1


@pytest.mark.parametrize(
    "script",
    [
        "sudo setenforce 0",
        "setenforce Permissive",
        "sed -i s/SELINUX=enforcing/SELINUX=disabled/ /etc/selinux/config",
        "grubby --update-kernel ALL --args selinux=0",
    ],
)
def test_selinux_disabling_is_recognized(script):
    assert net.SELINUX_OFF.search(script)


def test_selinux_checks_leave_enforcing_alone():
    assert not net.SELINUX_OFF.search("setenforce 1; getenforce; SELINUX=enforcing")


def test_user_data_is_read_in_base64_too():
    encoded = base64.b64encode(b"#!/bin/sh\nsetenforce 0\n").decode()
    texts = dict(net.texts_of(net.LAUNCH_TEMPLATE, {"userData": encoded}))
    assert "setenforce 0" in texts["userData (base64-decoded)"]


# --- numbers as the engine sends them (protobuf Struct: every number a double) ------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(5000, 5000), (5000.0, 5000), (5000.5, None), (True, None), ("5000", None), (None, None)],
)
def test_integral_accepts_any_integral_real_number(value, expected):
    assert net.integral(value) == expected


def test_port_spans_and_node_counts_read_doubles():
    assert net.port_span("tcp", 6000.0, 6100.0) == PortRange(6000, 6100)
    assert net.port_span("tcp", "22", "22") == PortRange(22, 22)
    assert net.node_count(net.AUTOSCALING_GROUP, {"desiredCapacity": 3.0}) == 3


def test_a_firewall_document_sent_as_an_object_reads_its_numbers():
    document = {
        "schema": net.FIREWALL_SCHEMA,
        "host": "master",
        "address": "192.168.1.100",
        "nicSpeedGbps": 25.0,
        "loadBalancer": True,
        "listenerPort": 80.0,
        "rules": [{"action": "allow", "protocol": "tcp", "ports": 5000.0, "sources": [], "description": "d"}],
    }
    (doc,) = net.firewall_documents({"triggers": [document]})
    assert doc.listener_port == 80 and doc.nic_speed_gbps == 25.0 and doc.problems == ()
    assert doc.rules[0].ports == PortRange(5000, 5000)
