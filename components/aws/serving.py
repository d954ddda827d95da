"""The model servers' lifecycle on AWS, apart from the machines: the GPU nodes' instance role
(SSM agent), the model-server and staging SSM documents, the permission to drain a node from the
NLB, and (model.weights.source s3) the read on exactly the weights' S3 prefix.

One association per node applies the document (components/aws/nodes.py registers them, in a
chain, next to the instances they target); see qwen_cluster/render/ssm.py for what one run does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from components.aws.documents import command_document
from qwen_cluster.config import Weights
from qwen_cluster.render import ssm, weights

# The DLAMI ships the SSM agent; this managed policy lets it register and take commands
# (https://docs.aws.amazon.com/systems-manager/latest/userguide/setup-instance-permissions.html).
SSM_CORE_POLICY = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"
_EC2_TRUST = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
    ],
}


PARAMETER_PREFIX = "/qwen-cluster/{stack}/"


def parameters_scope(stack: str) -> dict:
    """The node role's deny of every SSM parameter outside the stack's own prefix."""
    prefix = PARAMETER_PREFIX.format(stack=stack).strip("/")
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "OnlyThisStacksParameters",
                "Effect": "Deny",
                "Action": ["ssm:GetParameter", "ssm:GetParameters", "ssm:GetParametersByPath"],
                "NotResource": f"arn:aws:ssm:*:*:parameter/{prefix}/*",
            }
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
        # AmazonSSMManagedInstanceCore allows ssm:GetParameter and ssm:GetParameters on "*": with
        # it alone every node could read every parameter of the account (another stack's API
        # keys, TLS key, Ray token), whatever the scoped read policies say. An explicit deny
        # outside this stack's own prefix wins over that allow (IAM policy evaluation logic);
        # the agent needs those actions only for {{ssm:...}} references, which no document of
        # the program has. Found by the AWS lab (tooling/iampolicy.py evaluating the node role).
        aws.iam.RolePolicy(
            f"{name}-parameters-scope",
            role=role.name,
            policy=json.dumps(parameters_scope(pulumi.get_stack())),
            opts=child,
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
    weights: Weights = field(default_factory=Weights)
    # qwen-cluster:rayAuthToken (an Output secret) when replicas span nodes, else None.
    ray_auth_token: pulumi.Input[str] | None = None
    # loadBalancer.routing cache-aware: the runs call vLLM's router's admin routes (render/ssm.py).
    routed: bool = False
    # serving.mode disaggregated: the runs take the replica out of the P/D router's choice through
    # this node's proxy and the router's health checks instead (render/ssm.py _PD_MEMBERSHIP).
    pd: bool = False


class ModelServerDocument(pulumi.ComponentResource):
    """The SSM Command documents every node's associations run (staging, then the model
    server), the nodes' permission to take themselves out of the target group and back (scoped
    to that group; DescribeTargetHealth takes no resource-level permission) and, for weights in
    S3, their read on exactly that prefix (weights.s3_read_policy).

    `ready` lists what a node's first association needs in place (the drain permission, the
    weights read): an inline policy's changes reach the role at once, and both are updated in
    place (terraform-provider-aws internal/service/iam/role_policy.go: `policy` updates with
    PutRolePolicy; `role` and `name` ForceNew; tooling/changes/rules.py)."""

    document_name: pulumi.Output[str]
    stage_document_name: pulumi.Output[str]
    drain_policy: aws.iam.RolePolicy
    weights_policy: aws.iam.RolePolicy | None
    ready: list[pulumi.Resource]

    def __init__(self, name: str, args: ModelServerDocumentArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:ModelServerDocument", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        document = command_document(f"{name}-document", ssm.document(args.routed, args.pd), args.tags, child)
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
        stage_document = command_document(f"{name}-stage-document", ssm.stage_document(), args.tags, child)
        self.weights_policy = None
        if args.weights.source == "s3":
            # The nodes reach the bucket through the VPC's S3 gateway endpoint (network.py), in
            # the region, without the NAT; this policy is what they may read there.
            self.weights_policy = aws.iam.RolePolicy(
                f"{name}-weights",
                role=args.role_name,
                policy=weights.s3_read_policy_json(args.weights),
                opts=child,
            )
        self.ready = [self.drain_policy, *([self.weights_policy] if self.weights_policy else [])]
        self.document_name = document.name
        self.ray_token_parameter: pulumi.Input[str] = ""
        self.ray_token_version: pulumi.Input[str] = ""
        if args.ray_auth_token is not None:
            self._ray_token(name, args, child)
            self.ready.append(self.ray_token_policy)
        self.stage_document_name = stage_document.name
        self.register_outputs({"document": self.document_name, "stageDocument": self.stage_document_name})

    def _ray_token(self, name: str, args: ModelServerDocumentArgs, child: pulumi.ResourceOptions) -> None:
        """rayAuthToken as an SSM SecureString (encrypted with the account's aws/ssm key) that the
        run script reads with `aws ssm get-parameter --with-decryption`, and the nodes' permission
        to read that one parameter. terraform-provider-aws internal/service/ssm/parameter.go:
        `name` is ForceNew; a new `value` updates in place (PutParameter, Overwrite) and raises
        `version`, which the associations carry, so a new token restarts each server through
        the usual drain and health gates. `value` is Sensitive there and a secret here."""
        parameter = aws.ssm.Parameter(
            f"{name}-ray-auth-token",
            name=f"{PARAMETER_PREFIX.format(stack=pulumi.get_stack())}ray-auth-token",
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
