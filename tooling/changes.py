"""What a `pulumi up` would do to a running stack, decided offline from two renders.

One table (`RULES`) says, for every resource type the program registers, which input keys
replace the resource and which update it in place, each rule citing the provider source that
decides it. `diff(old, new)` compares two offline renders (tooling/offline.py) with it and
the resource options the program set (deleteBeforeReplace, ignoreChanges, replaceOnChanges);
`rollout(old, new, changes)` says what that does to serving: nodes replaced, model servers
restarted, the most replicas out of service at once given the engine's dependency order, and
whether the endpoint stays up. `apply_changes` applies `--change KEY=VALUE` to a stack file's
config. scripts/plan.py prints it; the lab executor (labkit) replays it.

How replacement ripples: when a resource is replaced its id, ARN and DNS name change, so every
input holding them changes too (in a real preview they are unknown); a launch template update
makes a new version, so an input that follows its version changes. `diff` propagates both until
nothing moves.

Serving impact (used by `rollout`), decided per resource:
- machine: an EC2 instance of a GPU node (tag qwen-cluster:role=gpu-node) replaced or deleted;
- server: a model server restarted: an SSM association of the model-server document created
  anew or updated on an existing node, a model-server container (label qwen-cluster.role head /
  pipeline-worker) replaced, or a command named in SERVER_COMMAND_SUFFIXES re-run;
- endpoint: the NLB, its listener or target group, or the load-balancer container (label
  qwen-cluster.role=load-balancer) replaced or deleted: every client connection drops;
- a health gate waits until its replica serves again before anything that depends on it starts:
  an SSM association with waitForSuccessTimeoutSeconds (its create waits; an update does not,
  see RULES), a container with `wait: true`, or a command named in HEALTH_GATE_SUFFIXES.
Targets that restructure serving (bare metal, issue 11) extend the two suffix tuples.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tooling import stackfile
from tooling.offline import RecordedResource, Render, references, strings

Action = Literal["create", "update", "replace", "delete", "same"]
Strategy = Literal["create-before-delete", "delete-before-replace"]

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
        "aws:ssm/association:Association",
        frozenset({"name", "instanceId"}),
        f"{_TF_AWS} internal/service/ssm/association.go: name, instance_id ForceNew; parameters "
        "and targets update (UpdateAssociation). wait_for_success_timeout_seconds is read in "
        "resourceAssociationCreate only: an update returns without waiting for its runs",
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
        "max_retry_count, cpu_shares, memory*, cpu_set, device_*_bps/iops, must_run); "
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

# Names of bare-metal commands that restart a model server / wait for it (issue 11 extends).
SERVER_COMMAND_SUFFIXES: tuple[str, ...] = ()
# qwen_cluster/baremetal/rollout.py: `<head>-ready` waits for the replica's /health (create only
# for a server marked down, update always) before the next replica's drain starts.
HEALTH_GATE_SUFFIXES: tuple[str, ...] = ("-ready",)
# Rollout steps run on the load balancer's host but belong to the replica named by their head.
ROLLOUT_STEP_SUFFIXES: tuple[str, ...] = ("-drain", "-ready")

_NODE_TAG = "qwen-cluster:node"
_ROLE_TAG = "qwen-cluster:role"
_ENDPOINT_TYPES = (
    "aws:lb/loadBalancer:LoadBalancer",
    "aws:lb/listener:Listener",
    "aws:lb/targetGroup:TargetGroup",
)
_SERVER_LABELS = ("head", "pipeline-worker")
# The model-server document's parameters (qwen_cluster/render/ssm.py): a run restarts the
# container only when the hash of what it runs changed, or on a new instance (targets).
_SERVER_CONFIG_PARAMETER = "ConfigHash"


class UnknownResourceType(KeyError):
    pass


def rule_for(type_: str) -> Rule | None:
    """The rule for a type; explicit providers (`pulumi:providers:*`) update in place."""
    if type_.startswith("pulumi:providers:"):
        return Rule(type_, frozenset(), PROVIDER_RULE_SOURCE)
    return RULES.get(type_)


@dataclass
class Change:
    type: str
    name: str
    action: Action
    strategy: Strategy | None = None
    keys: list[str] = field(default_factory=list)
    replace_keys: list[str] = field(default_factory=list)  # the keys that force the replacement
    collision: str | None = None  # create-before-delete on a fixed identity

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- diff ---------------------------------------------------------------------------------------


def _ignored(key: str, ignore_changes: Iterable[str]) -> bool:
    return any(
        key == path or path.startswith(f"{key}.") or path.startswith(f"{key}[") for path in ignore_changes
    )


def _changed_keys(old: RecordedResource, new: RecordedResource) -> set[str]:
    keys = set(old.inputs) | set(new.inputs)
    return {
        key
        for key in keys
        if not key.startswith("__")
        and _normal(old.inputs.get(key)) != _normal(new.inputs.get(key))
        and not _ignored(key, new.ignore_changes)
    }


def _normal(value: Any) -> Any:
    """Numbers as the engine compares them (gRPC hands every number over as a float)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping):
        return {key: _normal(item) for key, item in value.items() if item not in (None, [], {})}
    if isinstance(value, list | tuple):
        return [_normal(item) for item in value]
    return value


def _decide(resource: RecordedResource, keys: set[str]) -> tuple[Action, list[str]]:
    rule = rule_for(resource.type)
    if rule is None:
        raise UnknownResourceType(
            f"{resource.type} ({resource.name}) has no rule in tooling/changes.py RULES: "
            "add one citing the provider source before registering it"
        )
    if not keys:
        return "same", []
    forced = sorted(
        key
        for key in keys
        if rule.replaces_key(key) or any(key == path.split(".")[0] for path in resource.replace_on_changes)
    )
    if "*" in resource.replace_on_changes:
        forced = sorted(keys)
    return ("replace" if forced else "update"), forced


def _strategy(resource: RecordedResource) -> Strategy:
    rule = rule_for(resource.type)
    if resource.delete_before_replace or (rule is not None and rule.delete_before_replace):
        return "delete-before-replace"
    return "create-before-delete"


def diff(old: Render, new: Render) -> list[Change]:
    """Per custom resource of either render: what the engine would do, in the new render's
    registration order (deleted resources last)."""
    old_by = {(r.type, r.name): r for r in old.custom_resources}
    new_by = {(r.type, r.name): r for r in new.custom_resources}
    keys: dict[tuple[str, str], set[str]] = {}
    for ident, resource in new_by.items():
        if ident in old_by:
            keys[ident] = _changed_keys(old_by[ident], resource)

    # Ripples: replaced resources change their id/ARN/DNS name; updated launch templates their
    # latest version. Inputs holding those values change with them.
    marks = references(new.custom_resources)
    holders: dict[tuple[str, str], dict[tuple[str, str], set[str]]] = {}
    for ident, resource in new_by.items():
        for key, value in resource.inputs.items():
            for text in strings(value):
                if text in marks:
                    source = (marks[text].type, marks[text].name)
                    if source != ident:
                        holders.setdefault(source, {}).setdefault(ident, set()).add(key)
    decided: dict[tuple[str, str], tuple[Action, list[str]]] = {}
    changed = True
    while changed:
        changed = False
        for ident in keys:
            decided[ident] = _decide(new_by[ident], keys[ident])
        for source, dependents in holders.items():
            if source not in new_by:
                continue
            action = decided.get(source, ("create", []))[0]
            rule = rule_for(source[0])
            moves = action in ("replace", "create") or (
                action == "update" and rule is not None and rule.new_version_on_update
            )
            if not moves:
                continue
            for dependent, dependent_keys in dependents.items():
                if dependent in keys and not dependent_keys <= keys[dependent]:
                    keys[dependent] |= dependent_keys
                    changed = True

    changes: list[Change] = []
    for ident, resource in new_by.items():
        if ident not in old_by:
            changes.append(Change(resource.type, resource.name, "create"))
            continue
        action, forced = decided[ident]
        change = Change(resource.type, resource.name, action, keys=sorted(keys[ident]), replace_keys=forced)
        if action == "replace":
            change.strategy = _strategy(resource)
            if change.strategy == "create-before-delete":
                change.collision = fixed_identity(resource, new)
        changes.append(change)
    for ident, resource in old_by.items():
        if ident not in new_by:
            changes.append(Change(resource.type, resource.name, "delete"))
    return changes


def fixed_identity(resource: RecordedResource, render: Render) -> str | None:
    """What the old and the new resource could not both hold at once, if anything: a static
    private IP (EC2 answers InvalidIPAddress.InUse), a container name, a security-group rule
    (InvalidPermission.Duplicate)."""
    if resource.type == "aws:ec2/instance:Instance":
        if resource.inputs.get("privateIp"):
            return f"static IP {resource.inputs['privateIp']}"
        template = resource.inputs.get("launchTemplate") or {}
        marks = references(render.custom_resources)
        source = marks.get(str(template.get("id", "")))
        if source is not None:
            for interface in source.inputs.get("networkInterfaces") or []:
                if interface.get("privateIpAddress"):
                    return f"static IP {interface['privateIpAddress']} (launch template {source.name})"
    if resource.type == "docker:index/container:Container" and resource.inputs.get("name"):
        return f"container name {resource.inputs['name']}"
    if resource.type.startswith("aws:vpc/securityGroup") and resource.type.endswith("Rule"):
        return "the same security-group rule (InvalidPermission.Duplicate)"
    return None


# --- serving impact -----------------------------------------------------------------------------


@dataclass
class Rollout:
    replicas: int
    max_replicas_out_of_service: int
    nodes_replaced: list[str]
    servers_restarted: list[str]
    endpoint_stays_up: bool
    endpoint_changes: list[str]
    collisions: list[str]
    steps: list[list[str]]  # replicas out of service together, in the order the engine reaches them

    def as_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "maxReplicasOutOfService": self.max_replicas_out_of_service,
            "nodesReplaced": self.nodes_replaced,
            "serversRestarted": self.servers_restarted,
            "endpointStaysUp": self.endpoint_stays_up,
            "endpointChanges": self.endpoint_changes,
            "collisions": self.collisions,
            "steps": self.steps,
        }


def _layout(render: Render) -> tuple[dict[str, str], dict[str, int]]:
    """The render's nodes: IP -> name, and name -> replica index (master first, consecutive
    groups of pipelineParallel nodes, as qwen_cluster/topology.py builds them)."""
    summary = render.outputs.get("summary") or {}
    nodes = summary.get("nodes") or []
    pipeline = int((summary.get("topology") or {}).get("pipelineParallel") or 1)
    ordered = sorted(nodes, key=lambda node: node.get("role") != "master")
    replica_of = {node["name"]: index // pipeline for index, node in enumerate(ordered)}
    return {node["ip"]: node["name"] for node in nodes}, replica_of


def _host_of(resource: RecordedResource, providers: Mapping[str, RecordedResource]) -> str | None:
    connection = resource.inputs.get("connection")
    if isinstance(connection, Mapping):
        connection = connection.get("value", connection)
        if isinstance(connection, Mapping) and connection.get("host"):
            return str(connection["host"])
    if resource.provider:
        provider_name = resource.provider.split("::")[-2] if "::" in resource.provider else ""
        provider = providers.get(provider_name)
        host = str((provider.inputs.get("host") if provider else "") or "")
        if host.startswith("ssh://"):
            return host.removeprefix("ssh://").split("@")[-1].split(":")[0]
    return None


def _labels(resource: RecordedResource) -> dict[str, str]:
    return {str(item.get("label")): str(item.get("value")) for item in resource.inputs.get("labels") or []}


def owners(render: Render) -> dict[str, str]:
    """Custom resource name -> the node it belongs to, where it belongs to one."""
    by_ip, _ = _layout(render)
    providers = {r.name: r for r in render.resources if r.type.startswith("pulumi:providers:")}
    owner: dict[str, str] = {}
    for resource in render.custom_resources:
        named = next(
            (resource.name.removesuffix(s) for s in ROLLOUT_STEP_SUFFIXES if resource.name.endswith(s)), ""
        )
        if resource.type == "command:remote:Command" and named in by_ip.values():
            owner[resource.name] = named
            continue
        tags = resource.inputs.get("tags") or {}
        if isinstance(tags, Mapping) and tags.get(_NODE_TAG):
            owner[resource.name] = str(tags[_NODE_TAG])
            continue
        host = _host_of(resource, providers)
        if host in by_ip and _labels(resource).get("qwen-cluster.role") != "load-balancer":
            owner[resource.name] = by_ip[host]
    # The rest by reference: a resource whose references reach nodes of one replica only
    # (a target-group attachment, a node's association) belongs to the first node referenced.
    _, replica_of = _layout(render)
    marks = references(render.custom_resources)
    for resource in render.custom_resources:
        if resource.name in owner:
            continue
        reached = [
            owner[marks[text].name]
            for text in strings(resource.inputs)
            if text in marks and marks[text].name in owner
        ]
        if reached and len({replica_of.get(node) for node in reached}) == 1:
            owner[resource.name] = reached[0]
    return owner


def _impact(resource: RecordedResource, change: Change, before: RecordedResource | None) -> str | None:
    """machine / server / endpoint, or None when the change leaves serving alone."""
    action = change.action
    tags = resource.inputs.get("tags") or {}
    role = tags.get(_ROLE_TAG) if isinstance(tags, Mapping) else None
    if resource.type == "aws:ec2/instance:Instance" and role == "gpu-node":
        return "machine" if action in ("replace", "delete") else None
    if resource.type in _ENDPOINT_TYPES:
        return "endpoint" if action in ("replace", "delete") else None
    if resource.type == "docker:index/container:Container":
        label = _labels(resource).get("qwen-cluster.role")
        if action in ("replace", "delete"):
            return "endpoint" if label == "load-balancer" else "server" if label in _SERVER_LABELS else None
        return None
    if resource.type == "aws:ssm/association:Association":
        parameters = resource.inputs.get("parameters") or {}
        if _SERVER_CONFIG_PARAMETER not in parameters or action not in ("replace", "update"):
            return None
        old_parameters = (before.inputs.get("parameters") or {}) if before else {}
        restarts = old_parameters.get(_SERVER_CONFIG_PARAMETER) != parameters[_SERVER_CONFIG_PARAMETER]
        return "server" if restarts or "targets" in change.keys else None
    if resource.type == "command:remote:Command" and resource.name.endswith(
        SERVER_COMMAND_SUFFIXES or ("\0",)
    ):
        return "server" if action in ("update", "replace", "create") else None
    return None


def _gates(resource: RecordedResource, change: Change) -> bool:
    """A change that, once carried out, has waited for its replica to serve again."""
    if change.action == "same" or change.action == "delete":
        return False
    if resource.type == "aws:ssm/association:Association":
        # Only a create (a new association or a replacement) waits: association.go.
        return bool(resource.inputs.get("waitForSuccessTimeoutSeconds")) and change.action in (
            "create",
            "replace",
        )
    if resource.type == "docker:index/container:Container":
        return bool(resource.inputs.get("wait"))
    if resource.type == "command:remote:Command":
        return bool(HEALTH_GATE_SUFFIXES) and resource.name.endswith(HEALTH_GATE_SUFFIXES)
    return False


def _ancestors(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    memo: dict[str, set[str]] = {}

    def walk(name: str, stack: frozenset[str]) -> set[str]:
        if name in memo:
            return memo[name]
        found: set[str] = set()
        for parent in graph.get(name, ()):
            if parent not in stack:
                found |= {parent} | walk(parent, stack | {parent})
        memo[name] = found
        return found

    for name in graph:
        walk(name, frozenset({name}))
    return memo


def rollout(old: Render, new: Render, changes: Sequence[Change] | None = None) -> Rollout:
    """What the changes do to serving, computed from the renders: which replicas go out of
    service, and which of those the engine's dependency order (through health gates) keeps
    apart."""
    changes = list(diff(old, new) if changes is None else changes)
    new_by = {r.name: r for r in new.custom_resources}
    old_by = {r.name: r for r in old.custom_resources}
    owner = owners(new) | {k: v for k, v in owners(old).items() if k not in new_by}
    _, replica_of = _layout(new)
    replicas = len(set(replica_of.values()))

    events: dict[str, tuple[int, str]] = {}  # resource -> (replica, impact)
    gates: dict[str, int] = {}  # resource -> replica it gates
    endpoint: list[str] = []
    nodes_replaced: set[str] = set()
    servers: set[str] = set()
    for change in changes:
        resource = new_by.get(change.name) or old_by.get(change.name)
        impact = _impact(resource, change, old_by.get(change.name))
        node = owner.get(change.name)
        replica = replica_of.get(node) if node else None
        if impact == "endpoint":
            endpoint.append(f"{change.name} ({change.action})")
            continue
        if change.name in new_by and node is not None and replica is not None and _gates(resource, change):
            gates[change.name] = replica
        if impact is None or node is None or replica is None:
            continue  # a node leaving or arriving is not an outage of a serving replica
        if change.action == "create":
            continue
        events[change.name] = (replica, impact)
        if impact == "machine":
            nodes_replaced.add(node)
            servers.add(node)
        elif impact == "server":
            servers.add(node)

    # Waves: an event waits for an earlier one when, between them in the dependency graph,
    # a health gate of the earlier event's replica has to pass.
    ancestors = _ancestors(new.dependencies())
    wave: dict[str, int] = {}

    def wave_of(name: str, seen: frozenset[str]) -> int:
        if name in wave:
            return wave[name]
        above = ancestors.get(name, set())
        best = 0
        for earlier, (replica, _) in events.items():
            if earlier in seen:
                continue
            passed = any(
                gate_replica == replica
                and gate in above
                and (gate == earlier or earlier in ancestors.get(gate, ()))
                for gate, gate_replica in gates.items()
            )
            if passed:
                best = max(best, wave_of(earlier, seen | {earlier}) + 1)
        wave[name] = best
        return best

    steps: dict[int, set[int]] = {}
    for name, (replica, _) in events.items():
        steps.setdefault(wave_of(name, frozenset({name})), set()).add(replica)
    ordered = [sorted(steps[index]) for index in sorted(steps)]
    most = max((len(step) for step in ordered), default=0)
    collisions = [f"{c.name}: create-before-delete on {c.collision}" for c in changes if c.collision]
    stays_up = not endpoint and (replicas == 0 or most < replicas)
    names_by_replica: dict[int, list[str]] = {}
    for node, index in replica_of.items():
        names_by_replica.setdefault(index, []).append(node)
    return Rollout(
        replicas=replicas,
        max_replicas_out_of_service=most,
        nodes_replaced=sorted(nodes_replaced),
        servers_restarted=sorted(servers),
        endpoint_stays_up=stays_up,
        endpoint_changes=endpoint,
        collisions=collisions,
        steps=[["+".join(sorted(names_by_replica.get(i, [str(i)]))) for i in step] for step in ordered],
    )


def verdict(summary: Rollout) -> int:
    """The plan's exit code: 0 the endpoint stays up, 3 every replica down at once, the
    endpoint replaced, or a replacement that would collide."""
    return 0 if summary.endpoint_stays_up and not summary.collisions else 3


# --- --change KEY=VALUE -----------------------------------------------------------------------


class ChangeSyntaxError(ValueError):
    pass


def parse_change(text: str) -> tuple[list[str], Any]:
    """`model.image=vllm/vllm-openai:v0.11.1` -> (["model", "image"], "vllm/..."). VALUE is JSON
    where it parses as JSON, else the plain string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ChangeSyntaxError(
            f"--change {text!r} is not KEY=VALUE (e.g. model.image=vllm/vllm-openai:v0.11.1)"
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    path = key.split(".")
    if any(not part for part in path):
        raise ChangeSyntaxError(f"--change {text!r}: the key {key!r} has an empty part")
    return path, value


def apply_changes(stack_config: Mapping[str, Any], changes: Iterable[str]) -> dict[str, Any]:
    """A copy of a stack file's `config:` map with each `KEY=VALUE` applied. KEY is the dotted
    path as in the stack file without the project namespace (`model.image`, `aws.amiId`,
    `access.clientCidrs`, `nodes`); a first part holding a colon is a full key (`aws:region`)."""
    result = copy.deepcopy(dict(stack_config))
    for text in changes:
        path, value = parse_change(text)
        head = path[0] if ":" in path[0] else f"{stackfile.config.NAMESPACE}:{path[0]}"
        if len(path) == 1:
            result[head] = value
            continue
        target = result.setdefault(head, {})
        if not isinstance(target, dict):
            raise ChangeSyntaxError(f"--change {text!r}: {path[0]} is not a section (it holds {target!r})")
        for part in path[1:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ChangeSyntaxError(f"--change {text!r}: {part} is not a section")
        target[path[-1]] = value
    return result
