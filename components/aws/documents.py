"""The one way the AWS components register an SSM Command document: its content is rendered by
qwen_cluster/render/ (ssm.command_document builds it), its Name tag is the resource's name.

A changed `content` updates the document in place, a new version; `name` and `document_type`
replace it (tooling/changes/rules.py, terraform-provider-aws internal/service/ssm/document.go)."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws


def command_document(
    name: str, content: pulumi.Input[str], tags: dict[str, str], opts: pulumi.ResourceOptions
) -> aws.ssm.Document:
    return aws.ssm.Document(
        name,
        document_type="Command",
        document_format="JSON",
        content=content,
        tags={**tags, "Name": name},
        opts=opts,
    )
