"""What the program registered for the AWS target, read from a render (tooling/offline.py) as
the lab acts on it: instances, SSM documents and associations, parameters, the node role's
policies, the target group and its listener. Nothing here is written per stack.

The mocks answer ids and ARNs of their own (`<name>-id`, `arn:aws:mock:::...`); AWS answers
real ones, and the node role's policies and the association parameters compare against those
(an ARN in a policy must match the ARN the call names). So every mock value is replaced by what
AWS would have answered (`identities`): instance ids `i-...`, ARNs with the partition, region
and the lab's account, Parameter ARNs from their names, as AWS builds them.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from labkit.engine.executor import plain
from tooling.offline import RecordedResource, Render, references

ACCOUNT = "123456789012"  # the lab's account (AWS's documentation account number)
INSTANCE = "aws:ec2/instance:Instance"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
DOCUMENT = "aws:ssm/document:Document"
ASSOCIATION = "aws:ssm/association:Association"
PARAMETER = "aws:ssm/parameter:Parameter"
ROLE = "aws:iam/role:Role"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
ATTACHMENT = "aws:iam/rolePolicyAttachment:RolePolicyAttachment"
PROFILE = "aws:iam/instanceProfile:InstanceProfile"
TARGET_GROUP = "aws:lb/targetGroup:TargetGroup"
TG_ATTACHMENT = "aws:lb/targetGroupAttachment:TargetGroupAttachment"
LISTENER = "aws:lb/listener:Listener"
LOAD_BALANCER = "aws:lb/loadBalancer:LoadBalancer"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"


def _hex(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def instance_arn(region: str, instance_id: str) -> str:
    return f"arn:aws:ec2:{region}:{ACCOUNT}:instance/{instance_id}"


def lab_value(resource: RecordedResource, kind: str, region: str) -> str:
    """What AWS answers for `kind` ("id" or "arn") of `resource`."""
    name = str(resource.outputs.get("name") or resource.inputs.get("name") or resource.name)
    if resource.type == INSTANCE:
        instance_id = f"i-0{_hex(resource.name, 16)}"
        return instance_id if kind == "id" else instance_arn(region, instance_id)
    if resource.type == PARAMETER:
        # GetParameter takes the name; the ARN of a name with a leading slash keeps one slash.
        path = name if name.startswith("/") else f"/{name}"
        return name if kind == "id" else f"arn:aws:ssm:{region}:{ACCOUNT}:parameter{path}"
    if resource.type == TARGET_GROUP:
        short = f"{name[:24]}-{_hex(name, 7)}"
        return f"arn:aws:elasticloadbalancing:{region}:{ACCOUNT}:targetgroup/{short}/{_hex(name, 16)}"
    if resource.type == LOAD_BALANCER:
        return (
            f"arn:aws:elasticloadbalancing:{region}:{ACCOUNT}:loadbalancer/net/{name[:32]}/{_hex(name, 16)}"
        )
    if resource.type == ROLE:
        return name if kind == "id" else f"arn:aws:iam::{ACCOUNT}:role/{name}"
    if resource.type == DOCUMENT:
        return name if kind == "id" else f"arn:aws:ssm:{region}:{ACCOUNT}:document/{name}"
    short = resource.type.split(":")[-1].lower()
    return (
        f"{resource.name}-{_hex(resource.name, 8)}"
        if kind == "id"
        else (f"arn:aws:{short}:{region}:{ACCOUNT}:{short}/{resource.name}")
    )


def identities(rendered: Render, region: str) -> dict[str, str]:
    """Mock value -> the value AWS would have answered, for every resource of the render."""
    table: dict[str, str] = {}
    for value, resource in references(rendered.custom_resources).items():
        kind = "id" if value == f"{resource.name}-id" else "arn"
        if kind == "arn" and value == resource.outputs.get("dnsName"):
            continue  # a DNS name stays: nothing on the nodes compares it
        if kind == "arn" and value != resource.outputs.get("arn"):
            continue  # a name the engine chose stays as the mocks chose it
        table[value] = lab_value(resource, kind, region)
    return table


def substitute(value: Any, table: dict[str, str]) -> Any:
    """`value` with every mock id and ARN replaced, also inside texts (policy JSON)."""
    if isinstance(value, dict):
        return {key: substitute(item, table) for key, item in value.items()}
    if isinstance(value, list):
        return [substitute(item, table) for item in value]
    if isinstance(value, str):
        if value in table:
            return table[value]
        if "arn:aws:mock:" in value or "-id" in value:
            for old in sorted(table, key=len, reverse=True):
                if old in value:
                    value = value.replace(old, table[old])
        return value
    return value


@dataclass
class Instance:
    resource: str
    node: str
    instance_id: str
    ip: str
    tags: dict[str, str]
    user_data: str
    instance_profile: str
    metadata_options: dict[str, Any]


@dataclass
class Association:
    resource: str
    document: str  # the document's name
    targets: list[dict[str, Any]]
    parameters: dict[str, str]
    max_concurrency: str
    max_errors: str
    wait_seconds: float | None


@dataclass
class TargetGroup:
    resource: str
    arn: str
    port: int
    protocol: str
    health_check: dict[str, Any]
    deregistration_delay: int


@dataclass
class AwsStack:
    """The render with the lab's identities, as the lab acts on it."""

    region: str
    instances: dict[str, Instance]  # by node name
    documents: dict[str, dict[str, Any]]  # document name -> its content (parsed JSON)
    associations: dict[str, Association]  # by resource name
    parameters: dict[str, dict[str, str]]  # resource -> {name, type, value, arn}
    role_policies: dict[str, list[str]]  # role name -> inline policy texts
    role_attachments: dict[str, list[str]]  # role name -> managed policy ARNs
    profiles: dict[str, str]  # instance profile name -> role name
    target_group: TargetGroup | None
    registrations: dict[str, tuple[str, int]]  # TargetGroupAttachment resource -> (target id, port)
    listener_port: int
    idle_timeout_seconds: int
    client_cidrs: list[str] = field(default_factory=list)
    weights_uri: str = ""

    def role_of_instance(self, instance: Instance) -> str:
        return self.profiles[instance.instance_profile]


def _int(value: Any, default: int = 0) -> int:
    return int(float(value)) if value not in (None, "") else default


def read(rendered: Render, region: str, weights_uri: str = "") -> AwsStack:
    """The AWS resources of a render, with every mock id and ARN replaced; `weights_uri`: the
    S3 prefix of `model.weights` (source s3), which the lab's bucket holds."""
    table = identities(rendered, region)

    def inputs(resource: RecordedResource) -> dict[str, Any]:
        return substitute(plain(resource.inputs), table)

    templates = {f"{r.name}-id": r for r in rendered.of_type(TEMPLATE)}
    instances = {}
    for resource in rendered.of_type(INSTANCE):
        if "launchTemplate" not in resource.inputs or "qwen-cluster:node" not in (
            resource.inputs.get("tags") or {}
        ):
            continue  # not a GPU node (the bastion)
        values = inputs(resource)
        template = templates[plain(resource.inputs)["launchTemplate"]["id"]]
        template_inputs = inputs(template)
        primary = next(i for i in template_inputs["networkInterfaces"] if i.get("privateIpAddress"))
        node = values["tags"]["qwen-cluster:node"]
        instances[node] = Instance(
            resource=resource.name,
            node=node,
            instance_id=table[f"{resource.name}-id"],
            ip=primary["privateIpAddress"],
            tags=dict(values.get("tags") or {}),
            user_data=base64.b64decode(template_inputs.get("userData") or "").decode(),
            instance_profile=template_inputs["iamInstanceProfile"]["name"],
            metadata_options=dict(template_inputs.get("metadataOptions") or {}),
        )
    documents = {}
    for resource in rendered.of_type(DOCUMENT):
        name = str(resource.outputs.get("name") or resource.inputs.get("name"))
        documents[name] = json.loads(plain(resource.inputs)["content"])
    associations = {}
    for resource in rendered.of_type(ASSOCIATION):
        values = inputs(resource)
        associations[resource.name] = Association(
            resource=resource.name,
            document=values["name"],
            targets=values.get("targets") or [],
            parameters={k: str(v) for k, v in (values.get("parameters") or {}).items()},
            max_concurrency=str(values.get("maxConcurrency") or ""),
            max_errors=str(values.get("maxErrors") or ""),
            wait_seconds=values.get("waitForSuccessTimeoutSeconds"),
        )
    parameters = {}
    for resource in rendered.of_type(PARAMETER):
        values = inputs(resource)
        parameters[resource.name] = {
            "name": values["name"],
            "type": values.get("type", "String"),
            "value": str(values.get("value") or ""),
            "arn": table[resource.outputs["arn"]],
        }
    role_policies: dict[str, list[str]] = {}
    for resource in rendered.of_type(ROLE_POLICY):
        values = inputs(resource)
        role_policies.setdefault(values["role"], []).append(values["policy"])
    role_attachments: dict[str, list[str]] = {}
    for resource in rendered.of_type(ATTACHMENT):
        values = inputs(resource)
        role_attachments.setdefault(values["role"], []).append(values["policyArn"])
    profiles = {str(r.outputs.get("name")): inputs(r)["role"] for r in rendered.of_type(PROFILE)}
    target_group = None
    for resource in rendered.of_type(TARGET_GROUP):
        values = inputs(resource)
        target_group = TargetGroup(
            resource=resource.name,
            arn=table[resource.outputs["arn"]],
            port=_int(values.get("port")),
            protocol=values.get("protocol", "TCP"),
            health_check=values.get("healthCheck") or {},
            deregistration_delay=_int(values.get("deregistrationDelay"), 300),
        )
    registrations = {
        r.name: (inputs(r)["targetId"], _int(inputs(r).get("port"))) for r in rendered.of_type(TG_ATTACHMENT)
    }
    listeners = [inputs(r) for r in rendered.of_type(LISTENER)]
    listener = listeners[0] if listeners else {}
    lb_groups = {
        str(v.get("securityGroups", [""])[0]) for v in (inputs(r) for r in rendered.of_type(LOAD_BALANCER))
    }
    client_cidrs = [
        str(values["cidrIpv4"])
        for values in (inputs(r) for r in rendered.of_type(INGRESS))
        if values.get("securityGroupId") in lb_groups and values.get("cidrIpv4")
    ]
    return AwsStack(
        region=region,
        instances=instances,
        documents=documents,
        associations=associations,
        parameters=parameters,
        role_policies=role_policies,
        role_attachments=role_attachments,
        profiles=profiles,
        target_group=target_group,
        registrations=registrations,
        listener_port=_int(listener.get("port"), 80),
        idle_timeout_seconds=_int(listener.get("tcpIdleTimeoutSeconds"), 350),
        client_cidrs=client_cidrs,
        weights_uri=weights_uri,
    )
