"""vLLM's router on the master (loadBalancer.routing cache-aware): its SSM document and the one
association that runs it (qwen_cluster/render/router_ssm.py says what a run does).

Day 2, from the provider's source (hashicorp/terraform-provider-aws, tooling/changes/rules.py):
- the document's `content` updates in place: internal/service/ssm/document.go
  resourceDocumentUpdate calls UpdateDocument and then UpdateDocumentDefaultVersion with the new
  version, so the next run of the association runs the new text;
- the association's `parameters` update in place (internal/service/ssm/association.go:
  UpdateAssociation; only `name` and `instance_id` are ForceNew), and an updated association runs
  again on its target. Its create is the only call that waits for a run
  (wait_for_success_timeout_seconds), and nothing here needs to wait: the router listens only once
  every replica answers /health, and each proxy sends to its own vLLM meanwhile. So, as the
  monitoring associations (components/aws/monitoring.py), it keeps the in-place update and sets
  no replaceOnChanges: a new router image, a replica added or removed (its --worker-urls) or new
  thresholds change the parameters, the run replaces the container, and no model server restarts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.aws.documents import command_document
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import router_ssm


@dataclass
class RouterArgs:
    cluster: ClusterConfig
    instance_id: pulumi.Input[str]  # the master's
    tags: dict[str, str]


class Router(pulumi.ComponentResource):
    def __init__(self, name: str, args: RouterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:Router", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.document = command_document(f"{name}-document", router_ssm.document(), args.tags, child)
        self.association = aws.ssm.Association(
            f"{name}-{args.cluster.master.name}",
            name=self.document.name,
            targets=[{"key": "InstanceIds", "values": [args.instance_id]}],
            parameters=router_ssm.parameters(args.cluster),
            max_concurrency="1",
            max_errors="0",
            opts=child,
        )
        self.register_outputs({"document": self.document.name})
