"""Bastion: a small SSH jump host in a public subnet, the nodes' only SSH path."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from qwen_cluster.tags import BASTION, ROLE_TAG

INSTANCE_TYPE = "t3.micro"
# Canonical's Ubuntu 22.04 images (https://documentation.ubuntu.com/aws/aws-how-to/instances/find-ubuntu-images/).
UBUNTU_OWNER = "099720109477"
UBUNTU_NAME_FILTER = "ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-*"


@dataclass
class BastionArgs:
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    tags: dict[str, str]


class Bastion(pulumi.ComponentResource):
    """Reached from adminCidrs on 22 only (its SG); keys are pushed per session with EC2
    Instance Connect (installed on Ubuntu AMIs), so no long-lived key pair is managed here."""

    public_ip: pulumi.Output[str]
    instance_id: pulumi.Output[str]

    def __init__(self, name: str, args: BastionArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:Bastion", name, None, opts)
        image = aws.ec2.get_ami_output(
            owners=[UBUNTU_OWNER],
            most_recent=True,
            filters=[
                {"name": "name", "values": [UBUNTU_NAME_FILTER]},
                {"name": "state", "values": ["available"]},
                {"name": "architecture", "values": ["x86_64"]},
            ],
            opts=pulumi.InvokeOutputOptions(parent=self),
        )
        instance = aws.ec2.Instance(
            f"{name}-host",
            ami=image.id,
            instance_type=INSTANCE_TYPE,
            subnet_id=args.subnet_id,
            vpc_security_group_ids=[args.security_group_id],
            associate_public_ip_address=True,
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required"},
            root_block_device={"volume_type": "gp3", "encrypted": True},
            tags={**args.tags, "Name": f"{name}-host", ROLE_TAG: BASTION},
            # ami is ForceNew (ec2_instance.go) and the lookup answers the newest Ubuntu: keep
            # the image the bastion was launched with, or every Ubuntu release replaces it.
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["ami"]),
        )
        self.public_ip = instance.public_ip
        self.instance_id = instance.id
        self.register_outputs({"publicIp": self.public_ip, "instanceId": self.instance_id})
