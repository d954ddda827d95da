"""The model servers' lifecycle on AWS, apart from the machines: the GPU nodes' instance role
(SSM agent), the model-server SSM document and the permission to drain a node from the NLB.

One association per node applies the document (qwen_cluster/aws/nodes.py registers them, in a
chain, next to the instances they target); see qwen_cluster/render/ssm.py for what one run does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from qwen_cluster.render import ssm

# The DLAMI ships the SSM agent; this managed policy lets it register and take commands
# (https://docs.aws.amazon.com/systems-manager/latest/userguide/setup-instance-permissions.html).
SSM_CORE_POLICY = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
_EC2_TRUST = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
    ],
}


@dataclass
class NodeRoleArgs:
    tags: dict[str, str]


class NodeRole(pulumi.ComponentResource):
    """The GPU nodes' instance profile: the SSM agent's permissions, nothing else yet (the
    drain permission is added by ModelServerDocument once the target group exists)."""

    role_name: pulumi.Output[str]
    instance_profile_name: pulumi.Output[str]

    def __init__(self, name: str, args: NodeRoleArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:NodeRole", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(
            f"{name}-role",
            assume_role_policy=json.dumps(_EC2_TRUST),
            description="qwen-cluster GPU nodes: SSM agent and NLB self-drain",
            tags={**args.tags, "Name": f"{name}-role"},
            opts=child,
        )
        aws.iam.RolePolicyAttachment(
            f"{name}-ssm-core", role=role.name, policy_arn=SSM_CORE_POLICY, opts=child
        )
        profile = aws.iam.InstanceProfile(
            f"{name}-profile", role=role.name, tags={**args.tags, "Name": f"{name}-profile"}, opts=child
        )
        self.role_name = role.name
        self.instance_profile_name = profile.name
        self.register_outputs({"role": self.role_name, "instanceProfile": self.instance_profile_name})


@dataclass
class ModelServerDocumentArgs:
    role_name: pulumi.Input[str]
    target_group_arn: pulumi.Input[str]
    tags: dict[str, str]
    # qwen-cluster:rayAuthToken (an Output secret) when replicas span nodes, else None.
    ray_auth_token: pulumi.Input[str] | None = None


class ModelServerDocument(pulumi.ComponentResource):
    """The SSM Command document every node's association runs, and the nodes' permission to
    take themselves out of the target group and back (scoped to that group; DescribeTargetHealth
    takes no resource-level permission)."""

    document_name: pulumi.Output[str]
    drain_policy: aws.iam.RolePolicy

    def __init__(self, name: str, args: ModelServerDocumentArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:ModelServerDocument", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        document = aws.ssm.Document(
            f"{name}-document",
            document_type="Command",
            document_format="JSON",
            content=ssm.document(),
            tags={**args.tags, "Name": f"{name}-document"},
            opts=child,
        )
        self.drain_policy = aws.iam.RolePolicy(
            f"{name}-drain",
            role=args.role_name,
            policy=pulumi.Output.from_input(args.target_group_arn).apply(
                lambda arn: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Effect": "Allow",
                                "Action": [
                                    "elasticloadbalancing:DeregisterTargets",
                                    "elasticloadbalancing:RegisterTargets",
                                ],
                                "Resource": arn,
                            },
                            {
                                "Effect": "Allow",
                                "Action": "elasticloadbalancing:DescribeTargetHealth",
                                "Resource": "*",
                            },
                        ],
                    }
                )
            ),
            opts=child,
        )
        self.document_name = document.name
        self.ray_token_parameter: pulumi.Input[str] = ""
        self.ray_token_version: pulumi.Input[str] = ""
        if args.ray_auth_token is not None:
            self._ray_token(name, args, child)
        self.register_outputs({"document": self.document_name})

    def _ray_token(self, name: str, args: ModelServerDocumentArgs, child: pulumi.ResourceOptions) -> None:
        """rayAuthToken as an SSM SecureString (encrypted with the account's aws/ssm key) that the
        run script reads with `aws ssm get-parameter --with-decryption`, and the nodes' permission
        to read that one parameter. terraform-provider-aws internal/service/ssm/parameter.go:
        `name` is ForceNew; a new `value` updates in place (PutParameter, Overwrite) and raises
        `version`, which the associations carry, so a new token restarts each server through
        the usual drain and health gates. `value` is Sensitive there and a secret here."""
        parameter = aws.ssm.Parameter(
            f"{name}-ray-auth-token",
            name=f"/qwen-cluster/{pulumi.get_stack()}/ray-auth-token",
            type="SecureString",
            value=pulumi.Output.secret(args.ray_auth_token),
            description="qwen-cluster: the token Ray's processes authenticate with (RAY_AUTH_TOKEN)",
            tags={**args.tags, "Name": f"{name}-ray-auth-token"},
            opts=child,
        )
        # With the AWS managed key aws/ssm no kms:Decrypt grant is needed: its key policy lets
        # principals of the account use it through SSM (docs.aws.amazon.com/systems-manager/latest/
        # userguide/sysman-paramstore-access.html).
        self.ray_token_policy = aws.iam.RolePolicy(
            f"{name}-ray-auth-token-read",
            role=args.role_name,
            policy=parameter.arn.apply(
                lambda arn: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [{"Effect": "Allow", "Action": "ssm:GetParameter", "Resource": arn}],
                    }
                )
            ),
            opts=child,
        )
        self.ray_token_parameter = parameter.name
        self.ray_token_version = parameter.version.apply(str)
