"""Monitoring on AWS, by the model server's means: one SSM Command document and, per node, an
association that runs that node's monitoring containers (and, on `monitoring.node`, writes
Prometheus's and Alertmanager's files and reloads them). What runs is the same ContainerSpecs
bare metal registers (qwen_cluster/render/monitoring/containers.py); qwen_cluster/render/monitoring_ssm.py
renders the document and the parameters.

Day 2 (tooling/changes/rules.py, terraform-provider-aws internal/service/ssm/association.go):
an association's `name` and `instance_id` replace it; `parameters` and `targets` update in
place (UpdateAssociation), and an updated association runs again on its targets. Unlike the
model server's associations these need no wait gate (nothing drains), so they keep that
in-place update: a new alert bound changes the monitoring node's parameters only, its run
rewrites the files and sends SIGHUP, and no model server association or instance changes. A
new instance (its id in `targets`) gets its monitoring by the same update.

With monitoring.tls (components/aws/proxy.py's way for the endpoint's secrets): the web config,
the servers' certificate chain and its private key, and with monitoring.password Prometheus's
password file (containers.secret_files, what bare metal writes) are SecureString parameters under
/qwen-cluster/<stack>/monitoring/. The monitoring node's association holds their ARNs and
versions, never a value, and its run reads them with the node's role (render/monitoring_ssm.py).
A new password or certificate updates the parameters in place with a new version
(internal/service/ssm/parameter.go), so the association's parameters change and it is updated in
place: resourceAssociationUpdate sends every parameter with UpdateAssociation
(internal/service/ssm/association.go), and "when you update an association, the association
immediately runs against the specified targets" (SSM API Reference, UpdateAssociation). That run
rewrites the files; both servers read them on the next request or connection: no restart, so
Prometheus's data and Alertmanager's silences stay. No other node's association and no container
changes.

Who may read them: every GPU node has the one role (serving.py NodeRole), whose managed
AmazonSSMManagedInstanceCore allows ssm:GetParameter on every parameter. So the read policy
allows the monitoring node's instance and denies every other: the condition key
ec2:SourceInstanceARN is the ARN of the instance the role's credentials were delivered to, and
"an AWS global condition key, which means that you can use it with services other than Amazon
EC2" (Amazon EC2 User Guide, "Identity-based policies for Amazon EC2", Condition keys), SSM's
GetParameter among them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_aws as aws

from components.aws.documents import command_document
from qwen_cluster.config import ClusterConfig
from qwen_cluster.node import NODEMETRICS_SCRIPT
from qwen_cluster.render import monitoring_ssm
from qwen_cluster.render.monitoring import containers

from .serving import PARAMETER_PREFIX

# The secret parameters -> the association parameter that names each (monitoring_ssm.PARAMETERS);
# the last part of a parameter's name is its key here.
SECRET_PARAMETERS = {
    "web-config": "web_config_parameter",
    "password": "password_parameter",
    "tls-certificate": "tls_certificate_parameter",
    "tls-private-key": "tls_private_key_parameter",
}
# What reads a parameter's value: GetParameter (the run), GetParameters, GetParameterHistory
# (every version's value). GetParametersByPath names the path, not these ARNs; no policy of the
# node role allows it.
READ_ACTIONS = ["ssm:GetParameter", "ssm:GetParameters", "ssm:GetParameterHistory"]
SOURCE_INSTANCE_KEY = "ec2:SourceInstanceARN"


def read_policy(parameter_arns: list[str], instance_arn: str) -> dict[str, Any]:
    """The node role's policy on the monitoring credentials: read by the monitoring node's
    instance only. The deny matters: the role's managed policy allows GetParameter on "*"."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "MonitoringNodeReadsItsCredentials",
                "Effect": "Allow",
                "Action": "ssm:GetParameter",
                "Resource": parameter_arns,
                "Condition": {"StringEquals": {SOURCE_INSTANCE_KEY: instance_arn}},
            },
            {
                "Sid": "NoOtherNodeReadsThem",
                "Effect": "Deny",
                "Action": READ_ACTIONS,
                "Resource": parameter_arns,
                "Condition": {"StringNotEquals": {SOURCE_INSTANCE_KEY: instance_arn}},
            },
        ],
    }


@dataclass
class MonitoringArgs:
    cluster: ClusterConfig
    instance_ids: dict[str, pulumi.Input[str]]  # node name -> instance id
    tags: dict[str, str]
    # monitoring.password, an Output secret (None: Prometheus and Alertmanager ask for nothing).
    password: pulumi.Input[str] | None = None
    # monitoring.tls's chain and key, Output secrets (None: the servers speak plain HTTP).
    tls_certificate: pulumi.Input[str] | None = None
    tls_private_key: pulumi.Input[str] | None = None
    role_name: pulumi.Input[str] | None = None  # the GPU nodes' role (with monitoring.tls)
    instance_arns: dict[str, pulumi.Input[str]] = field(default_factory=dict)  # node name -> ARN


class Monitoring(pulumi.ComponentResource):
    def __init__(self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:Monitoring", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cluster = args.cluster
        document = command_document(f"{name}-document", monitoring_ssm.document(), args.tags, child)
        source = NODEMETRICS_SCRIPT.read_text()
        self.parameters: dict[str, aws.ssm.Parameter] = {}
        self.read_policy: aws.iam.RolePolicy | None = None
        credentials: dict[str, Any] = {}
        if monitoring_ssm.with_secrets(cluster):
            credentials = self._credentials(name, args, child)
        self.associations = {}
        for node in cluster.nodes:
            servers = monitoring_ssm.runs_servers(cluster, node.name)
            self.associations[node.name] = aws.ssm.Association(
                f"{name}-{node.name}",
                name=document.name,
                targets=[{"key": "InstanceIds", "values": [args.instance_ids[node.name]]}],
                parameters=monitoring_ssm.parameters(
                    cluster, node.name, source, **(credentials if servers else {})
                ),
                max_concurrency="1",
                max_errors="0",
                opts=pulumi.ResourceOptions(
                    parent=self,
                    # Its first run reads the parameters: the grant is in place before it.
                    depends_on=[self.read_policy] if servers and self.read_policy is not None else [],
                ),
            )
        self.register_outputs({"document": document.name})

    def _credentials(self, name: str, args: MonitoringArgs, child: pulumi.ResourceOptions) -> dict[str, Any]:
        """The secret files as SecureString parameters, the monitoring node's read on them, and
        what its association carries: their ARNs and versions."""
        cluster = args.cluster
        where = cluster.monitoring_node
        if args.role_name is None or where is None or where.name not in args.instance_arns:
            raise ValueError("monitoring.tls on AWS needs the node role and the monitoring instance")
        if args.tls_certificate is None or args.tls_private_key is None:
            raise ValueError("monitoring.tls needs its certificate and private key as secrets")
        stack = pulumi.get_stack()
        prefix = f"{PARAMETER_PREFIX.format(stack=stack)}monitoring"
        password = args.password if containers.credentials(cluster) else None
        # The same files bare metal writes, from the same function: one source of truth. The
        # chain and the key are apart (the node joins them, monitoring_ssm.secret_sources).
        files = pulumi.Output.secret(
            pulumi.Output.all(args.tls_certificate, args.tls_private_key, password)
        ).apply(
            lambda values: containers.secret_files(
                stack, certificate=values[0], private_key=values[1], password=values[2]
            )
        )
        values = {
            "web-config": files.apply(lambda texts: texts[containers.WEB_CONFIG_FILE]),
            "tls-certificate": args.tls_certificate,
            "tls-private-key": args.tls_private_key,
        }
        if password is not None:
            values["password"] = files.apply(lambda texts: texts[containers.PASSWORD_FILE])
        for role, value in values.items():
            self.parameters[role] = aws.ssm.Parameter(
                f"{name}-{role}",
                name=f"{prefix}/{role}",
                type="SecureString",  # encrypted with the account's aws/ssm key
                value=pulumi.Output.secret(
                    pulumi.Output.from_input(value).apply(monitoring_ssm.parameter_value)
                ),
                # A certificate chain can pass the standard tier's 4 KB; this tier moves up alone
                # (as the endpoint's, components/aws/proxy.py).
                tier="Intelligent-Tiering" if role == "tls-certificate" else None,
                tags={**args.tags, "Name": f"{name}-{role}"},
                opts=child,
            )
        arns = [parameter.arn for parameter in self.parameters.values()]
        self.read_policy = aws.iam.RolePolicy(
            f"{name}-read",
            role=args.role_name,
            policy=pulumi.Output.all(args.instance_arns[where.name], *arns).apply(
                lambda resolved: json.dumps(read_policy(list(resolved[1:]), resolved[0]))
            ),
            opts=child,
        )
        versions = [parameter.version for parameter in self.parameters.values()]
        return {
            **{SECRET_PARAMETERS[role]: parameter.arn for role, parameter in self.parameters.items()},
            "secrets_version": pulumi.Output.all(*versions).apply(
                lambda resolved: ",".join(str(int(v)) for v in resolved if v is not None)
            ),
        }
