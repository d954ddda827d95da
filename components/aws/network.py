"""Network: the VPC (new or existing), the private node subnet, public subnets, NAT, S3 endpoint."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from qwen_cluster.render.vpc_plan import VpcPlan

ANYWHERE_IPV4 = "0.0.0.0/0"


@dataclass
class NetworkArgs:
    plan: VpcPlan
    availability_zone: str  # the nodes' AZ (a cluster placement group lives in one AZ)
    region: str
    tags: dict[str, str]
    vpc_id: str | None = None  # an existing VPC; default: a new one with plan.vpc_cidr

    def validate(self) -> None:
        if not self.availability_zone.startswith(self.region):
            raise ValueError(f"availability zone {self.availability_zone} is not in region {self.region}")


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    node_subnet_id: pulumi.Output[str]
    public_subnet_ids: list[pulumi.Output[str]]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        args.validate()
        super().__init__("qwen-cluster:aws:Network", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        plan = args.plan

        def tags(role: str) -> dict[str, str]:
            return {**args.tags, "Name": f"{name}-{role}"}

        if args.vpc_id is None:
            vpc = aws.ec2.Vpc(
                f"{name}-vpc",
                cidr_block=str(plan.vpc_cidr),
                enable_dns_support=True,
                enable_dns_hostnames=True,
                tags=tags("vpc"),
                opts=child,
            )
            vpc_id = vpc.id
            # Security Hub EC2.2: the default security group allows nothing. Adopting it with
            # empty rule lists makes the provider revoke AWS's default rules.
            aws.ec2.DefaultSecurityGroup(
                f"{name}-default-sg",
                vpc_id=vpc_id,
                ingress=[],
                egress=[],
                tags=tags("default-sg"),
                opts=child,
            )
            internet_gateway = aws.ec2.InternetGateway(
                f"{name}-igw", vpc_id=vpc_id, tags=tags("igw"), opts=child
            )
            internet_gateway_id = internet_gateway.id
            gateway_ready: list[pulumi.Resource] = [internet_gateway]
        else:
            # An existing VPC keeps its default SG (other workloads may use it) and its one
            # internet gateway (a VPC takes only one); plan.vpc_cidr must lie inside it.
            vpc_id = pulumi.Output.from_input(args.vpc_id)  # checked by components.aws.build
            internet_gateway_id = aws.ec2.get_internet_gateway_output(
                filters=[{"name": "attachment.vpc-id", "values": [args.vpc_id]}],
                opts=pulumi.InvokeOutputOptions(parent=self),
            ).internet_gateway_id
            gateway_ready = []

        # Public subnets: [0] in the nodes' AZ for the NAT gateway and the bastion; [1] in a
        # second AZ only for an internet-facing NLB. Nothing gets a public IP by default.
        second_zone = None
        if len(plan.public_subnets) > 1:
            # Regular AZs only: an opted-in Local or Wavelength Zone (us-west-2-lax-1a sorts
            # before us-west-2b) takes no NLB.
            zones = aws.get_availability_zones_output(
                state="available",
                filters=[{"name": "opt-in-status", "values": ["opt-in-not-required"]}],
                opts=pulumi.InvokeOutputOptions(parent=self),
            )
            second_zone = zones.names.apply(
                lambda names: next(z for z in names if z != args.availability_zone)
            )
        public_route_table = aws.ec2.RouteTable(
            f"{name}-public-rt",
            vpc_id=vpc_id,
            routes=[{"cidr_block": ANYWHERE_IPV4, "gateway_id": internet_gateway_id}],
            tags=tags("public-rt"),
            opts=child,
        )
        public_subnets = []
        for index, cidr in enumerate(plan.public_subnets):
            letter = "ab"[index]
            subnet = aws.ec2.Subnet(
                f"{name}-public-{letter}",
                vpc_id=vpc_id,
                cidr_block=str(cidr),
                availability_zone=args.availability_zone if index == 0 else second_zone,
                map_public_ip_on_launch=False,
                tags=tags(f"public-{letter}"),
                opts=child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-public-{letter}-rta",
                subnet_id=subnet.id,
                route_table_id=public_route_table.id,
                opts=child,
            )
            public_subnets.append(subnet)

        # Node egress (images, weights) through one NAT gateway in the nodes' AZ. A public NAT
        # gateway created before the VPC's internet gateway is attached fails ("Network vpc-...
        # has no Internet gateway attached"); nothing else orders the two, so say it.
        nat_ip = aws.ec2.Eip(f"{name}-nat-ip", domain="vpc", tags=tags("nat-ip"), opts=child)
        nat = aws.ec2.NatGateway(
            f"{name}-nat",
            allocation_id=nat_ip.id,
            subnet_id=public_subnets[0].id,
            connectivity_type="public",
            tags=tags("nat"),
            opts=pulumi.ResourceOptions(parent=self, depends_on=gateway_ready),
        )
        node_subnet = aws.ec2.Subnet(
            f"{name}-nodes",
            vpc_id=vpc_id,
            cidr_block=str(plan.node_subnet),
            availability_zone=args.availability_zone,
            map_public_ip_on_launch=False,
            tags=tags("nodes"),
            opts=child,
        )
        node_route_table = aws.ec2.RouteTable(
            f"{name}-nodes-rt",
            vpc_id=vpc_id,
            routes=[{"cidr_block": ANYWHERE_IPV4, "nat_gateway_id": nat.id}],
            tags=tags("nodes-rt"),
            opts=child,
        )
        aws.ec2.RouteTableAssociation(
            f"{name}-nodes-rta", subnet_id=node_subnet.id, route_table_id=node_route_table.id, opts=child
        )
        # Weights and images from S3 stay on the AWS network and skip the NAT's data charge.
        aws.ec2.VpcEndpoint(
            f"{name}-s3",
            vpc_id=vpc_id,
            service_name=f"com.amazonaws.{args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=[node_route_table.id],
            tags=tags("s3"),
            opts=child,
        )

        self.vpc_id = vpc_id
        self.node_subnet_id = node_subnet.id
        self.public_subnet_ids = [subnet.id for subnet in public_subnets]
        self.register_outputs(
            {
                "vpcId": self.vpc_id,
                "nodeSubnetId": self.node_subnet_id,
                "publicSubnetIds": self.public_subnet_ids,
            }
        )
