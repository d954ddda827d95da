"""The AWS target rendered from the real __main__.py under Pulumi mocks (stacks dev, prod)."""

from __future__ import annotations

import base64

import pytest

from qwen_cluster import catalog
from tests.helpers.aws_stacks import (
    INSTANCE,
    LAUNCH_TEMPLATE,
    SG_ATTACHMENT,
    render,
    render_stack,
    rule_set,
    sg_rule_resources,
    variant,
)
from tooling import stackfile

WORLD = {"0.0.0.0/0", "::/0"}


@pytest.fixture(scope="module")
def dev():
    return render_stack("dev")


@pytest.fixture(scope="module")
def prod():
    return render_stack("prod")


def templates(result):
    return {
        lt.name.removeprefix("gpu-nodes-").removesuffix("-template"): lt
        for lt in result.of_type(LAUNCH_TEMPLATE)
    }


# --- components ------------------------------------------------------------------------


def test_components_have_aws_type_tokens_and_children_are_parented(prod):
    components = {r.type for r in prod.resources if not r.custom}
    assert components == {
        "qwen-cluster:aws:Network",
        "qwen-cluster:aws:SecurityGroups",
        "qwen-cluster:aws:GpuNodeGroup",
        "qwen-cluster:aws:ModelLoadBalancer",
        "qwen-cluster:aws:Bastion",
        "qwen-cluster:aws:NodeRole",
        "qwen-cluster:aws:ModelServerDocument",
        "qwen-cluster:aws:Monitoring",
        "qwen-cluster:aws:NodeProxy",
    }
    for resource in prod.custom_resources:
        assert resource.parent_type and resource.parent_type.startswith("qwen-cluster:aws:"), resource.name
        assert resource.name.startswith(f"{resource.parent}-"), resource.name


def test_onprem_registers_no_aws_resources():
    assert not [
        r for r in render_stack("onprem").resources if r.type.startswith(("aws:", "qwen-cluster:aws"))
    ]


# --- network ---------------------------------------------------------------------------


def test_node_subnet_is_network_cidr_in_the_configured_zone_inside_a_larger_vpc(dev):
    vpc = dev.named("network-vpc").inputs
    nodes = dev.named("network-nodes").inputs
    assert vpc["cidrBlock"] == "10.42.0.0/22"
    assert nodes["cidrBlock"] == "10.42.1.0/24"
    assert nodes["availabilityZone"] == "us-west-2a"
    assert nodes["mapPublicIpOnLaunch"] is False


def test_internal_lb_has_one_public_subnet_for_nat_only(dev):
    public = [s.name for s in dev.of_type("aws:ec2/subnet:Subnet") if "public" in s.name]
    assert public == ["network-public-a"]
    nat = dev.named("network-nat").inputs
    assert nat["subnetId"] == "network-public-a-id"
    routes = dev.named("network-nodes-rt").inputs["routes"]
    assert routes == [{"cidrBlock": "0.0.0.0/0", "natGatewayId": "network-nat-id"}]


def test_nat_gateway_waits_for_the_new_vpcs_internet_gateway(dev):
    # A public NAT gateway in a VPC without an attached internet gateway fails to create.
    assert dev.named("network-nat").depends_on == ["network-igw"]


def test_internet_facing_lb_gets_public_subnets_in_two_zones():
    result = render(variant("dev", loadBalancer={"scheme": "internet-facing"}))
    public = {s.name: s.inputs for s in result.of_type("aws:ec2/subnet:Subnet") if "public" in s.name}
    assert set(public) == {"network-public-a", "network-public-b"}
    assert public["network-public-a"]["availabilityZone"] == "us-west-2a"
    assert public["network-public-b"]["availabilityZone"] == "us-west-2b"
    nlb = result.named("model-lb-nlb").inputs
    assert nlb["internal"] is False
    assert nlb["subnets"] == ["network-public-a-id", "network-public-b-id"]
    assert nlb["enableCrossZoneLoadBalancing"] is True
    assert "aws:index/getAvailabilityZones:getAvailabilityZones" in [token for token, _ in result.invokes]


def test_second_zone_is_a_regular_availability_zone():
    result = render(variant("dev", loadBalancer={"scheme": "internet-facing"}))
    asked = [args for token, args in result.invokes if token.endswith("getAvailabilityZones")]
    # Local and Wavelength Zones (opt-in) take no NLB; only regular AZs may be chosen.
    assert asked and all(
        {"name": "opt-in-status", "values": ["opt-in-not-required"]} in args.get("filters", [])
        for args in asked
    )


def test_s3_gateway_endpoint_on_the_node_route_table(dev):
    endpoint = dev.named("network-s3").inputs
    assert endpoint["serviceName"] == "com.amazonaws.us-west-2.s3"
    assert endpoint["vpcEndpointType"] == "Gateway"
    assert endpoint["routeTableIds"] == ["network-nodes-rt-id"]


def test_default_security_group_is_left_without_rules(dev):
    default = dev.named("network-default-sg").inputs
    assert default.get("ingress", []) == [] and default.get("egress", []) == []


def test_existing_vpc_is_used_and_not_created():
    result = render(
        variant("dev", aws={"vpcId": "vpc-0123456789abcdef0"}),
    )
    types = {r.type for r in result.resources}
    assert "aws:ec2/vpc:Vpc" not in types and "aws:ec2/internetGateway:InternetGateway" not in types
    assert "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup" not in types
    assert result.named("network-nodes").inputs["vpcId"] == "vpc-0123456789abcdef0"
    assert "aws:ec2/getInternetGateway:getInternetGateway" in [token for token, _ in result.invokes]
    assert ("aws:ec2/getVpc:getVpc", {"id": "vpc-0123456789abcdef0"}) in result.invokes


def test_existing_vpc_too_small_for_the_plan_is_refused_in_preview():
    from tooling import offline

    small_vpc = {
        "aws:ec2/getVpc:getVpc": {
            "id": "vpc-0123456789abcdef0",
            "cidrBlock": "10.42.1.0/24",
            "cidrBlockAssociations": [{"cidrBlock": "10.42.1.0/24"}],
        }
    }
    result = offline.render(
        variant("dev", aws={"vpcId": "vpc-0123456789abcdef0"}), "dev", invoke_results=small_vpc
    )
    assert result.error is not None
    assert (
        "aws.vpcId vpc-0123456789abcdef0 (10.42.1.0/24) cannot hold public subnet 10.42.0.0/26"
        in result.error
    )


# --- security groups -------------------------------------------------------------------


def test_dev_security_group_rules_are_exactly_these(dev):
    assert rule_set(dev) == {
        ("nodes", "ingress", "-1", None, None, "nodes"),
        ("nodes", "egress", "-1", None, None, "nodes"),
        ("nodes", "ingress", "tcp", 5000, 5000, "load-balancer"),
        ("load-balancer", "egress", "tcp", 5000, 5000, "nodes"),
        ("nodes", "ingress", "tcp", 8000, 8000, "10.20.0.0/16"),
        ("monitoring-node", "ingress", "tcp", 9090, 9090, "10.20.0.0/16"),
        ("monitoring-node", "ingress", "tcp", 9093, 9093, "10.20.0.0/16"),
        ("nodes", "egress", "tcp", 443, 443, "0.0.0.0/0"),
        ("load-balancer", "ingress", "tcp", 80, 80, "10.0.0.0/8"),
    }


def test_only_the_monitoring_node_carries_the_prometheus_and_alertmanager_group(prod):
    # The nodes' group is on every node's interfaces: 9090/9093 there would reach every worker.
    attachments = prod.of_type(SG_ATTACHMENT)
    assert [a.name for a in attachments] == ["gpu-nodes-master-monitoring-sg"]
    (attachment,) = attachments
    assert attachment.inputs["securityGroupId"] == "security-monitoring-node-id"
    master = next(i for i in prod.of_type(INSTANCE) if i.name == "gpu-nodes-master")
    assert attachment.inputs["networkInterfaceId"] == master.outputs["primaryNetworkInterfaceId"]
    for template in templates(prod).values():
        for interface in template.inputs["networkInterfaces"]:
            assert interface["securityGroups"] == ["security-nodes-id"]


def test_prod_adds_ssh_only_through_the_bastion(prod, dev):
    assert rule_set(prod) - rule_set(dev) == {
        ("nodes", "ingress", "tcp", 22, 22, "bastion"),
        ("bastion", "egress", "tcp", 22, 22, "nodes"),
        ("bastion", "ingress", "tcp", 22, 22, "203.0.113.10/32"),
    }
    assert not [r for r in rule_set(dev) if 22 in r[3:5]]


def test_node_sg_has_no_ingress_from_the_world(dev, prod):
    for result in (dev, prod):
        for group, direction, *_, peer in rule_set(result):
            if direction == "ingress":
                assert peer not in WORLD, (group, peer)


def test_lb_sg_admits_nothing_but_the_listener_port(dev, prod):
    for result in (dev, prod):
        ingress = [r for r in rule_set(result) if r[0] == "load-balancer" and r[1] == "ingress"]
        assert ingress and all(r[2:5] == ("tcp", 80, 80) for r in ingress)


def test_self_reference_rules_both_ways_on_the_node_sg(prod):
    ingress = prod.named("security-nodes-in-cluster-all").inputs
    egress = prod.named("security-nodes-out-cluster-all").inputs
    for rule in (ingress, egress):
        assert rule["ipProtocol"] == "-1"
        assert rule["securityGroupId"] == rule["referencedSecurityGroupId"] == "security-nodes-id"
        assert "fromPort" not in rule and "toPort" not in rule


def test_every_rule_has_a_description(prod):
    assert all(rule.inputs.get("description") for rule in sg_rule_resources(prod))


def test_rule_count_does_not_grow_with_nodes():
    two = render(variant("dev", nodes=2))
    many = render(variant("dev", nodes=64))
    assert len(many.of_type(INSTANCE)) == 64
    assert len(sg_rule_resources(two)) == len(sg_rule_resources(many))
    assert rule_set(two) == rule_set(many)


def test_at_most_eight_resources_per_node_besides_interfaces():
    # The seventh: a replica head's endpoint proxy (components/aws/proxy.py); the eighth: the
    # wait for its target's drain before its instance is deleted (components/aws/loadbalancer.py).
    two, three = render(variant("dev", nodes=2)), render(variant("dev", nodes=3))
    assert len(three.resources) - len(two.resources) <= 8


# --- GPU nodes -------------------------------------------------------------------------


def test_cluster_placement_group_for_all_nodes(prod):
    group = prod.named("gpu-nodes-placement").inputs
    assert group["strategy"] == "cluster"
    for template in templates(prod).values():
        # By name: PlacementGroup.id is the group's name in the provider, never a pg-... id.
        assert template.inputs["placement"] == {"groupName": "gpu-nodes-placement-0123456"}


def test_p5_interfaces_follow_the_efa_layout(prod):
    for name, template in templates(prod).items():
        interfaces = template.inputs["networkInterfaces"]
        assert len(interfaces) == 32
        assert sorted(int(i["networkCardIndex"]) for i in interfaces) == list(range(32))
        primary = [i for i in interfaces if i["networkCardIndex"] == 0]
        assert primary[0]["interfaceType"] == "efa" and primary[0]["deviceIndex"] == 0
        others = [i for i in interfaces if i["networkCardIndex"] != 0]
        assert {i["interfaceType"] for i in others} == {"efa-only"}
        assert {int(i["deviceIndex"]) for i in others} == {0}
        assert all(i["securityGroups"] == ["security-nodes-id"] for i in interfaces), name
        assert all(i["subnetId"] == "network-nodes-id" for i in interfaces), name


def test_g6e_has_one_efa_interface(dev):
    kind = catalog.INSTANCE_TYPES["g6e.12xlarge"]
    for template in templates(dev).values():
        interfaces = template.inputs["networkInterfaces"]
        assert len(interfaces) == kind.network_cards == 1
        assert interfaces[0]["interfaceType"] == "efa"
        assert (interfaces[0]["networkCardIndex"], interfaces[0]["deviceIndex"]) == (0, 0)


def test_efa_off_gives_a_plain_interface():
    result = render(variant("dev", aws={"efa": False}))
    interface = templates(result)["master"].inputs["networkInterfaces"]
    assert len(interface) == 1 and "interfaceType" not in interface[0]


def test_no_security_groups_at_template_or_instance_level(prod):
    for template in prod.of_type(LAUNCH_TEMPLATE):
        assert "vpcSecurityGroupIds" not in template.inputs and "securityGroupNames" not in template.inputs
    for instance in prod.of_type(INSTANCE):
        if instance.name.startswith("gpu-nodes-"):
            for key in (
                "vpcSecurityGroupIds",
                "securityGroups",
                "subnetId",
                "privateIp",
                "networkInterfaces",
            ):
                assert key not in instance.inputs, (instance.name, key)


def test_each_node_primary_ip_is_its_configured_ip(prod):
    configured = {n["name"]: n["ip"] for n in stackfile.read("prod")["qwen-cluster:nodes"]}
    for name, template in templates(prod).items():
        addressed = [i for i in template.inputs["networkInterfaces"] if "privateIpAddress" in i]
        assert len(addressed) == 1
        assert (addressed[0]["networkCardIndex"], addressed[0]["deviceIndex"]) == (0, 0)
        assert addressed[0]["privateIpAddress"] == configured[name]
    instances = {
        i.name.removeprefix("gpu-nodes-"): i for i in prod.of_type(INSTANCE) if i.name != "bastion-host"
    }
    assert set(instances) == set(configured)
    for name, instance in instances.items():
        assert instance.inputs["launchTemplate"]["id"] == f"gpu-nodes-{name}-template-id"


def test_no_public_ip_on_nodes(prod, dev):
    for result in (dev, prod):
        assert result.named("network-nodes").inputs["mapPublicIpOnLaunch"] is False
        for instance in result.of_type(INSTANCE):
            if instance.name != "bastion-host":
                assert not instance.inputs.get("associatePublicIpAddress")
    # One interface: said explicitly. Several: EC2 refuses the parameter, even as false.
    assert templates(dev)["master"].inputs["networkInterfaces"][0]["associatePublicIpAddress"] == "false"
    for template in templates(prod).values():
        assert not [i for i in template.inputs["networkInterfaces"] if "associatePublicIpAddress" in i]


def test_imdsv2_required_and_root_volume_encrypted_gp3(prod, dev):
    for result in (dev, prod):
        for template in templates(result).values():
            assert template.inputs["metadataOptions"]["httpTokens"] == "required"
            (root,) = template.inputs["blockDeviceMappings"]
            assert root["ebs"]["encrypted"] == "true"
            assert root["ebs"]["volumeType"] == "gp3"
            # image + 65.6 GB of weights fit
            assert root["ebs"]["volumeSize"] >= 100 + 65.6


def test_gpu_node_role_tag_on_templates_and_instances(prod):
    tagged = [r for r in prod.resources if r.type in (LAUNCH_TEMPLATE, INSTANCE) and r.name != "bastion-host"]
    assert len(tagged) == 8
    for resource in tagged:
        assert resource.inputs["tags"]["qwen-cluster:role"] == "gpu-node"


def test_security_groups_carry_the_role_tag_the_policy_pack_reads(prod):
    roles = {
        sg.name: sg.inputs["tags"]["qwen-cluster:role"]
        for sg in prod.of_type("aws:ec2/securityGroup:SecurityGroup")
    }
    assert roles == {
        "security-nodes": "node-sg",
        "security-load-balancer": "lb-sg",
        "security-bastion": "bastion-sg",
        "security-monitoring-node": "monitoring-sg",
    }


def test_ami_is_looked_up_by_owner_and_name(dev):
    lookups = [args for token, args in dev.invokes if token == "aws:ec2/getAmi:getAmi"]
    assert len(lookups) == 1
    filters = {f["name"]: f["values"] for f in lookups[0]["filters"]}
    assert lookups[0]["owners"] == [catalog.DLAMI_OWNER] and lookups[0]["mostRecent"] is True
    assert filters == {
        "name": [catalog.DLAMI_NAME_FILTER],
        "state": ["available"],
        "architecture": ["x86_64"],
    }
    assert templates(dev)["master"].inputs["imageId"] == "ami-0123456789abcdef0"


def test_configured_ami_and_capacity_reservation_are_used():
    result = render(
        variant(
            "dev", aws={"amiId": "ami-0aaaaaaaaaaaaaaaa", "capacityReservationId": "cr-0123456789abcdef0"}
        )
    )
    template = templates(result)["master"].inputs
    assert template["imageId"] == "ami-0aaaaaaaaaaaaaaaa"
    assert not [token for token, _ in result.invokes if token == "aws:ec2/getAmi:getAmi"]
    spec = template["capacityReservationSpecification"]
    # With a target, the preference must be absent or capacity-reservations-only, never "open".
    assert spec.get("capacityReservationPreference") in (None, "capacity-reservations-only")
    target = spec["capacityReservationTarget"]
    assert target == {"capacityReservationId": "cr-0123456789abcdef0"}


def test_user_data_is_the_rendered_first_boot_script(prod):
    script = base64.b64decode(templates(prod)["worker-2"].inputs["userData"]).decode()
    assert script.startswith("#!/bin/bash\n")
    assert "NODE_IP=10.50.1.102" in script
    assert "/opt/amazon/efa/bin/fi_info -p efa" in script
    assert "PRIVATE KEY" not in script


# --- load balancer ---------------------------------------------------------------------


def test_nlb_internal_in_the_node_subnet_with_its_security_group(dev):
    nlb = dev.named("model-lb-nlb").inputs
    assert nlb["loadBalancerType"] == "network"
    assert nlb["internal"] is True
    assert nlb["subnets"] == ["network-nodes-id"]
    assert nlb["securityGroups"] == ["security-load-balancer-id"]


def test_listener_forwards_with_the_configured_idle_timeout(dev):
    listener = dev.named("model-lb-listener").inputs
    assert (listener["port"], listener["protocol"]) == (80, "TCP")
    assert listener["tcpIdleTimeoutSeconds"] == 3600
    assert listener["defaultActions"] == [
        {"type": "forward", "targetGroupArn": "arn:aws:mock:::targetgroup/model-lb-heads"}
    ]


def test_target_group_on_the_model_port_with_http_health_check(dev):
    group = dev.named("model-lb-heads").inputs
    assert (group["port"], group["protocol"], group["targetType"]) == (5000, "TCP", "instance")
    check = group["healthCheck"]
    assert (check["protocol"], check["path"], check["port"]) == ("HTTP", "/health", "traffic-port")
    assert 300 <= group["deregistrationDelay"] <= 3600


def test_targets_are_the_replica_heads():
    result = render(variant("prod", model={"pipelineParallel": 2}))
    attachments = {
        a.name: a.inputs for a in result.of_type("aws:lb/targetGroupAttachment:TargetGroupAttachment")
    }
    assert set(attachments) == {"model-lb-master", "model-lb-worker-2"}
    assert attachments["model-lb-master"]["targetId"] == "gpu-nodes-master-id"
    assert attachments["model-lb-master"]["port"] == 5000


# --- outputs ---------------------------------------------------------------------------


def test_outputs(prod):
    out = prod.outputs
    assert out["endpoint"] == "http://model-lb-nlb-0123456789.elb.amazonaws.com:80"
    assert out["loadBalancerDnsName"] == "model-lb-nlb-0123456789.elb.amazonaws.com"
    assert out["nodeIps"] == ["10.50.1.100", "10.50.1.101", "10.50.1.102", "10.50.1.103"]
    assert out["nodeIds"] == [f"gpu-nodes-{n}-id" for n in ("master", "worker-1", "worker-2", "worker-3")]
    assert out["nodes"]["master"] == {"id": "gpu-nodes-master-id", "ip": "10.50.1.100", "head": True}
    assert out["securityGroupIds"] == {
        "nodes": "security-nodes-id",
        "load-balancer": "security-load-balancer-id",
        "bastion": "security-bastion-id",
        "monitoring-node": "security-monitoring-node-id",
    }
    assert out["placementGroup"] == "gpu-nodes-placement-0123456"
    assert [entry["name"] for entry in out["portTable"]] == [
        "model-service",
        "inter-node",
        "monitoring",
        "prometheus",
        "alertmanager",
    ]
    assert out["topology"]["heads"] == ["master", "worker-1", "worker-2", "worker-3"]
    assert "bastionPublicIp" in out
    assert "summary" in out


def test_bastion_is_small_public_and_locked_down(prod):
    host = prod.named("bastion-host").inputs
    assert host["instanceType"] == "t3.micro"
    assert host["associatePublicIpAddress"] is True
    assert host["subnetId"] == "network-public-a-id"
    assert host["vpcSecurityGroupIds"] == ["security-bastion-id"]
    assert host["metadataOptions"]["httpTokens"] == "required"
    assert host["rootBlockDevice"]["encrypted"] is True


def test_efa_on_a_type_without_efa_is_a_config_error_naming_the_type():
    config = variant("dev", aws={"instanceType": "g5.xlarge"}, network={"minBandwidthGbps": 10})
    from tooling import offline

    result = offline.render(config, "dev")
    assert result.error and "g5.xlarge has no EFA support" in result.error
    assert not result.resources
