"""The replacement rules: for every resource type the program registers, which input keys
replace the resource and which update it in place, each rule citing the provider source that
decides it. tooling/changes/compare.py reads them; nothing else decides update or replace."""

from __future__ import annotations

from dataclasses import dataclass

ALL = "*"  # every input key replaces (the resource has no Update)


@dataclass(frozen=True)
class Rule:
    """How a provider carries out a change to one resource type.

    `replaces`: input keys (camelCase, top level of the inputs) whose change replaces the
    resource; ALL when the provider has no Update. `updates`: with `replaces` ALL, the keys that
    still update in place (docker_container updates a few). Anything else updates in place.
    `delete_before_replace`: the provider itself asks for delete-before-replace.
    `new_version_on_update`: an update makes a new version that inputs following it see."""

    type: str
    replaces: frozenset[str] | str
    source: str
    updates: frozenset[str] = frozenset()
    delete_before_replace: bool = False
    new_version_on_update: bool = False
    note: str = ""

    def replaces_key(self, key: str) -> bool:
        if self.replaces == ALL:
            return key not in self.updates
        return key in self.replaces


_TF_AWS = "hashicorp/terraform-provider-aws"
_RULES: tuple[Rule, ...] = (
    # --- network ---------------------------------------------------------------------------
    Rule(
        "aws:ec2/vpc:Vpc",
        frozenset({"cidrBlock", "ipv4IpamPoolId", "ipv4NetmaskLength", "instanceTenancy"}),
        f"{_TF_AWS} internal/service/ec2/vpc_.go (cidr_block ForceNew); DNS attributes update",
    ),
    Rule(
        "aws:ec2/subnet:Subnet",
        frozenset({"availabilityZone", "availabilityZoneId", "cidrBlock", "vpcId", "outpostArn"}),
        f"{_TF_AWS} internal/service/ec2/vpc_subnet.go (ForceNew); map_public_ip_on_launch updates",
    ),
    Rule(
        "aws:ec2/internetGateway:InternetGateway",
        frozenset(),
        f"{_TF_AWS} internal/service/ec2/vpc_internet_gateway.go: vpc_id updates (detach, attach)",
    ),
    Rule(
        "aws:ec2/eip:Eip",
        frozenset({"domain", "vpc", "networkBorderGroup", "publicIpv4Pool", "address"}),
        f"{_TF_AWS} internal/service/ec2/ec2_eip.go (domain ForceNew)",
    ),
    Rule(
        "aws:ec2/natGateway:NatGateway",
        frozenset({"allocationId", "connectivityType", "subnetId", "privateIp"}),
        f"{_TF_AWS} internal/service/ec2/vpc_nat_gateway.go (ForceNew)",
    ),
    Rule(
        "aws:ec2/routeTable:RouteTable",
        frozenset({"vpcId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_route_table.go: vpc_id ForceNew, routes update",
    ),
    Rule(
        "aws:ec2/routeTableAssociation:RouteTableAssociation",
        frozenset({"subnetId", "gatewayId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_route_table_association.go: route_table_id updates "
        "(ReplaceRouteTableAssociation)",
    ),
    Rule(
        "aws:ec2/vpcEndpoint:VpcEndpoint",
        frozenset({"serviceName", "vpcEndpointType", "vpcId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_endpoint.go: route_table_ids update",
    ),
    Rule(
        "aws:ec2/securityGroup:SecurityGroup",
        frozenset({"name", "namePrefix", "description", "vpcId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_security_group.go (ForceNew)",
    ),
    Rule(
        "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup",
        frozenset({"vpcId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_default_security_group.go",
    ),
    Rule(
        "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
        frozenset({"securityGroupId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_security_group_ingress_rule.go: only security_group_id "
        "RequiresReplace; CIDR, ports, protocol update (ModifySecurityGroupRules)",
    ),
    Rule(
        "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
        frozenset({"securityGroupId"}),
        f"{_TF_AWS} internal/service/ec2/vpc_security_group_egress_rule.go (as the ingress rule)",
    ),
    Rule(
        "aws:ec2/networkInterfaceSecurityGroupAttachment:NetworkInterfaceSecurityGroupAttachment",
        ALL,
        f"{_TF_AWS} internal/service/ec2/vpc_network_interface_sg_attachment.go: both inputs "
        "ForceNew, no Update; create and delete rewrite the interface's groups in place "
        "(ModifyNetworkInterfaceAttribute), the instance stays",
    ),
    # --- GPU nodes ---------------------------------------------------------------------------
    Rule(
        "aws:ec2/placementGroup:PlacementGroup",
        frozenset({"name", "namePrefix", "strategy", "partitionCount", "spreadLevel"}),
        f"{_TF_AWS} internal/service/ec2/ec2_placement_group.go (ForceNew); tags update",
    ),
    Rule(
        "aws:ec2/launchTemplate:LaunchTemplate",
        frozenset({"name", "namePrefix"}),
        f"{_TF_AWS} internal/service/ec2/ec2_launch_template.go: no ForceNew on the template data; "
        "Update calls CreateLaunchTemplateVersion, so latest_version moves",
        new_version_on_update=True,
    ),
    Rule(
        "aws:ec2/instance:Instance",
        frozenset(
            {
                "ami",
                "associatePublicIpAddress",
                "availabilityZone",
                "launchTemplate",
                "subnetId",
                "privateIp",
                "placementGroup",
                "keyName",
                "securityGroups",
                "tenancy",
                "ipv6Addresses",
                "ipv6AddressCount",
                "ebsBlockDevices",
                "ephemeralBlockDevices",
                "networkInterfaces",
                "hostId",
                "cpuCoreCount",
                "cpuThreadsPerCore",
                "hibernation",
                "ebsOptimized",
            }
        ),
        f"{_TF_AWS} internal/service/ec2/ec2_instance.go: launch_template id/name ForceNew, and "
        "its CustomizeDiff forces new when launch_template.0.version differs from the instance's; "
        "ami, subnet_id, private_ip, placement_group ForceNew; instance_type, user_data, "
        "vpc_security_group_ids, metadata_options, iam_instance_profile update (instance_type "
        "and user_data stop and start the instance)",
    ),
    # --- load balancer --------------------------------------------------------------------------
    Rule(
        "aws:lb/loadBalancer:LoadBalancer",
        frozenset(
            {
                "name",
                "namePrefix",
                "internal",
                "loadBalancerType",
                "subnets",
                "securityGroups",
                "subnetMappings",
            }
        ),
        f"{_TF_AWS} internal/service/elbv2/load_balancer.go: name, internal, load_balancer_type "
        "ForceNew; for a network LB its CustomizeDiff forces new when subnets are removed or "
        "security groups added to or removed from an LB created with(out) them",
    ),
    Rule(
        "aws:lb/listener:Listener",
        frozenset({"loadBalancerArn"}),
        f"{_TF_AWS} internal/service/elbv2/listener.go: port, protocol, default_action, "
        "tcp_idle_timeout_seconds update (ModifyListener)",
    ),
    Rule(
        "aws:lb/targetGroup:TargetGroup",
        frozenset({"name", "namePrefix", "port", "protocol", "protocolVersion", "targetType", "vpcId"}),
        f"{_TF_AWS} internal/service/elbv2/target_group.go: port, protocol, target_type, vpc_id "
        "ForceNew; health_check, deregistration_delay, preserve_client_ip update",
    ),
    Rule(
        "aws:lb/targetGroupAttachment:TargetGroupAttachment",
        ALL,
        f"{_TF_AWS} internal/service/elbv2/target_group_attachment.go: every field ForceNew, no Update",
    ),
    # --- SSM model-server lifecycle and the instance role ---------------------------------------
    Rule(
        "aws:iam/role:Role",
        frozenset({"name", "namePrefix", "path", "permissionsBoundary"}),
        f"{_TF_AWS} internal/service/iam/role.go: assume_role_policy, managed policies update",
    ),
    Rule(
        "aws:iam/instanceProfile:InstanceProfile",
        frozenset({"name", "namePrefix", "path"}),
        f"{_TF_AWS} internal/service/iam/instance_profile.go: role updates",
    ),
    Rule(
        "aws:iam/rolePolicyAttachment:RolePolicyAttachment",
        ALL,
        f"{_TF_AWS} internal/service/iam/role_policy_attachment.go: role, policy_arn ForceNew, no Update",
    ),
    Rule(
        "aws:iam/rolePolicy:RolePolicy",
        frozenset({"name", "namePrefix", "role"}),
        f"{_TF_AWS} internal/service/iam/role_policy.go: policy updates",
    ),
    Rule(
        "aws:ssm/document:Document",
        frozenset({"name", "documentType"}),
        f"{_TF_AWS} internal/service/ssm/document.go: content updates (UpdateDocument, a new "
        "document version); associations do not re-run on it by themselves",
    ),
    Rule(
        "aws:ssm/parameter:Parameter",
        frozenset({"name", "dataType"}),
        f"{_TF_AWS} internal/service/ssm/parameter.go: name, data_type ForceNew (and tier Advanced -> "
        "Standard); value, type, description update in place (PutParameter with Overwrite), and a "
        "new value raises the computed version, which inputs following it see",
        new_version_on_update=True,
    ),
    Rule(
        "aws:ssm/association:Association",
        frozenset({"name", "instanceId"}),
        f"{_TF_AWS} internal/service/ssm/association.go: name, instance_id ForceNew; parameters "
        "and targets update (UpdateAssociation). wait_for_success_timeout_seconds is read in "
        "resourceAssociationCreate only: an update returns without waiting for its runs (so the "
        "program's model-server and staging associations replace on parameters and targets)",
    ),
    Rule(
        "command:local:Command",
        frozenset({"triggers"}),
        "pulumi/pulumi-command provider/pkg/provider/common/inputs.go: only `triggers` carries "
        'provider:"replaceOnChanges"; local/commandController.go Update re-runs `update`, or '
        "`create` when there is none, for any other change; Delete runs `delete` (the AWS "
        "stacks' `<lb>-<node>-drained`: its create is empty, its delete waits out a drain)",
    ),
    # --- bare metal -------------------------------------------------------------------------
    Rule(
        "command:remote:Command",
        frozenset({"triggers"}),
        "pulumi/pulumi-command provider/pkg/provider/common/inputs.go: only `triggers` carries "
        'provider:"replaceOnChanges"; remote/commandController.go Update re-runs `update`, or '
        "`create` when there is none, for any other change (create, delete, connection, "
        "environment, stdin)",
    ),
    Rule(
        "docker:index/container:Container",
        ALL,
        "kreuzwerker/terraform-provider-docker internal/provider/resource_docker_container.go: "
        "every configured field ForceNew (name, image, command, entrypoint, env, labels, upload, "
        "volumes, devices, gpus, network_mode, ipc_mode, ulimit, capabilities...) except those "
        "resourceDockerContainerUpdate changes (resource_docker_container_funcs.go: restart, "
        "max_retry_count, cpu_shares, memory*, cpu_set, device_*_bps/iops, must_run); stop_timeout "
        "ForceNew; destroy_grace_seconds has no ForceNew and no update (only stored; "
        "resourceDockerContainerDelete reads it as the stop timeout); "
        "pulumi/pulumi-docker provider/resources.go sets DeleteBeforeReplace: true",
        updates=frozenset(
            {
                "restart",
                "maxRetryCount",
                "cpuShares",
                "memory",
                "memoryReservation",
                "memorySwap",
                "cpuSet",
                "mustRun",
                "deviceReadBps",
                "deviceReadIops",
                "deviceWriteBps",
                "deviceWriteIops",
                "destroyGraceSeconds",
            }
        ),
        delete_before_replace=True,
    ),
    Rule(
        "docker:index/remoteImage:RemoteImage",
        frozenset({"name", "platform", "pullTriggers", "triggers", "build"}),
        "kreuzwerker/terraform-provider-docker internal/provider/resource_docker_image.go: name, "
        "platform, pull_triggers, triggers ForceNew; keep_locally updates",
    ),
)
RULES: dict[str, Rule] = {rule.type: rule for rule in _RULES}
# Explicit providers: the bridge's DiffConfig replaces a provider only for fields marked
# ForcesProviderReplace (pulumi/pulumi-terraform-bridge pkg/tfbridge/provider.go, configDiffer);
# pulumi-docker marks none (provider/resources.go). A provider update replaces nothing under it.
PROVIDER_RULE_SOURCE = (
    "pulumi/pulumi-terraform-bridge pkg/tfbridge/provider.go configDiffer.forcesProviderReplace; "
    "pulumi/pulumi-docker provider/resources.go sets no ForcesProviderReplace"
)


class UnknownResourceType(KeyError):
    pass


def rule_for(type_: str) -> Rule | None:
    """The rule for a type; explicit providers (`pulumi:providers:*`) update in place."""
    if type_.startswith("pulumi:providers:"):
        return Rule(type_, frozenset(), PROVIDER_RULE_SOURCE)
    return RULES.get(type_)
