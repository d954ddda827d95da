"""GpuNodeGroup: a cluster placement group and one EFA instance per configured node."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import catalog
from components.config import ClusterConfig
from components.render import cloudinit, ec2
from components.tags import GPU_NODE, NODE_TAG, ROLE_TAG


@dataclass
class GpuNodeGroupArgs:
    cluster: ClusterConfig
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    tags: dict[str, str]

    def validate(self) -> None:
        aws_target, kind = self.cluster.aws, self.cluster.instance
        if aws_target is None or kind is None:
            raise ValueError("a GPU node group needs target aws and a catalog instance type")
        if aws_target.efa and not kind.efa:
            raise ValueError(f"aws.efa is true but aws.instanceType {kind.name} has no EFA support")


def dlami_id(parent: pulumi.Resource) -> pulumi.Output[str]:
    """The newest AWS Deep Learning Base GPU AMI (Ubuntu 22.04), by owner and name."""
    return aws.ec2.get_ami_output(
        owners=[catalog.DLAMI_OWNER],
        most_recent=True,
        filters=[
            {"name": "name", "values": [catalog.DLAMI_NAME_FILTER]},
            {"name": "state", "values": ["available"]},
            {"name": "architecture", "values": ["x86_64"]},
        ],
        opts=pulumi.InvokeOutputOptions(parent=parent),
    ).id


class GpuNodeGroup(pulumi.ComponentResource):
    """Static addressing with one launch template per node.

    A launch template that lists network interfaces must carry the subnet and the security
    groups on each interface, and then the RunInstances request may carry neither a subnet,
    nor security groups, nor an instance-level private IP (InvalidParameterCombination;
    "If you specify a network interface, you must specify any security groups and subnets as
    part of the network interface", AWS::EC2::LaunchTemplate LaunchTemplateData). The only
    documented place left for the node's static IP is the template's primary interface
    (LaunchTemplateInstanceNetworkInterfaceSpecificationRequest.PrivateIpAddress), so each
    node gets its own template version of the same rendered layout.
    """

    instance_ids: dict[str, pulumi.Output[str]]
    placement_group_name: pulumi.Output[str]

    def __init__(self, name: str, args: GpuNodeGroupArgs, opts: pulumi.ResourceOptions | None = None):
        args.validate()
        super().__init__("qwen-cluster:aws:GpuNodeGroup", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cluster = args.cluster
        aws_target, kind = cluster.aws, cluster.instance
        role_tags = {**args.tags, ROLE_TAG: GPU_NODE}  # the policy pack finds GPU nodes by it

        # All nodes in one cluster placement group: one AZ, low-latency, full-bisection
        # network (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/placement-strategies.html).
        placement_group = aws.ec2.PlacementGroup(
            f"{name}-placement",
            strategy="cluster",
            tags={**args.tags, "Name": f"{name}-placement"},
            opts=child,
        )
        image_id = aws_target.ami_id or dlami_id(self)
        root_gb = ec2.root_volume_gb(catalog.MODELS[cluster.model.name].weights_gb)
        # A target alone: with a target, EC2 refuses the preference "open" (it takes only
        # "capacity-reservations-only" or none; pulumi-aws LaunchTemplate docs).
        capacity = (
            {
                "capacity_reservation_target": {
                    "capacity_reservation_id": aws_target.capacity_reservation_id
                },
            }
            if aws_target.capacity_reservation_id
            else None
        )

        self.instance_ids = {}
        for node in cluster.nodes:
            node_tags = {**role_tags, NODE_TAG: node.name, "Name": f"{name}-{node.name}"}
            specs = ec2.network_interfaces(kind, aws_target.efa, str(node.ip))
            interfaces = [
                {
                    "network_card_index": spec.network_card_index,
                    "device_index": spec.device_index,
                    "interface_type": None if spec.interface_type == "interface" else spec.interface_type,
                    "subnet_id": args.subnet_id,
                    # Every interface carries the node SG; none at template level (AWS refuses both).
                    "security_groups": [args.security_group_id],
                    "private_ip_address": spec.private_ip,
                    # No public IP: the node subnet does not map one, and a single interface
                    # says so too. With several interfaces EC2 refuses the parameter even as
                    # false (InvalidParameterCombination: "The associatePublicIPAddress
                    # parameter cannot be specified when launching with multiple network
                    # interfaces"), so it is left out there.
                    "associate_public_ip_address": "false" if len(specs) == 1 else None,
                    "delete_on_termination": "true",
                    "description": f"{node.name} card {spec.network_card_index} {spec.interface_type}",
                }
                for spec in specs
            ]
            template = aws.ec2.LaunchTemplate(
                f"{name}-{node.name}-template",
                description=f"qwen-cluster GPU node {node.name} ({node.ip})",
                image_id=image_id,
                instance_type=kind.name,
                network_interfaces=interfaces,
                # By name: the provider's PlacementGroup.id IS the group's name (it imports by
                # name); the pg-... id is placement_group_id. A name in GroupId is refused.
                placement={"group_name": placement_group.name},
                metadata_options={
                    "http_endpoint": "enabled",
                    "http_tokens": "required",  # IMDSv2 only
                    # 2 hops: containers on the host reach IMDS through one more hop.
                    "http_put_response_hop_limit": 2,
                },
                block_device_mappings=[
                    {
                        "device_name": ec2.ROOT_DEVICE_NAME,
                        "ebs": {
                            "volume_type": "gp3",
                            "volume_size": root_gb,
                            "encrypted": "true",
                            "delete_on_termination": "true",
                        },
                    }
                ],
                capacity_reservation_specification=capacity,
                user_data=base64.b64encode(cloudinit.user_data(cluster, node.name).encode()).decode(),
                tag_specifications=[
                    {"resource_type": kind_, "tags": node_tags}
                    for kind_ in ("instance", "volume", "network-interface")
                ],
                tags=node_tags,
                opts=child,
            )
            instance = aws.ec2.Instance(
                f"{name}-{node.name}",
                # A new template version (user data, image) replaces the node: nodes are cattle.
                launch_template={"id": template.id, "version": template.latest_version.apply(str)},
                tags=node_tags,
                opts=child,
            )
            self.instance_ids[node.name] = instance.id

        self.placement_group_name = placement_group.name
        self.register_outputs({"instanceIds": self.instance_ids, "placementGroup": self.placement_group_name})
