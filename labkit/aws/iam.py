"""The node role's policy documents as the lab's IAM sees them: every inline
`aws:iam/rolePolicy:RolePolicy` on the role as the program registers it, and every attached
managed policy (the one the program attaches is below, as AWS publishes it). They are read from
the render with the lab's identities (labkit/aws/model.py `identities`) in place of the mocks'
values. The evaluation is the tooling's (tooling/iampolicy.py), the one the deploy policy is
checked with.
"""

from __future__ import annotations

import json
from typing import Any

# AmazonSSMManagedInstanceCore, version v2 (the default since 2019-05-23), as AWS publishes it:
# https://docs.aws.amazon.com/aws-managed-policy/latest/reference/AmazonSSMManagedInstanceCore.html
MANAGED_POLICIES: dict[str, dict[str, Any]] = {
    "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore": {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": [
                    "ssm:DescribeAssociation",
                    "ssm:GetDeployablePatchSnapshotForInstance",
                    "ssm:GetDocument",
                    "ssm:DescribeDocument",
                    "ssm:GetManifest",
                    "ssm:GetParameter",
                    "ssm:GetParameters",
                    "ssm:ListAssociations",
                    "ssm:ListInstanceAssociations",
                    "ssm:PutInventory",
                    "ssm:PutComplianceItems",
                    "ssm:PutConfigurePackageResult",
                    "ssm:UpdateAssociationStatus",
                    "ssm:UpdateInstanceAssociationStatus",
                    "ssm:UpdateInstanceInformation",
                ],
                "Resource": "*",
            },
            {
                "Effect": "Allow",
                "Action": [
                    "ssmmessages:CreateControlChannel",
                    "ssmmessages:CreateDataChannel",
                    "ssmmessages:OpenControlChannel",
                    "ssmmessages:OpenDataChannel",
                ],
                "Resource": "*",
            },
            {
                "Effect": "Allow",
                "Action": [
                    "ec2messages:AcknowledgeMessage",
                    "ec2messages:DeleteMessage",
                    "ec2messages:FailMessage",
                    "ec2messages:GetEndpoint",
                    "ec2messages:GetMessages",
                    "ec2messages:SendReply",
                ],
                "Resource": "*",
            },
        ],
    }
}


def documents_of_role(role_name: str, inline: list[str], attached: list[str]) -> list[dict[str, Any]]:
    """The role's policy documents: inline policy texts (JSON) and attached managed policy ARNs."""
    documents = [json.loads(text) for text in inline]
    for arn in attached:
        if arn not in MANAGED_POLICIES:
            raise ValueError(f"{role_name}: managed policy {arn} is not known to the lab (labkit/aws/iam.py)")
        documents.append(MANAGED_POLICIES[arn])
    return documents
