"""GpuNodeGroup: a cluster placement group, one EFA instance per configured node, and each
node's model server as an SSM association, rolled in rollout.maxUnavailable lanes.

Why it is shaped this way (what a day-2 change replaces, the lanes, staging, day 0), with the
provider sources that decide it: docs/day2.md, "AWS", and docs/decisions.md, "AWS".
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from qwen_cluster import catalog
from qwen_cluster.config import ClusterConfig, Node
from qwen_cluster.render import cloudinit, ec2, ssm
from qwen_cluster.tags import GPU_NODE, NODE_TAG, ROLE_TAG


@dataclass
class GpuNodeGroupArgs:
    cluster: ClusterConfig
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    tags: dict[str, str]
    instance_profile_name: pulumi.Input[str]
    document_name: pulumi.Input[str]
    stage_document_name: pulumi.Input[str]
    target_group_arn: pulumi.Input[str]
    # Registers a replica head's instance with the load balancer: (node name, instance id).
    attach: Callable[[str, pulumi.Input[str]], Any]
    # What the first association needs in place (the drain permission, the weights read).
    ready: list[pulumi.Resource] = field(default_factory=list)
    # Starts what stands in front of a replica head's vLLM (the node proxy): (node name,
    # instance id) -> what the head's model-server run waits for.
    front: Callable[[str, pulumi.Input[str]], list[pulumi.Resource]] | None = None
    # With Ray: the SecureString holding rayAuthToken and its version (ModelServerDocument).
    ray_token_parameter: pulumi.Input[str] = ""
    ray_token_version: pulumi.Input[str] = ""
    # The group only `monitoring.node` carries (Prometheus, Alertmanager); None: no such rows.
    monitoring_security_group_id: pulumi.Input[str] | None = None

    def validate(self) -> None:
        aws_target, kind = self.cluster.aws, self.cluster.instance
        if aws_target is None or kind is None:
            raise ValueError("a GPU node group needs target aws and a catalog instance type")
        if aws_target.efa and not kind.efa:
            raise ValueError(f"aws.efa is true but aws.instanceType {kind.name} has no EFA support")


def dlami_id(parent: pulumi.Resource) -> pulumi.Output[str]:
    """The newest AWS Deep Learning Base GPU AMI (Ubuntu 22.04), by owner and name. Read once:
    the launch templates ignore later answers (ignoreChanges on imageId), so a new DLAMI
    release changes nothing on a running stack; aws.amiId upgrades explicitly."""
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
    instance_arns: dict[str, pulumi.Output[str]]  # what ec2:SourceInstanceARN names in a policy
    image_ids: dict[str, pulumi.Output[str]]
    placement_group_name: pulumi.Output[str]
    rollout_order: list[str]
    stage_resources: dict[str, aws.ssm.Association]
    lanes: list[list[str]]  # replica heads, lane by lane

    def __init__(self, name: str, args: GpuNodeGroupArgs, opts: pulumi.ResourceOptions | None = None):
        args.validate()
        super().__init__("qwen-cluster:aws:GpuNodeGroup", name, None, opts)
        cluster = args.cluster
        aws_target = cluster.aws
        self._name, self._args = name, args
        # All nodes in one cluster placement group: one AZ, low-latency, full-bisection
        # network (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/placement-strategies.html).
        self._placement_group = aws.ec2.PlacementGroup(
            f"{name}-placement",
            strategy="cluster",
            tags={**args.tags, "Name": f"{name}-placement"},
            opts=pulumi.ResourceOptions(parent=self),
        )
        self._image_id = aws_target.ami_id or dlami_id(self)
        # Looked up: every template keeps the image it was created with. Given: follow it.
        self._keep_image = [] if aws_target.ami_id else ["imageId"]

        self.instance_ids, self.image_ids, self.rollout_order = {}, {}, []
        self.instance_arns = {}
        self.stage_resources = {}
        self._nodes = {node.name: node for node in cluster.nodes}
        self._interfaces = self._interface_layout()
        topology = cluster.topology
        # The lanes' first replicas' machines wait for nothing but the permissions; every other
        # machine waits for the health gate before it in its lane (a machine change rolls too).
        first_turn = [replica for replica in topology.replicas if cluster.previous_in_lane(replica) is None]
        instances: dict[str, aws.ec2.Instance] = {
            member.name: self._instance(self._node(member.name), list(args.ready))
            for replica in first_turn
            for member in replica.members
        }
        self.staged = self._stage_everywhere([instances[m.name] for r in first_turn for m in r.members])
        gates: list[aws.ssm.Association] = []  # each replica's head association, by replica index
        for replica in topology.replicas:
            before = cluster.previous_in_lane(replica)
            # The lane's previous health gate; a lane's first replica: the drain permission and
            # the staging of every node (no replica drains before every node holds the new image
            # and weights).
            server_after = [gates[before]] if before is not None else [*args.ready, self.staged]
            for member in replica.members:
                if member.name not in instances:
                    instances[member.name] = self._instance(self._node(member.name), [gates[before]])
            head_id = instances[replica.head.name].id
            args.attach(replica.head.name, head_id)
            fronts = args.front(replica.head.name, head_id) if args.front else []
            for member in replica.members:
                self.stage_resources[member.name] = self._stage(member.name, instances[member.name])
            # Pipeline workers first (their run drains the replica's head, then their Ray worker
            # joins it), the head last: its run waits for the replica's /health and gates the
            # lane's next replica.
            started: list[pulumi.Resource] = []
            for member in [*replica.workers, replica.head]:
                is_head = member.name == replica.head.name
                started.append(
                    aws.ssm.Association(
                        f"{name}-{member.name}-server",
                        name=args.document_name,
                        targets=[{"key": "InstanceIds", "values": [instances[member.name].id]}],
                        parameters=ssm.parameters(
                            cluster,
                            member.name,
                            target_group_arn=args.target_group_arn,
                            target_id=head_id,
                            ray_token_parameter=args.ray_token_parameter,
                            ray_token_version=args.ray_token_version,
                        ),
                        max_concurrency="1",
                        max_errors="0",
                        wait_for_success_timeout_seconds=ssm.wait_seconds(cluster) if is_head else None,
                        opts=pulumi.ResourceOptions(
                            parent=self,
                            # Waited for on create only (association.go): every change replaces.
                            replace_on_changes=["parameters", "targets"],
                            depends_on=[
                                *server_after,
                                *started,
                                self.stage_resources[member.name],
                                *(fronts if is_head else []),
                            ],
                        ),
                    )
                )
                self.rollout_order.append(member.name)
            gates.append(started[-1])
        self.lanes = [[replica.head.name for replica in lane] for lane in cluster.rollout_lanes]

        self.placement_group_name = self._placement_group.name
        self.register_outputs(
            {
                "instanceIds": self.instance_ids,
                "imageIds": self.image_ids,
                "placementGroup": self.placement_group_name,
            }
        )

    def _stage_everywhere(self, first_turn: list[aws.ec2.Instance]) -> aws.ssm.Association:
        """The staging document on every GPU node of the stack at once, targeted by tag, so that
        it names no instance: each lane's first server association waits for it, and a later
        replica's instance waits for that lane's gates, so a dependency on every instance
        would be a cycle. It waits for the lanes' first machines only, so that on a new stack
        it has targets when it is created (the provider waits from Pending to Success,
        internal/service/ssm/wait.go waitAssociationSuccess: with no target it would time out); machines
        launched later match the tags and stage through their own `<node>-stage` first. On a
        change of image or weights its parameters change, so it is replaced, and its create
        runs on every node in parallel (max_concurrency 100 %) before any lane drains."""
        tags = {**self._args.tags, ROLE_TAG: GPU_NODE}
        targets = [{"key": f"tag:{key}", "values": [value]} for key, value in sorted(tags.items())]
        return self._staging(f"{self._name}-stage", targets, "100%", first_turn)

    def _stage(self, node_name: str, instance: aws.ec2.Instance) -> aws.ssm.Association:
        """One node's staging association: image and weights onto the node, waited for."""
        targets = [{"key": "InstanceIds", "values": [instance.id]}]
        return self._staging(f"{self._name}-{node_name}-stage", targets, "1", [])

    def _staging(
        self, name: str, targets: list[dict[str, Any]], concurrency: str, after: list[pulumi.Resource]
    ) -> aws.ssm.Association:
        args = self._args
        return aws.ssm.Association(
            name,
            name=args.stage_document_name,
            targets=targets,
            parameters=ssm.stage_parameters(args.cluster),
            max_concurrency=concurrency,
            max_errors="0",
            wait_for_success_timeout_seconds=ssm.STAGE_TIMEOUT_SECONDS,
            opts=pulumi.ResourceOptions(
                parent=self,
                # Waited for on create only (association.go): every change replaces.
                replace_on_changes=["parameters", "targets"],
                depends_on=[*args.ready, *after],
            ),
        )

    def _node(self, node_name: str) -> Node:
        return self._nodes[node_name]

    def _interface_layout(self) -> list[tuple[ec2.InterfaceSpec, dict[str, Any]]]:
        """The template interfaces every node shares, built once per instance kind; a node adds
        its static IP and its name (`_interfaces_of`). Keys whose value would be None are left
        out: the SDK sends None as absent, so what is registered is the same, with fewer values
        to serialise per node (`make bench`: render speed at scale)."""
        args, cluster = self._args, self._args.cluster
        # Any address marks the primary interface (the only spec with a private_ip).
        specs = ec2.network_interfaces(cluster.instance, cluster.aws.efa, "0.0.0.0")
        layout = []
        for spec in specs:
            interface: dict[str, Any] = {
                "network_card_index": spec.network_card_index,
                "device_index": spec.device_index,
                "subnet_id": args.subnet_id,
                # Every interface carries the node SG; none at template level (AWS refuses both).
                "security_groups": [args.security_group_id],
                "delete_on_termination": "true",
            }
            if spec.interface_type != "interface":
                interface["interface_type"] = spec.interface_type
            # No public IP: the node subnet does not map one, and a single interface says so
            # too. With several interfaces EC2 refuses the parameter even as false
            # (InvalidParameterCombination: "The associatePublicIPAddress parameter cannot be
            # specified when launching with multiple network interfaces").
            if len(specs) == 1:
                interface["associate_public_ip_address"] = "false"
            layout.append((spec, interface))
        return layout

    def _interfaces_of(self, node: Node) -> list[dict[str, Any]]:
        """The shared layout with this node's static IP on its primary interface
        (`ec2.network_interfaces`) and its name in each description."""
        interfaces = []
        for spec, shared in self._interfaces:
            interface = dict(shared)
            if spec.private_ip is not None:
                interface["private_ip_address"] = str(node.ip)
            interface["description"] = f"{node.name} card {spec.network_card_index} {spec.interface_type}"
            interfaces.append(interface)
        return interfaces

    def _instance(self, node: Node, gate: list[pulumi.Resource]) -> aws.ec2.Instance:
        """One node's launch template (the machine only) and its instance."""
        name, args, cluster = self._name, self._args, self._args.cluster
        aws_target, kind = cluster.aws, cluster.instance
        node_tags = {**args.tags, ROLE_TAG: GPU_NODE, NODE_TAG: node.name, "Name": f"{name}-{node.name}"}
        interfaces = self._interfaces_of(node)
        # A target alone: with a target, EC2 refuses the preference "open" (it takes only
        # "capacity-reservations-only" or none; pulumi-aws LaunchTemplate docs).
        capacity = (
            {"capacity_reservation_target": {"capacity_reservation_id": aws_target.capacity_reservation_id}}
            if aws_target.capacity_reservation_id
            else None
        )
        template = aws.ec2.LaunchTemplate(
            f"{name}-{node.name}-template",
            description=f"qwen-cluster GPU node {node.name} ({node.ip})",
            image_id=self._image_id,
            instance_type=kind.name,
            network_interfaces=interfaces,
            # By name: the provider's PlacementGroup.id IS the group's name (it imports by name);
            # the pg-... id is placement_group_id. A name in GroupId is refused.
            placement={"group_name": self._placement_group.name},
            iam_instance_profile={"name": args.instance_profile_name},
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
                        # Sized for the largest model of the catalog, not model.name: a model
                        # change must not change the machine (a new template version).
                        "volume_size": ec2.root_volume_gb(max(m.weights_gb for m in catalog.MODELS.values())),
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
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=self._keep_image),
        )
        instance = aws.ec2.Instance(
            f"{name}-{node.name}",
            # The version explicitly, never "$Latest": a new version of this (machine-only)
            # template is a machine change and replaces the node (ec2_instance.go CustomizeDiff),
            # delete-before-replace because the static IP must be free first.
            launch_template={"id": template.id, "version": template.latest_version.apply(str)},
            tags=node_tags,
            opts=pulumi.ResourceOptions(parent=self, delete_before_replace=True, depends_on=gate),
        )
        self.instance_ids[node.name] = instance.id
        self.instance_arns[node.name] = instance.arn
        self.image_ids[node.name] = template.image_id
        monitoring = cluster.monitoring_node
        if args.monitoring_security_group_id is not None and monitoring and monitoring.name == node.name:
            # Attached to the running node's primary interface, not written into its launch
            # template: a template change is a new version and replaces the machine, while the
            # attachment is ModifyNetworkInterfaceAttribute on the live interface, adding the group
            # to the ones it has (terraform-provider-aws
            # internal/service/ec2/vpc_network_interface_sg_attachment.go). The instance sets no
            # security groups of its own, as the provider's note on this resource asks.
            aws.ec2.NetworkInterfaceSecurityGroupAttachment(
                f"{name}-{node.name}-monitoring-sg",
                network_interface_id=instance.primary_network_interface_id,
                security_group_id=args.monitoring_security_group_id,
                opts=pulumi.ResourceOptions(parent=self),
            )
        return instance
