"""Each policy over pass_* / fail_* fixtures: the exact set of resources it refuses.

Stack-level fixtures are added to a good stack (shaped like dev or onprem) so that security
groups, the load balancer and the hosts they refer to exist; resource-level fixtures stand alone.
"""

import ipaddress
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pulumi_policy import ResourceValidationPolicy, StackValidationPolicy
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE

from policies import facts as pack_facts
from policies import guard
from policies import normalized as net
from qwen_cluster import config
from qwen_cluster.config import x509check
from tests.helpers import certificates
from tests.helpers.configs import TEST_API_KEY, TEST_MONITORING_PASSWORD
from tests.helpers.policy_fixtures import (
    CONTAINER,
    aws_stack,
    bare_metal_stack,
    container,
    egress,
    firewall_command,
    ingress,
    instance,
    one_node,
    placement_strategy,
    rendered,
    res,
    without_egress_self_rule,
)
from tooling import policy_harness, stackfile

DEV = stackfile.load("dev")
PROD = stackfile.load("prod")
ONPREM = stackfile.load("onprem")
POLICIES_DIR = Path(__file__).resolve().parent.parent / "policies"


def refused(resources, policy, cluster=DEV, **kwargs):
    """Names of the resources `policy` refuses (None: the stack as a whole)."""
    violations = policy_harness.analyze(resources, cluster=cluster, **kwargs)
    return {v.resource for v in violations if v.policy == policy}


def fail_names(resources):
    return {r.name for r in resources if r.name.startswith("fail_")}


def in_clear(cluster):
    """The stack as it would be served without API keys or with TLS: keys-in-clear is silent."""
    return cluster.model_copy(update={"access": cluster.access.model_copy(update={"api_keys": []})})


def quiet(cluster):
    """The stack without API keys and with monitoringCidrs apart from clientCidrs: no advisory."""
    access = {
        "api_keys": [],
        "monitoring_cidrs": [ipaddress.ip_network("10.20.0.0/16")],
        "client_cidrs": [ipaddress.ip_network("10.0.0.0/12")],
    }
    return cluster.model_copy(update={"access": cluster.access.model_copy(update=access)})


def test_the_good_fixture_stacks_pass_every_policy():
    assert policy_harness.analyze(aws_stack(), cluster=quiet(DEV)) == []
    assert policy_harness.analyze(bare_metal_stack(), cluster=quiet(ONPREM)) == []


# --- keys-in-clear ------------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", [DEV, ONPREM], ids=["aws", "bare metal"])
def test_api_keys_without_tls_get_an_advisory(cluster):
    violations = policy_harness.analyze(
        aws_stack() if cluster is DEV else bare_metal_stack(), cluster=cluster
    )
    assert [(v.policy, v.enforcement, v.resource) for v in violations if v.policy == "keys-in-clear"] == [
        ("keys-in-clear", "advisory", None)
    ]
    assert {v.enforcement for v in violations} == {"advisory"}
    (advisory,) = [v for v in violations if v.policy == "keys-in-clear"]
    assert advisory.message.startswith("access.apiKeys are set and loadBalancer.tls is not")


def test_api_keys_with_tls_get_none():
    tls = config.Tls.model_construct(certificate="chain", private_key="key")
    served = DEV.model_copy(update={"load_balancer": DEV.load_balancer.model_copy(update={"tls": tls})})
    assert refused(aws_stack(), "keys-in-clear", cluster=served) == set()


# --- certificate-expiring -----------------------------------------------------------------------


def with_certificate(cluster_config, days_left: float):
    """`cluster_config` validated again with a TLS pair whose certificate ends in `days_left`."""
    now = datetime.now(UTC)
    leaf = certificates.issue(
        "lb", not_before=now - timedelta(days=60), not_after=now + timedelta(days=days_left)
    )
    raw = cluster_config.model_dump(by_alias=True, exclude_none=True, mode="json")
    raw["access"]["apiKeys"] = [TEST_API_KEY]
    raw["loadBalancer"]["tls"] = {"certificate": leaf.pem, "privateKey": leaf.key_pem}
    return config.validate(raw)


def test_a_certificate_close_to_its_end_gets_an_advisory_naming_the_key():
    soon = with_certificate(DEV, x509check.EXPIRY_ADVISORY_DAYS - 10)
    violations = [
        v for v in policy_harness.analyze(aws_stack(), cluster=soon) if v.policy == "certificate-expiring"
    ]
    assert [(v.enforcement, v.resource) for v in violations] == [("advisory", None)]
    assert violations[0].message.startswith("loadBalancer.tls certificate: certificate 1 (CN=lb) expires on")


def test_a_monitoring_certificate_close_to_its_end_gets_the_same_advisory_naming_its_key():
    """monitoring.tls is parsed as loadBalancer.tls is, and its expiry is said the same way: a
    lapsed certificate locks Prometheus out of Alertmanager and doctor out of Prometheus."""
    from tests.helpers.monitoring_tls import issue

    pki = issue(str(DEV.monitoring_node.ip), serial=41, days=x509check.EXPIRY_ADVISORY_DAYS - 10)
    raw = DEV.model_dump(by_alias=True, exclude_none=True, mode="json")
    raw["access"]["apiKeys"] = [TEST_API_KEY]
    raw["monitoring"] = {
        **raw["monitoring"],
        "password": TEST_MONITORING_PASSWORD,
        "tls": {
            "certificate": pki.certificate,
            "privateKey": pki.private_key,
            "caCertificate": pki.ca_certificate,
        },
    }
    violations = [
        v
        for v in policy_harness.analyze(aws_stack(), cluster=config.validate(raw))
        if v.policy == "certificate-expiring"
    ]
    assert [(v.enforcement, v.resource) for v in violations] == [("advisory", None)]
    assert violations[0].message.startswith(
        f"monitoring.tls certificate: certificate 1 (CN={DEV.monitoring_node.ip}) expires on"
    )


def test_a_certificate_far_from_its_end_gets_none():
    later = with_certificate(DEV, x509check.EXPIRY_ADVISORY_DAYS + 10)
    assert refused(aws_stack(), "certificate-expiring", cluster=later) == set()


def test_an_open_endpoint_has_no_keys_to_expose():
    assert refused(aws_stack(), "keys-in-clear", cluster=in_clear(DEV)) == set()


def test_without_the_stack_config_nothing_is_said_about_keys():
    assert refused(aws_stack(), "keys-in-clear", cluster=None) == set()


# --- monitoring-open ------------------------------------------------------------------------------


def test_a_monitoring_surface_open_on_purpose_gets_an_advisory_naming_the_key():
    raw = stackfile.cluster_keys(stackfile.read("onprem", offline_keys=False))
    raw["access"] = {**raw["access"], "apiKeys": [TEST_API_KEY]}
    raw["monitoring"] = {**raw["monitoring"], "openToMonitoringCidrs": True}
    opened = config.validate(raw)
    violations = [
        v for v in policy_harness.analyze(bare_metal_stack(), cluster=opened) if v.policy == "monitoring-open"
    ]
    assert [(v.enforcement, v.resource) for v in violations] == [("advisory", None)]
    assert violations[0].message.startswith(
        "monitoring.openToMonitoringCidrs is true: Prometheus and Alertmanager answer without a password "
        "to anyone in access.monitoringCidrs (10.20.0.0/16)"
    )


def test_a_monitoring_password_gets_no_monitoring_open_advisory():
    assert refused(bare_metal_stack(), "monitoring-open", cluster=ONPREM) == set()


# --- monitoring-inside-clients -------------------------------------------------------------------


def with_access(cluster, **access):
    return cluster.model_copy(update={"access": cluster.access.model_copy(update=access)})


@pytest.mark.parametrize("cluster", [DEV, ONPREM], ids=["aws", "bare metal"])
def test_monitoring_cidrs_inside_client_cidrs_get_an_advisory_naming_both_keys(cluster):
    violations = policy_harness.analyze(
        aws_stack() if cluster is DEV else bare_metal_stack(), cluster=in_clear(cluster)
    )
    assert [(v.policy, v.enforcement, v.resource) for v in violations] == [
        ("monitoring-inside-clients", "advisory", None)
    ]
    assert violations[0].message.startswith(
        "access.monitoringCidrs 10.20.0.0/16 lies inside access.clientCidrs (10.0.0.0/8)"
    )


def test_monitoring_cidrs_apart_from_client_cidrs_get_none():
    apart = with_access(in_clear(DEV), monitoring_cidrs=[ipaddress.ip_network("172.16.0.0/16")])
    assert refused(aws_stack(), "monitoring-inside-clients", cluster=apart) == set()


def test_monitoring_cidrs_partly_inside_client_cidrs_name_the_part():
    partly = with_access(
        in_clear(DEV),
        monitoring_cidrs=[ipaddress.ip_network("172.16.0.0/16"), ipaddress.ip_network("10.20.0.0/16")],
    )
    violations = policy_harness.analyze(aws_stack(), cluster=partly)
    (advisory,) = [v for v in violations if v.policy == "monitoring-inside-clients"]
    assert advisory.message.startswith("access.monitoringCidrs 10.20.0.0/16 lies inside")
    assert "172.16.0.0/16" not in advisory.message


def test_without_the_stack_config_nothing_is_said_about_overlap():
    assert refused(aws_stack(), "monitoring-inside-clients", cluster=None) == set()


# --- port-exposure ------------------------------------------------------------------------------


def _sg(name, role, ingress_entries):
    return res(net.SECURITY_GROUP, name, tags={net.ROLE_TAG: role}, ingress=ingress_entries, egress=[])


PORT_EXPOSURE_FIXTURES = [
    ingress(
        "pass_listener_clients", "dev-lb-sg", cidrIpv4="10.0.0.0/8", ipProtocol="tcp", fromPort=80, toPort=80
    ),
    ingress(
        "pass_listener_world", "dev-lb-sg", cidrIpv4="0.0.0.0/0", ipProtocol="tcp", fromPort=80, toPort=80
    ),
    ingress(
        "pass_monitoring_subnet",
        "dev-node-sg",
        cidrIpv4="10.20.5.0/24",
        ipProtocol="TCP",
        fromPort=8000,
        toPort=8000,
    ),
    ingress(
        "pass_cluster_node_cidr",
        "dev-node-sg",
        cidrIpv4="10.42.1.0/24",
        ipProtocol="6",
        fromPort=6000,
        toPort=6100,
    ),
    ingress(
        "pass_ssh_admin", "dev-node-sg", cidrIpv4="203.0.113.10/32", ipProtocol="tcp", fromPort=22, toPort=22
    ),
    egress("pass_egress_world", "dev-node-sg", cidrIpv4="0.0.0.0/0", ipProtocol="-1"),
    _sg(
        "pass_inline_node_sg",
        "node-sg",
        [
            {"protocol": "-1", "fromPort": 0, "toPort": 0, "self": True, "description": "members"},
            {
                "protocol": "tcp",
                "fromPort": 5000,
                "toPort": 5000,
                "securityGroups": ["dev-lb-sg-id"],
                "description": "model from the NLB",
            },
        ],
    ),
    _sg(
        "fail_inline_mixed_cidrs",
        "node-sg",
        [
            {
                "protocol": "6",
                "fromPort": 6000,
                "toPort": 6100,
                "cidrBlocks": ["10.42.1.0/24", "0.0.0.0/0"],
                "description": "one good, one bad",
            }
        ],
    ),
    ingress(
        "fail_cluster_world",
        "dev-node-sg",
        cidrIpv4="0.0.0.0/0",
        ipProtocol="tcp",
        fromPort=6000,
        toPort=6100,
    ),
    ingress(
        "fail_model_world_ipv6", "dev-node-sg", cidrIpv6="::/0", ipProtocol="tcp", fromPort=5000, toPort=5000
    ),
    ingress("fail_all_traffic_from_clients", "dev-node-sg", cidrIpv4="10.0.0.0/8", ipProtocol="-1"),
    res(
        net.SECURITY_GROUP_RULE,
        "fail_tcp_0_65535_monitoring",
        type="ingress",
        protocol="TCP",
        fromPort=0,
        toPort=65535,
        cidrBlocks=["10.20.0.0/16"],
        securityGroupId="dev-node-sg-id",
        description="d",
    ),
    res(
        net.SECURITY_GROUP_RULE,
        "fail_protocol_all_spelling",
        type="ingress",
        protocol="all",
        fromPort=0,
        toPort=0,
        cidrBlocks=["10.0.0.0/8"],
        securityGroupId="dev-node-sg-id",
        description="d",
    ),
    ingress(
        "fail_ssh_world_on_lb", "dev-lb-sg", cidrIpv4="0.0.0.0/0", ipProtocol="tcp", fromPort=22, toPort=22
    ),
    ingress(
        "fail_rdp_world_range",
        "dev-lb-sg",
        cidrIpv4="0.0.0.0/0",
        ipProtocol="tcp",
        fromPort=3000,
        toPort=4000,
    ),
    ingress(
        "fail_model_from_monitoring",
        "dev-node-sg",
        cidrIpv4="10.20.0.0/16",
        ipProtocol="tcp",
        fromPort=5000,
        toPort=5000,
    ),
    ingress(
        "fail_monitoring_from_clients",
        "dev-node-sg",
        cidrIpv4="10.0.0.0/8",
        ipProtocol="tcp",
        fromPort=8000,
        toPort=8000,
    ),
    ingress(
        "fail_cluster_from_lb_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-lb-sg-id",
        ipProtocol="tcp",
        fromPort=6000,
        toPort=6100,
    ),
    ingress(
        "fail_unlisted_port",
        "dev-node-sg",
        cidrIpv4="10.0.0.0/8",
        ipProtocol="tcp",
        fromPort=9999,
        toPort=9999,
    ),
    ingress(
        "fail_listener_port_on_nodes_world",
        "dev-node-sg",
        cidrIpv4="0.0.0.0/0",
        ipProtocol="tcp",
        fromPort=80,
        toPort=80,
    ),
    ingress(
        "fail_ssh_from_clients",
        "dev-node-sg",
        cidrIpv4="10.0.0.0/8",
        ipProtocol="tcp",
        fromPort=22,
        toPort=22,
    ),
]


def test_port_exposure_refuses_exactly_the_fail_fixtures():
    fixtures = PORT_EXPOSURE_FIXTURES
    assert refused(aws_stack() + fixtures, "port-exposure") == fail_names(fixtures)


def test_port_exposure_messages_name_the_rule_and_the_reason():
    violations = policy_harness.analyze(aws_stack() + PORT_EXPOSURE_FIXTURES, cluster=DEV)
    messages = {v.resource: v.message for v in violations if v.policy == "port-exposure"}
    assert "SSH/RDP" in messages["fail_ssh_world_on_lb"]
    assert "only the load balancer listener" in messages["fail_model_world_ipv6"]
    assert "members only" in messages["fail_all_traffic_from_clients"]
    assert "model port 5000/tcp" in messages["fail_model_from_monitoring"]
    assert "monitoringCidrs (10.20.0.0/16)" in messages["fail_monitoring_from_clients"]


def _monitoring_sg():
    return res(
        net.SECURITY_GROUP,
        "dev-monitoring-sg",
        description="monitoring node",
        tags={net.ROLE_TAG: "monitoring-sg"},
    )


MONITORING_NODE_FIXTURES = [
    ingress(
        "pass_prometheus_on_the_monitoring_group",
        "dev-monitoring-sg",
        cidrIpv4="10.20.0.0/16",
        ipProtocol="tcp",
        fromPort=9090,
        toPort=9090,
    ),
    ingress(
        "fail_prometheus_on_every_node",
        "dev-node-sg",
        cidrIpv4="10.20.0.0/16",
        ipProtocol="tcp",
        fromPort=9090,
        toPort=9090,
    ),
    ingress(
        "fail_alertmanager_in_a_wide_range",
        "dev-node-sg",
        cidrIpv4="10.20.0.0/16",
        ipProtocol="tcp",
        fromPort=8000,
        toPort=9999,
    ),
    ingress(
        "fail_prometheus_from_clients_on_the_monitoring_group",
        "dev-monitoring-sg",
        cidrIpv4="10.0.0.0/8",
        ipProtocol="tcp",
        fromPort=9090,
        toPort=9090,
    ),
]


def test_port_exposure_admits_prometheus_and_alertmanager_only_where_they_run():
    resources = aws_stack() + [_monitoring_sg()] + MONITORING_NODE_FIXTURES
    assert refused(resources, "port-exposure") == fail_names(MONITORING_NODE_FIXTURES)
    violations = policy_harness.analyze(resources, cluster=DEV)
    messages = {v.resource: v.message for v in violations if v.policy == "port-exposure"}
    assert (
        "prometheus 9090 runs on master only (monitoring.node); the group of every node admits it"
        in messages["fail_prometheus_on_every_node"]
    )


def test_port_exposure_admits_prometheus_on_the_monitoring_hosts_firewall_only():
    fixtures = [
        _host_at(
            "pass_bm_prometheus_on_master",
            "master",
            {"protocol": "tcp", "ports": "9090", "sources": ["10.20.0.0/16"]},
        ),
        _host_at(
            "fail_bm_prometheus_on_a_worker",
            "worker-1",
            {"protocol": "tcp", "ports": "9090", "sources": ["10.20.0.0/16"]},
        ),
        _host_at(
            "fail_bm_alertmanager_on_a_worker",
            "worker-2",
            {"protocol": "tcp", "ports": 9093, "sources": ["10.20.1.0/24"]},
        ),
    ]
    assert refused(bare_metal_stack() + fixtures, "port-exposure", ONPREM) == fail_names(fixtures)
    violations = policy_harness.analyze(bare_metal_stack() + fixtures, cluster=ONPREM)
    messages = {v.resource: v.message for v in violations if v.policy == "port-exposure"}
    assert (
        "alertmanager 9093 runs on master only (monitoring.node); host worker-2"
        in messages["fail_bm_alertmanager_on_a_worker"]
    )


def _bastion_sg():
    return res(
        net.SECURITY_GROUP, "dev-bastion-sg", description="SSH jump host", tags={net.ROLE_TAG: "bastion-sg"}
    )


BASTION_FIXTURES = [
    ingress(
        "pass_ssh_from_bastion_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-bastion-sg-id",
        ipProtocol="tcp",
        fromPort=22,
        toPort=22,
    ),
    ingress(
        "pass_bastion_ssh_admin",
        "dev-bastion-sg",
        cidrIpv4="203.0.113.10/32",
        ipProtocol="tcp",
        fromPort=22,
        toPort=22,
    ),
    ingress(
        "fail_model_from_bastion_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-bastion-sg-id",
        ipProtocol="tcp",
        fromPort=5000,
        toPort=5000,
    ),
    ingress(
        "fail_all_from_bastion_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-bastion-sg-id",
        ipProtocol="-1",
    ),
    ingress(
        "fail_ssh_from_untagged_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-other-sg-id",
        ipProtocol="tcp",
        fromPort=22,
        toPort=22,
    ),
    ingress(
        "fail_bastion_ssh_world",
        "dev-bastion-sg",
        cidrIpv4="0.0.0.0/0",
        ipProtocol="tcp",
        fromPort=22,
        toPort=22,
    ),
    ingress(
        "fail_bastion_ssh_clients",
        "dev-bastion-sg",
        cidrIpv4="10.0.0.0/8",
        ipProtocol="tcp",
        fromPort=22,
        toPort=22,
    ),
    ingress(
        "fail_bastion_other_port_admin",
        "dev-bastion-sg",
        cidrIpv4="203.0.113.10/32",
        ipProtocol="tcp",
        fromPort=8080,
        toPort=8080,
    ),
]


def test_port_exposure_lets_nodes_take_ssh_from_the_bastion_sg_and_the_bastion_from_admins_only():
    others = [res(net.SECURITY_GROUP, "dev-other-sg", description="someone else's")]
    resources = aws_stack() + [_bastion_sg(), *others] + BASTION_FIXTURES
    assert refused(resources, "port-exposure") == fail_names(BASTION_FIXTURES)


def _host(name, *rules, load_balancer=False):
    command = firewall_command(name, "192.168.1.150", load_balancer=load_balancer)
    document = json.loads(command.inputs["triggers"][0])
    document["rules"] = [{"action": "allow", "description": "d", **rule} for rule in rules]
    command.inputs["triggers"] = command.outputs["triggers"] = [json.dumps(document)]
    command.name = name
    return command


def _host_at(name, host, *rules):
    """A firewall command for `host` of the onprem stack, with exactly `rules`."""
    command = _host(name, *rules)
    document = json.loads(command.inputs["triggers"][0])
    document["host"] = host
    command.inputs["triggers"] = command.outputs["triggers"] = [json.dumps(document)]
    return command


def test_port_exposure_applies_the_same_rules_to_host_firewalls():
    fixtures = [
        _host("pass_bm_members", {"protocol": "all", "sources": ["192.168.1.0/24"]}),
        _host(
            "pass_bm_listener",
            {"protocol": "tcp", "ports": "80", "sources": ["0.0.0.0/0"]},
            load_balancer=True,
        ),
        _host(
            "fail_bm_cluster_mixed",
            {"protocol": "tcp", "ports": "6000-6100", "sources": ["192.168.1.0/24", "::/0"]},
        ),
        _host("fail_bm_model_anywhere", {"protocol": "tcp", "ports": 5000}),
        _host("fail_bm_listener_not_lb", {"protocol": "tcp", "ports": "80", "sources": ["0.0.0.0/0"]}),
        _host("fail_bm_ssh_world", {"protocol": "tcp", "ports": "22", "sources": ["0.0.0.0/0"]}),
    ]
    assert refused(bare_metal_stack() + fixtures, "port-exposure", ONPREM) == fail_names(fixtures)


# The world split across rules of one target and port: each part alone passes (on the load
# balancer's group a non-listener port from a CIDR is not judged), together they are the world.
SPLIT_WORLD_FIXTURES = [
    ingress(
        "fail_split_ssh_low", "dev-lb-sg", cidrIpv4="0.0.0.0/1", ipProtocol="tcp", fromPort=22, toPort=22
    ),
    res(
        net.SECURITY_GROUP_RULE,
        "fail_split_ssh_high",
        type="ingress",
        protocol="6",
        fromPort=22.0,  # as the engine sends numbers
        toPort=22.0,
        cidrBlocks=["128.0.0.0/1"],
        securityGroupId="dev-lb-sg-id",
        description="d",
    ),
    _sg(
        "fail_split_inline_sg",
        "lb-sg",
        [
            {
                "protocol": "tcp",
                "fromPort": 3389,
                "toPort": 3389,
                "cidrBlocks": ["0.0.0.0/1"],
                "description": "d",
            }
        ],
    ),
    ingress(
        "fail_split_rdp_standalone",
        "fail_split_inline_sg",
        cidrIpv4="128.0.0.0/1",
        ipProtocol="tcp",
        fromPort=3389,
        toPort=3389,
    ),
    ingress(
        "fail_split_v6_a", "dev-lb-sg", cidrIpv6="2000::/4", ipProtocol="tcp", fromPort=9999, toPort=9999
    ),
    ingress(
        "fail_split_v6_b", "dev-lb-sg", cidrIpv6="3000::/4", ipProtocol="tcp", fromPort=9990, toPort=9999
    ),
    ingress(
        "pass_split_listener_low", "dev-lb-sg", cidrIpv4="0.0.0.0/1", ipProtocol="tcp", fromPort=80, toPort=80
    ),
    ingress(
        "pass_split_listener_high",
        "dev-lb-sg",
        cidrIpv4="128.0.0.0/1",
        ipProtocol="tcp",
        fromPort=80,
        toPort=80,
    ),
    ingress(
        "pass_halves_other_ports_low",
        "dev-lb-sg",
        cidrIpv4="0.0.0.0/1",
        ipProtocol="tcp",
        fromPort=7000,
        toPort=7000,
    ),
    ingress(
        "pass_halves_other_ports_high",
        "dev-lb-sg",
        cidrIpv4="128.0.0.0/1",
        ipProtocol="tcp",
        fromPort=7001,
        toPort=7001,
    ),
    ingress(
        "pass_halves_tcp_and_udp_tcp",
        "dev-lb-sg",
        cidrIpv4="0.0.0.0/1",
        ipProtocol="tcp",
        fromPort=7200,
        toPort=7200,
    ),
    ingress(
        "pass_halves_tcp_and_udp_udp",
        "dev-lb-sg",
        cidrIpv4="128.0.0.0/1",
        ipProtocol="udp",
        fromPort=7200,
        toPort=7200,
    ),
]


@pytest.mark.parametrize("cluster", [DEV, None], ids=["with the stack config", "without"])
def test_port_exposure_refuses_the_world_split_across_rules_and_resources(cluster):
    fixtures = SPLIT_WORLD_FIXTURES
    assert refused(aws_stack() + fixtures, "port-exposure", cluster) == fail_names(fixtures)


def test_each_part_of_a_split_world_passes_alone():
    for fixture in SPLIT_WORLD_FIXTURES:
        assert refused([*aws_stack(), fixture], "port-exposure") == set(), fixture.name


def test_a_split_world_message_names_the_parts_and_the_ports_the_world_reaches():
    violations = policy_harness.analyze(aws_stack() + SPLIT_WORLD_FIXTURES, cluster=DEV)
    messages = {v.resource: v.message for v in violations if v.policy == "port-exposure"}
    assert messages["fail_split_v6_b"] == (
        "fail_split_v6_b (9999/tcp) admits 2000::/4 (fail_split_v6_a) + 3000::/4 (fail_split_v6_b) "
        "(together every public IPv6 address: the world): only the load balancer listener (80/tcp) "
        "may be reached from the world"
    )
    assert "port 22 (SSH/RDP) is never open to the world" in messages["fail_split_ssh_high"]
    assert (
        "0.0.0.0/1 (fail_split_inline_sg) + 128.0.0.0/1 (fail_split_rdp_standalone)"
        in (messages["fail_split_inline_sg"])
    )


def test_host_firewalls_refuse_the_world_split_across_entries():
    fixtures = [
        _host(
            "pass_bm_listener_split",
            {"protocol": "tcp", "ports": "80", "sources": ["0.0.0.0/1"]},
            {"protocol": "tcp", "ports": 80, "sources": ["128.0.0.0/1"]},
            load_balancer=True,
        ),
        _host(
            "fail_bm_ssh_split",
            {"protocol": "tcp", "ports": "22", "sources": ["0.0.0.0/1", "10.0.0.0/8"]},
            {"protocol": "tcp", "ports": "20-30", "sources": ["128.0.0.0/1"]},
        ),
    ]
    assert refused(bare_metal_stack() + fixtures, "port-exposure", None) == fail_names(fixtures)


# Without the stack config only world exposure and all traffic from a known non-member are judged.
WORLD_EXPOSURE = {
    "fail_inline_mixed_cidrs",
    "fail_cluster_world",
    "fail_model_world_ipv6",
    "fail_ssh_world_on_lb",
    "fail_rdp_world_range",
    "fail_listener_port_on_nodes_world",
}


def test_without_a_stack_config_port_exposure_refuses_world_exposure_only():
    resources = aws_stack() + PORT_EXPOSURE_FIXTURES
    assert refused(resources, "port-exposure", cluster=None) == WORLD_EXPOSURE


def test_without_a_stack_config_all_traffic_from_a_non_member_group_is_still_refused():
    others = [res(net.SECURITY_GROUP, "dev-other-sg", description="someone else's")]
    resources = aws_stack() + [_bastion_sg(), *others] + BASTION_FIXTURES
    assert refused(resources, "port-exposure", cluster=None) == {
        "fail_all_from_bastion_sg",  # all traffic from the bastion's group: not a member
        "fail_bastion_ssh_world",  # world
        "fail_bastion_other_port_admin",  # the bastion takes SSH only, whoever asks
    }


def test_without_a_stack_config_the_world_may_reach_the_listeners_the_stack_declares():
    resources = aws_stack()
    listener = next(r for r in resources if r.name == "dev-listener")
    listener.inputs["port"] = listener.outputs["port"] = 8080
    fixtures = [
        ingress(
            "pass_world_8080", "dev-lb-sg", cidrIpv4="0.0.0.0/0", ipProtocol="tcp", fromPort=8080, toPort=8080
        ),
        ingress("fail_world_80", "dev-lb-sg", cidrIpv4="0.0.0.0/0", ipProtocol="tcp", fromPort=80, toPort=80),
    ]
    assert refused(resources + fixtures, "port-exposure", cluster=None) == {"fail_world_80"}


def test_without_a_stack_config_host_members_are_the_hosts_addresses_even_aggregated():
    fixtures = [
        _host("pass_bm_two_hosts_as_one_block", {"protocol": "all", "sources": ["192.168.1.100/31"]}),
        _host("fail_bm_whole_segment", {"protocol": "all", "sources": ["192.168.1.0/24"]}),
        _host("pass_bm_monitoring_relaxed", {"protocol": "tcp", "ports": "8000", "sources": ["10.1.0.0/16"]}),
    ]
    assert refused(bare_metal_stack() + fixtures, "port-exposure", cluster=None) == {"fail_bm_whole_segment"}


def test_without_a_stack_config_one_advisory_names_the_relaxed_checks():
    violations = policy_harness.analyze(aws_stack() + PORT_EXPOSURE_FIXTURES, cluster=None)
    (notice,) = [v for v in violations if v.policy == "stack-config"]
    assert notice.enforcement == "advisory" and notice.resource is None
    assert "PULUMI_CONFIG is not set" in notice.message
    for relaxed in ("port-exposure", "required-paths", "efa-placement", "bandwidth-class"):
        assert f"{relaxed}:" in notice.message
    assert not [v for v in policy_harness.analyze(aws_stack(), cluster=DEV) if v.policy == "stack-config"]


def test_the_stack_config_from_the_engine_is_validated_or_says_why_it_is_missing():
    def facts(values, present=True):
        return pack_facts._facts_from_engine(json.dumps(values, sort_keys=True), present)

    values, _ = stackfile.as_pulumi_config(stackfile.read("dev"))
    assert facts(values).known and facts(values).listener_ports == (80,)
    assert facts({}, present=False).unknown_because == pack_facts.NO_CONFIG
    assert facts({"aws:region": "us-west-2"}).unknown_because == "PULUMI_CONFIG holds no qwen-cluster: keys"
    broken = {**values, "qwen-cluster:nodes": "[]"}
    assert facts(broken).unknown_because.startswith("the stack config in PULUMI_CONFIG is not valid: ")
    assert not facts(broken).known


def test_the_pack_validates_the_engine_config_with_the_stack_region_as_the_program_does():
    """The program validates with aws:region (qwen_cluster/config/loading.py from_pulumi); a zone outside
    it is refused there, so the pack must not judge the stack by that config either."""
    stack_config = {**stackfile.read("dev"), "aws:region": "eu-west-1"}
    values, _ = stackfile.as_pulumi_config(stack_config)
    with pytest.raises(config.ConfigError) as refused_by_program:
        config.validate(stackfile.cluster_keys(stack_config), aws_region="eu-west-1")
    judged = pack_facts._facts_from_engine(json.dumps(values, sort_keys=True), True)
    assert not judged.known
    assert (
        judged.unknown_because
        == f"the stack config in PULUMI_CONFIG is not valid: {refused_by_program.value}"
    )
    assert "aws.availabilityZone us-west-2a is not in aws:region eu-west-1" in judged.unknown_because


def test_without_a_stack_config_efa_devices_are_expected_only_where_the_stack_uses_efa():
    resources = aws_stack()
    template = next(r for r in resources if r.name == "dev-node-template")
    template.outputs["networkInterfaces"][0]["interfaceType"] = "interface"
    assert refused(resources, "efa-placement", cluster=DEV) == {"dev-master", "dev-worker-1"}  # aws.efa: true
    assert refused(resources, "efa-placement", cluster=None) == set()


# --- bandwidth-class ----------------------------------------------------------------------------

BANDWIDTH_FIXTURES = [
    instance("pass_g6e_node"),
    res(net.INSTANCE, "pass_untagged_bastion", instanceType="t3.large"),
    res(net.LAUNCH_TEMPLATE, "pass_p5_template", instanceType="p5.48xlarge"),
    res(
        net.AUTOSCALING_GROUP,
        "pass_asg_p5",
        mixedInstancesPolicy={"launchTemplate": {"overrides": [{"instanceType": "p5.48xlarge"}]}},
    ),
    res(net.INSTANCE, "fail_tagged_t3", instanceType="t3.large", tags={net.ROLE_TAG: "gpu-node"}),
    res(net.INSTANCE, "fail_unknown_gpu_type", instanceType="g7.99xlarge"),
    res(net.LAUNCH_TEMPLATE, "fail_g5_xlarge_template", instanceType="g5.xlarge"),
    res(
        net.AUTOSCALING_GROUP,
        "fail_asg_override",
        mixedInstancesPolicy={
            "launchTemplate": {
                "overrides": [{"instanceType": "p5.48xlarge"}, {"instanceType": "g4dn.xlarge"}]
            }
        },
    ),
    firewall_command("pass-host", "192.168.1.100"),
]


def test_bandwidth_class_refuses_exactly_the_fail_fixtures():
    slow = firewall_command("slow", "192.168.1.101")
    document = json.loads(slow.inputs["triggers"][0])
    document["nicSpeedGbps"] = 1
    slow.inputs["triggers"] = [json.dumps(document)]
    slow.name = "fail_bm_slow_nic"
    fixtures = [*BANDWIDTH_FIXTURES, slow]
    assert refused(fixtures, "bandwidth-class", cluster=None) == fail_names(fixtures)


def test_an_unknown_gpu_type_is_sent_to_the_catalog():
    violations = policy_harness.analyze([res(net.INSTANCE, "n", instanceType="g7.99xlarge")])
    assert "not in the catalog (qwen_cluster/catalog.py)" in violations[0].message


def test_the_stack_floor_and_the_policy_config_both_raise_the_bar():
    node = [instance("g5_node", kind="g5.12xlarge")]  # 40 Gbit/s
    assert refused(node, "bandwidth-class", cluster=DEV) == set()  # dev floor 25
    assert refused(node, "bandwidth-class", cluster=PROD) == {"g5_node"}  # prod floor 400
    config = {"bandwidth-class": {"minBandwidthGbps": 50}}
    assert refused(node, "bandwidth-class", cluster=DEV, policy_config=config) == {"g5_node"}


def _host_with_nic(name: str, gbps: float):
    host = firewall_command(name, "192.168.1.101")
    document = json.loads(host.inputs["triggers"][0])
    document["nicSpeedGbps"] = gbps
    host.inputs["triggers"] = [json.dumps(document)]
    host.name = name
    return host


def test_the_guides_minimum_is_mandatory_and_its_recommendation_advisory():
    hosts = [_host_with_nic(f"nic_{gbps:g}", gbps) for gbps in (1, 10, 20, 25, 100)]
    assert refused(hosts, "bandwidth-class", cluster=None) == {"nic_1"}
    assert refused(hosts, "bandwidth-recommended", cluster=None) == {"nic_10", "nic_20"}
    [advice] = [
        v
        for v in policy_harness.analyze(hosts, cluster=None)
        if v.policy == "bandwidth-recommended" and v.resource == "nic_20"
    ]
    assert advice.enforcement == "advisory"
    assert advice.message.endswith("NIC 20 Gbit/s is below the recommended 25 Gbit/s")


def test_a_stack_that_raises_its_floor_makes_it_mandatory():
    hosts = [_host_with_nic("nic_10", 10)]
    raised = ONPREM.model_copy(
        update={"network": ONPREM.network.model_copy(update={"min_bandwidth_gbps": 25})}
    )
    assert refused(hosts, "bandwidth-class", cluster=raised) == {"nic_10"}
    assert refused(hosts, "bandwidth-recommended", cluster=raised) == set()  # the mandatory one says it


def test_the_committed_policy_config_keeps_the_configs_floor():
    committed = json.loads((POLICIES_DIR / "config.json").read_text())
    settings = guard.settings("bandwidth-class", committed.get("bandwidth-class"))
    assert settings["minBandwidthGbps"] == config.MIN_BANDWIDTH_GBPS


# --- required-paths -----------------------------------------------------------------------------


def test_required_paths_refuses_a_node_group_without_its_egress_self_rule():
    assert refused(without_egress_self_rule(aws_stack()), "required-paths") == {"dev-node-sg"}


def test_required_paths_follows_inline_self_rules_too():
    resources = [r for r in aws_stack() if r.name not in ("dev-cluster-in", "dev-cluster-out")]
    group = next(r for r in resources if r.name == "dev-node-sg")
    entry = {"protocol": "-1", "fromPort": 0, "toPort": 0, "self": True, "description": "members"}
    group.inputs["ingress"] = group.outputs["ingress"] = [entry]
    assert refused(resources, "required-paths") == {"dev-node-sg"}  # egress still missing
    group.inputs["egress"] = group.outputs["egress"] = [entry]
    assert refused(resources, "required-paths") == set()


def test_required_paths_refuses_targets_the_load_balancer_cannot_reach():
    resources = [r for r in aws_stack() if r.name != "dev-model-in"]
    assert refused(resources, "required-paths") == {"dev-master", "dev-worker-1"}


@pytest.mark.parametrize("port", [8000, 8000.0])
def test_required_paths_refuses_a_target_group_on_the_wrong_port(port):
    resources = aws_stack()
    group = next(r for r in resources if r.name == "dev-model")
    group.inputs["port"] = group.outputs["port"] = port
    violations = policy_harness.analyze(resources, cluster=DEV)
    (message,) = [v.message for v in violations if v.policy == "required-paths"]
    assert message == "target group dev-model forwards to port 8000; the model listens on 5000"


def test_the_harness_hands_the_policies_numbers_as_the_engine_does():
    assert policy_harness.as_sent({"port": 5000, "ok": True, "ports": (22, 3389), "n": None}) == {
        "port": 5000.0,
        "ok": True,
        "ports": [22.0, 3389.0],
        "n": None,
    }


def test_required_paths_needs_no_self_rules_without_efa_when_configured_so():
    resources = without_egress_self_rule(aws_stack())
    config = {"required-paths": {"efaSelfRules": False}}
    assert refused(resources, "required-paths", policy_config=config) == set()


def test_required_paths_refuses_a_host_the_load_balancer_cannot_reach():
    resources = bare_metal_stack()
    worker = next(r for r in resources if r.name == "onprem-worker-2-firewall")
    document = json.loads(worker.inputs["triggers"][0])
    document["rules"] = [rule for rule in document["rules"] if rule["ports"] != "5000"]
    # The members' all-traffic rule would still admit the master (the load balancer): narrow it.
    document["rules"][0]["sources"] = ["192.168.1.101/32", "192.168.1.103/32"]
    worker.inputs["triggers"] = worker.outputs["triggers"] = [json.dumps(document)]
    assert refused(resources, "required-paths", ONPREM) == {"onprem-worker-2-firewall"}


# --- efa-placement ------------------------------------------------------------------------------


def test_efa_placement_refuses_a_spread_placement_group():
    assert refused(placement_strategy(aws_stack(), "spread"), "efa-placement") == {
        "dev-master",
        "dev-worker-1",
    }


def test_efa_placement_refuses_a_node_outside_any_placement_group():
    resources = aws_stack()
    template = next(r for r in resources if r.name == "dev-node-template")
    del template.outputs["placement"]
    resources.append(instance("fail_loose", placementGroup=None, launchTemplate=None))
    for r in resources:
        r.outputs = {k: v for k, v in r.outputs.items() if v is not None}
    assert refused(resources, "efa-placement") == {"fail_loose"}


def test_efa_placement_follows_an_instance_to_its_launch_templates_placement_group_by_id():
    resources = aws_stack()
    for r in resources:
        for props in (r.inputs, r.outputs):
            if r.type == net.INSTANCE:
                props.pop("placementGroup", None)
            if r.name == "dev-node-template":
                props["placement"] = {"groupId": "dev-placement-id", "availabilityZone": "us-west-2a"}
    assert refused(resources, "efa-placement") == set()
    assert refused(placement_strategy(resources, "spread"), "efa-placement") == {"dev-master", "dev-worker-1"}


def test_efa_placement_refuses_nodes_in_two_subnets():
    resources = aws_stack() + [
        instance("dev-worker-2", subnetId="other-subnet", availabilityZone="us-west-2b")
    ]
    violations = policy_harness.analyze(resources, cluster=DEV)
    messages = [v.message for v in violations if v.policy == "efa-placement"]
    assert any("2 subnets" in m for m in messages) and any("2 availability zones" in m for m in messages)


def test_efa_placement_refuses_missing_efa_interfaces_when_efa_is_configured():
    resources = aws_stack()
    template = next(r for r in resources if r.name == "dev-node-template")
    template.outputs["networkInterfaces"][0]["interfaceType"] = "interface"
    assert refused(resources, "efa-placement") == {"dev-master", "dev-worker-1"}
    assert refused(resources, "efa-placement", policy_config={"efa-placement": {"efa": "off"}}) == set()


def test_efa_placement_counts_one_efa_device_per_network_card():
    resources = aws_stack()
    for r in resources:
        if r.type in (net.INSTANCE, net.LAUNCH_TEMPLATE):
            r.outputs["instanceType"] = "p5.48xlarge"
    violations = policy_harness.analyze(resources, cluster=PROD)
    messages = {v.message for v in violations if v.policy == "efa-placement"}
    assert any("needs 32" in m for m in messages)


# --- node-count ---------------------------------------------------------------------------------


def test_node_count_refuses_a_one_node_cluster_on_aws_and_bare_metal():
    assert refused(one_node(aws_stack()), "node-count") == {None}
    assert refused(one_node(bare_metal_stack()), "node-count", ONPREM) == {None}


def test_node_count_counts_autoscaling_groups_and_takes_its_floor_from_config():
    asg = res(
        net.AUTOSCALING_GROUP, "pool", desiredCapacity=3, tags=[{"key": net.ROLE_TAG, "value": "gpu-node"}]
    )
    assert refused([asg], "node-count", cluster=None) == set()
    assert refused([asg], "node-count", cluster=None, policy_config={"node-count": {"minNodes": 4}}) == {None}


# --- baseline -----------------------------------------------------------------------------------


def test_imdsv2_refuses_exactly_the_fail_fixtures():
    fixtures = [
        instance("pass_required"),
        res(net.INSTANCE, "pass_from_template", instanceType="t3.large", launchTemplate={"id": "x"}),
        res(net.LAUNCH_TEMPLATE, "pass_template", metadataOptions={"httpTokens": "required"}),
        instance("fail_optional", metadataOptions={"httpTokens": "optional"}),
        res(net.INSTANCE, "fail_unset_bastion", instanceType="t3.large"),
        res(net.LAUNCH_TEMPLATE, "fail_template_unset", instanceType="g6e.12xlarge"),
    ]
    assert refused(fixtures, "baseline-imdsv2", cluster=None) == fail_names(fixtures)


def test_ebs_encryption_refuses_exactly_the_fail_fixtures():
    fixtures = [
        instance("pass_encrypted"),
        res(net.LAUNCH_TEMPLATE, "pass_template", blockDeviceMappings=[{"ebs": {"encrypted": "true"}}]),
        res("aws:ebs/volume:Volume", "pass_volume", encrypted=True),
        instance("fail_root_plain", rootBlockDevice={"encrypted": False}),
        instance("fail_data_plain", ebsBlockDevices=[{"deviceName": "/dev/sdf", "encrypted": False}]),
        res(net.INSTANCE, "fail_no_root", instanceType="t3.large"),
        res(
            net.LAUNCH_TEMPLATE, "fail_template_plain", blockDeviceMappings=[{"ebs": {"encrypted": "false"}}]
        ),
        res(net.LAUNCH_TEMPLATE, "fail_template_none"),
    ]
    assert refused(fixtures, "baseline-ebs-encryption", cluster=None) == fail_names(fixtures)


def test_no_public_ip_refuses_exactly_the_fail_fixtures():
    fixtures = [
        instance("pass_private"),
        res(net.INSTANCE, "pass_public_bastion", instanceType="t3.large", associatePublicIpAddress=True),
        instance("fail_public", associatePublicIpAddress=True),
        res(
            net.LAUNCH_TEMPLATE,
            "fail_template_public",
            instanceType="p5.48xlarge",
            networkInterfaces=[{"deviceIndex": 0, "associatePublicIpAddress": "true"}],
        ),
    ]
    assert refused(fixtures, "baseline-no-public-ip", cluster=None) == fail_names(fixtures)


def test_rule_descriptions_refuses_exactly_the_fail_fixtures():
    fixtures = [
        ingress("pass_described", "g", ipProtocol="-1"),
        ingress("fail_blank", "g", description=" ", ipProtocol="-1"),
        res(net.SECURITY_GROUP_RULE, "fail_rule_none", type="ingress", protocol="tcp", fromPort=1, toPort=1),
        res(
            net.SECURITY_GROUP, "fail_inline_egress", egress=[{"protocol": "-1", "cidrBlocks": ["0.0.0.0/0"]}]
        ),
        _host(
            "fail_host_rule",
            {"protocol": "tcp", "ports": "5000", "sources": ["192.168.1.100/32"], "description": ""},
        ),
        firewall_command("pass-host", "192.168.1.100"),
    ]
    assert refused(fixtures, "baseline-rule-descriptions", cluster=None) == fail_names(fixtures)


def test_container_host_network_refuses_exactly_the_fail_fixtures():
    published = {"internal": 5000.0, "external": 5000.0, "ip": "0.0.0.0", "protocol": "tcp"}
    fixtures = [
        container("pass_host_network"),
        container("pass_host_network_upper", networkMode="HOST"),
        container("pass_mode_unknown", networkMode=UNKNOWN_STRING_VALUE),
        container("fail_publishes_on_host", ports=[published]),
        container("fail_bridge", networkMode="bridge"),
        container("fail_mode_unset", networkMode=None),
        container("fail_publishes_on_bridge", networkMode="bridge", ports=[published]),
        container("fail_user_network", networkMode="qwen", networksAdvanced=[{"name": "qwen"}]),
    ]
    assert refused(fixtures, "container-host-network", cluster=None) == fail_names(fixtures)


def test_a_published_port_is_named_with_its_host_side():
    fixture = container(
        "fail_publishes", ports=[{"internal": 5000.0, "external": 15000.0, "protocol": "tcp"}]
    )
    violations = policy_harness.analyze([fixture], cluster=None)
    assert [v.message for v in violations if v.policy == "container-host-network"] == [
        "ports[0] publishes 0.0.0.0:15000->5000/tcp: docker's NAT rules bypass the host firewall; "
        "run on the host network instead"
    ]


def test_every_container_of_the_onprem_stack_is_on_the_host_network():
    render, violations = rendered("onprem")
    assert [r for r in render.resources if r.type == CONTAINER]
    assert [v for v in violations if v.policy == "container-host-network"] == []


def test_tls_policy_refuses_exactly_the_fail_fixtures():
    fixtures = [
        res(net.LISTENER, "pass_tcp", protocol="TCP"),
        res(
            net.LISTENER,
            "pass_tls_res_pq",
            protocol="TLS",
            sslPolicy="ELBSecurityPolicy-TLS13-1-2-Res-PQ-2025-09",
        ),
        res(net.LISTENER, "pass_tls_2021", protocol="TLS", sslPolicy="ELBSecurityPolicy-TLS13-1-2-2021-06"),
        res(net.LISTENER, "pass_https_13", protocol="HTTPS", sslPolicy="ELBSecurityPolicy-TLS13-1-3-2021-06"),
        res(net.LISTENER, "pass_tls_unknown", protocol="TLS", sslPolicy=UNKNOWN_STRING_VALUE),
        res(net.LISTENER, "fail_tls_absent", protocol="TLS"),
        res(net.LISTENER, "fail_tls_2016", protocol="tls", sslPolicy="ELBSecurityPolicy-2016-08"),
        res(net.LISTENER, "fail_tls13_1_0", protocol="TLS", sslPolicy="ELBSecurityPolicy-TLS13-1-0-2021-06"),
        res(net.LISTENER, "fail_tls13_1_1", protocol="TLS", sslPolicy="ELBSecurityPolicy-TLS13-1-1-2021-06"),
        res(net.LISTENER, "fail_https_fs", protocol="HTTPS", sslPolicy="ELBSecurityPolicy-FS-1-2-2019-08"),
    ]
    assert refused(fixtures, "baseline-tls-policy", cluster=None) == fail_names(fixtures)


def test_a_tls_listener_without_a_policy_is_told_the_api_default():
    violations = policy_harness.analyze([res(net.LISTENER, "fail_tls_absent", protocol="TLS")], cluster=None)
    assert [v.message for v in violations if v.policy == "baseline-tls-policy"] == [
        "a TLS listener without sslPolicy gets the API default ELBSecurityPolicy-2016-08, "
        "which allows TLS 1.0 and 1.1; name a current policy"
    ]


def test_health_check_refuses_exactly_the_fail_fixtures():
    fixtures = [
        res(net.TARGET_GROUP, "pass_checked", healthCheck={"enabled": True, "path": "/health"}),
        res(net.TARGET_GROUP, "fail_unchecked"),
        res(net.TARGET_GROUP, "fail_disabled", healthCheck={"enabled": False}),
    ]
    assert refused(fixtures, "baseline-health-check", cluster=None) == fail_names(fixtures)


def test_idle_timeout_is_advisory_and_refuses_exactly_the_fail_fixtures():
    fixtures = [
        res(net.LISTENER, "pass_nlb_hour", protocol="TCP", tcpIdleTimeoutSeconds=3600),
        res(net.LISTENER, "fail_nlb_default", protocol="TCP"),
        res(net.LOAD_BALANCER, "fail_alb_default", loadBalancerType="application"),
        res(net.LOAD_BALANCER, "pass_nlb", loadBalancerType="network"),
        res(net.REMOTE_COMMAND, "fail_nginx_60s", create="proxy_read_timeout 60s;"),
        res(net.REMOTE_COMMAND, "pass_nginx_hour", create="proxy_read_timeout 1h; proxy_send_timeout 3600;"),
        # A short timeout on a health-check location beside the long one on the streams.
        res(
            net.REMOTE_COMMAND,
            "pass_nginx_health_10s",
            create="proxy_read_timeout 3600s; proxy_read_timeout 10s;",
        ),
        res(
            net.REMOTE_COMMAND,
            "fail_nginx_all_short",
            create="proxy_read_timeout 60s; proxy_read_timeout 10s;",
        ),
    ]
    violations = policy_harness.analyze(fixtures, cluster=None)
    assert {v.resource for v in violations if v.policy == "baseline-idle-timeout"} == fail_names(fixtures)
    assert {v.enforcement for v in violations if v.policy == "baseline-idle-timeout"} == {"advisory"}


def test_an_nlb_idle_timeout_of_60_s_is_flagged_and_printed_as_an_integer():
    fixtures = [res(net.LISTENER, "nlb", protocol="TCP", tcpIdleTimeoutSeconds=60.0)]
    violations = policy_harness.analyze(
        fixtures, policy_config={"baseline-idle-timeout": {"minIdleTimeoutSeconds": 900}}
    )
    assert [v.message for v in violations if v.policy == "baseline-idle-timeout"] == [
        "tcpIdleTimeoutSeconds 60 is below 900 s: a silent, thinking answer is cut off"
    ]


def test_a_policy_that_reads_an_unknown_value_gets_the_analyzers_preview_advisory():
    def read_group(args, report):
        report(str(args.props["securityGroupId"]))

    def read_first_group(args, report):
        report(str(args.resources[0].props["securityGroupId"]))

    policies = [
        ResourceValidationPolicy(name="reads", description="d", validate=read_group),
        StackValidationPolicy(name="reads-stack", description="d", validate=read_first_group),
    ]
    rule = ingress("rule", "g", ipProtocol="-1")
    rule.inputs["securityGroupId"] = rule.outputs["securityGroupId"] = UNKNOWN_STRING_VALUE
    violations = policy_harness.analyze([rule], policies=policies)
    pack = "from policy pack 'qwen-cluster-guard@v0.0.1' during preview"
    unknown = "string value at .securityGroupId can't be known during preview"
    assert [(v.policy, v.enforcement, v.resource, v.message) for v in violations] == [
        ("reads", "advisory", "rule", f"can't run policy 'reads' {pack}: {unknown}"),
        ("reads-stack", "advisory", None, f"can't run policy 'reads-stack' {pack}: {unknown}"),
    ]


def test_a_secret_script_is_judged_on_its_plain_text():
    secret = {"4dabf18193072939515e22adb298388d": "1b47061264138c4ac30d75fd1eb44270", "value": "setenforce 0"}
    fixtures = [res(net.REMOTE_COMMAND, "fail_secret_script", create=secret)]
    assert refused(fixtures, "baseline-selinux", cluster=None) == {"fail_secret_script"}


def test_config_numbers_are_printed_as_integers():
    config = {"node-count": {"minNodes": 3.0}}
    violations = policy_harness.analyze(one_node(aws_stack()), cluster=quiet(DEV), policy_config=config)
    (violation,) = list(violations)
    assert "the cluster needs at least 3 (4 or more recommended)" in violation.message


def test_selinux_refuses_exactly_the_fail_fixtures():
    fixtures = [
        res(net.REMOTE_COMMAND, "pass_rdma", create="apt-get install -y libibverbs1 ibverbs-utils rdma-core"),
        res(net.REMOTE_COMMAND, "fail_setenforce", create="sudo setenforce 0 || true"),
        res(
            net.LOCAL_COMMAND,
            "fail_config",
            create="sed -i 's/^SELINUX=.*/SELINUX=permissive/' /etc/selinux/config",
        ),
        res(net.LAUNCH_TEMPLATE, "fail_user_data", userData="IyEvYmluL3NoCnNldGVuZm9yY2UgMAo="),
    ]
    assert refused(fixtures, "baseline-selinux", cluster=None) == fail_names(fixtures)


# --- the pack itself ----------------------------------------------------------------------------


def test_every_policy_has_description_severity_remediation_and_schema():
    for policy in guard.POLICIES:
        assert policy.description and policy.severity and policy.remediation_steps, policy.name
        assert (
            policy.config_schema is not None and policy.config_schema.properties == guard.SCHEMAS[policy.name]
        )
    assert len({p.name for p in guard.POLICIES}) == len(guard.POLICIES)


def test_defaults_mirror_the_schema_defaults():
    for name, schema in guard.SCHEMAS.items():
        for key, spec in schema.items():
            assert guard.settings(name, {})[key] == spec["default"]


def test_the_example_config_names_real_policies_and_properties():
    example = json.loads((POLICIES_DIR / "config.json").read_text())
    for name, values in example.items():
        assert name in guard.SCHEMAS, name
        for key in values:
            assert key == "enforcementLevel" or key in guard.SCHEMAS[name], (name, key)


def test_a_disabled_policy_does_not_run():
    config = {"node-count": {"enforcementLevel": "disabled"}}
    assert refused(one_node(aws_stack()), "node-count", policy_config=config) == set()


@pytest.mark.parametrize("name", ["PulumiPolicy.yaml", "requirements.txt", "__main__.py"])
def test_the_pack_directory_is_complete(name):
    assert (POLICIES_DIR / name).is_file()


def test_the_pack_entry_point_builds_the_named_pack_with_every_policy():
    text = (POLICIES_DIR / "__main__.py").read_text()
    assert "PolicyPack(PACK_NAME" in text and "policies=POLICIES" in text
    assert guard.PACK_NAME == "qwen-cluster-guard"
