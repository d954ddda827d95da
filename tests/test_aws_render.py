"""The AWS target's pure renderers: VPC plan, security-group rules, interfaces, user data."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qwen_cluster import catalog, config
from qwen_cluster.ports import Peer, Target
from qwen_cluster.render import cloudinit, ec2, sg_rules, vpc_plan
from qwen_cluster.render.sysctl import DROPIN_PATH
from tests.helpers.aws_stacks import variant
from tests.helpers.baremetal import shellcheck
from tooling import stackfile


def cluster_of(stack_config) -> config.ClusterConfig:
    return config.validate(stackfile.cluster_keys(stack_config))


# --- VPC plan --------------------------------------------------------------------------


@given(
    address=st.integers(min_value=0, max_value=2**32 - 1),
    prefix=st.integers(min_value=17, max_value=28),
    internet_facing=st.booleans(),
)
def test_vpc_plan_fits_public_subnets_beside_the_node_subnet(address, prefix, internet_facing):
    node = ipaddress.IPv4Network((address, prefix), strict=False)
    plan = vpc_plan.plan(node, internet_facing=internet_facing)
    assert plan.node_subnet == node
    assert 16 <= plan.vpc_cidr.prefixlen < node.prefixlen and node.subnet_of(plan.vpc_cidr)
    assert len(plan.public_subnets) == (2 if internet_facing else 1)
    for subnet in plan.public_subnets:
        assert subnet.subnet_of(plan.vpc_cidr) and not subnet.overlaps(node)
        assert subnet.prefixlen <= 28  # AWS's smallest subnet
    if internet_facing:
        assert not plan.public_subnets[0].overlaps(plan.public_subnets[1])


def test_vpc_plan_refuses_a_slash_16_node_subnet():
    with pytest.raises(ValueError, match="no room"):
        vpc_plan.plan(ipaddress.IPv4Network("10.0.0.0/16"), internet_facing=False)


def test_config_refuses_a_slash_16_network_on_aws():
    raw = stackfile.cluster_keys(variant("dev", network={"cidr": "10.42.0.0/16"}))
    with pytest.raises(config.ConfigError, match=r"network.cidr 10.42.0.0/16 is a /16, as large as a VPC"):
        config.validate(raw)


# --- exposures with a bastion ----------------------------------------------------------


def test_bastion_turns_ssh_into_a_bastion_only_path():
    prod = stackfile.load("prod")
    ssh = [e for e in prod.exposures() if e.ports is not None and e.ports.low == 22]
    assert {(e.target, e.peer, e.cidrs) for e in ssh} == {
        (Target.NODES, Peer.BASTION, ()),
        (Target.BASTION, Peer.CIDRS, ("203.0.113.10/32",)),
    }


def test_no_bastion_means_no_ssh_on_aws():
    dev = stackfile.load("dev")
    assert not [e for e in dev.exposures() if e.ports is not None and e.ports.low == 22]


def test_bare_metal_ssh_still_comes_from_admin_cidrs():
    onprem = stackfile.load("onprem")
    (ssh,) = [e for e in onprem.exposures() if e.name == "ssh"]
    assert ssh.peer is Peer.CIDRS and ssh.target is Target.NODES


# --- security-group rules --------------------------------------------------------------


def test_rules_mirror_every_group_reference_with_an_egress_rule():
    specs = sg_rules.rules(stackfile.load("prod").exposures())
    ingress = {(s.group, s.peer_group, s.protocol, s.from_port) for s in specs if s.direction == "ingress"}
    egress = {(s.peer_group, s.group, s.protocol, s.from_port) for s in specs if s.direction == "egress"}
    referenced = {rule for rule in ingress if rule[1] is not None}
    assert referenced and referenced <= egress


def test_cidr_lists_give_one_rule_per_cidr_and_ipv6_goes_to_cidr_ipv6():
    cluster = cluster_of(variant("dev", access={"clientCidrs": ["10.0.0.0/8", "2001:db8::/32"]}))
    listener = [
        s
        for s in sg_rules.rules(cluster.exposures())
        if s.group == "load-balancer" and s.direction == "ingress"
    ]
    assert [(s.cidr_ipv4, s.cidr_ipv6) for s in listener] == [("10.0.0.0/8", None), (None, "2001:db8::/32")]
    assert len({s.key for s in listener}) == 2


def test_rule_descriptions_are_what_ec2_accepts():
    for stack in ("dev", "prod"):
        for spec in sg_rules.rules(stackfile.load(stack).exposures()):
            assert sg_rules.DESCRIPTION.match(spec.description), spec.description


def test_node_egress_beyond_the_cluster_is_https_only():
    specs = sg_rules.rules(stackfile.load("dev").exposures())
    outside = [s for s in specs if s.group == "nodes" and s.direction == "egress" and s.peer_group is None]
    assert [(s.protocol, s.from_port, s.to_port, s.cidr_ipv4) for s in outside] == [
        ("tcp", 443, 443, "0.0.0.0/0")
    ]


# --- interfaces and disk ---------------------------------------------------------------


def test_p5_interfaces():
    specs = ec2.network_interfaces(catalog.INSTANCE_TYPES["p5.48xlarge"], True, "10.50.1.100")
    assert len(specs) == 32
    assert [s.network_card_index for s in specs] == list(range(32))
    assert (specs[0].interface_type, specs[0].device_index, specs[0].private_ip) == ("efa", 0, "10.50.1.100")
    assert all(
        s.interface_type == "efa-only" and s.device_index == 0 and s.private_ip is None for s in specs[1:]
    )


def test_p4d_extra_cards_get_full_efa_interfaces_at_device_one():
    specs = ec2.network_interfaces(catalog.INSTANCE_TYPES["p4d.24xlarge"], True, "10.0.0.10")
    assert [(s.network_card_index, s.device_index, s.interface_type) for s in specs] == [
        (0, 0, "efa"),
        (1, 1, "efa"),
        (2, 1, "efa"),
        (3, 1, "efa"),
    ]


def test_g6e_12xlarge_interfaces():
    specs = ec2.network_interfaces(catalog.INSTANCE_TYPES["g6e.12xlarge"], True, "10.42.1.100")
    assert [(s.network_card_index, s.device_index, s.interface_type, s.private_ip) for s in specs] == [
        (0, 0, "efa", "10.42.1.100")
    ]


def test_root_volume_holds_image_and_weights():
    for model in catalog.MODELS.values():
        size = ec2.root_volume_gb(model.weights_gb)
        assert size % 10 == 0
        assert size >= ec2.AMI_ROOT_GB + ec2.CONTAINER_IMAGE_GB + model.weights_gb


# --- user data -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prod_script() -> str:
    return cloudinit.user_data(stackfile.load("prod"), "worker-1")


def test_user_data_is_the_machine_only_so_model_and_tuning_changes_never_touch_it():
    base = stackfile.read("prod")
    changed = variant(
        "prod",
        model={"image": "vllm/vllm-openai:v0.33.1", "vllmFlags": {"--enable-prefix-caching": True}},
        tuning={"sysctl": {"net.core.rmem_max": 33554432}},
        rollout={"healthTimeoutSeconds": 600},
    )
    for node in ("master", "worker-1"):
        assert cloudinit.user_data(cluster_of(base), node) == cloudinit.user_data(cluster_of(changed), node)
    script = cloudinit.user_data(cluster_of(base), "master")
    for absent in ("vllm", "docker", "sysctl", DROPIN_PATH):
        assert absent not in script


def test_user_data_sets_mtu_9001_on_the_interface_holding_the_node_ip(prod_script):
    assert "NODE_IP=10.50.1.101" in prod_script
    assert 'ip link set dev "$IFACE" mtu 9001' in prod_script


def test_user_data_checks_efa_only_when_efa_is_on(prod_script):
    assert "fi_info -p efa" in prod_script
    cluster = cluster_of(variant("dev", aws={"efa": False}))
    script = cloudinit.user_data(cluster, "master")
    assert "fi_info" not in script and "FI_PROVIDER" not in script and "/dev/infiniband" not in script


def test_user_data_holds_no_secret():
    cluster = stackfile.load("prod")
    for node in cluster.nodes:
        script = cloudinit.user_data(cluster, node.name)
        for marker in ("PRIVATE KEY", "sshPrivateKey", "HF_TOKEN", "AWS_SECRET"):
            assert marker not in script
        assert len(script.encode()) <= cloudinit.USER_DATA_LIMIT


def test_user_data_is_valid_bash(prod_script, tmp_path):
    path = tmp_path / "user-data.sh"
    path.write_text(prod_script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_user_data_passes_shellcheck(prod_script, tmp_path):
    shellcheck(prod_script, tmp_path)
