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
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.aws.documents import command_document
from qwen_cluster.config import ClusterConfig
from qwen_cluster.node import NODEMETRICS_SCRIPT
from qwen_cluster.render import monitoring_ssm


@dataclass
class MonitoringArgs:
    cluster: ClusterConfig
    instance_ids: dict[str, pulumi.Input[str]]  # node name -> instance id
    tags: dict[str, str]


class Monitoring(pulumi.ComponentResource):
    def __init__(self, name: str, args: MonitoringArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:aws:Monitoring", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        cluster = args.cluster
        document = command_document(f"{name}-document", monitoring_ssm.document(), args.tags, child)
        source = NODEMETRICS_SCRIPT.read_text()
        self.associations = {
            node.name: aws.ssm.Association(
                f"{name}-{node.name}",
                name=document.name,
                targets=[{"key": "InstanceIds", "values": [args.instance_ids[node.name]]}],
                parameters=monitoring_ssm.parameters(cluster, node.name, source),
                max_concurrency="1",
                max_errors="0",
                opts=child,
            )
            for node in cluster.nodes
        }
        self.register_outputs({"document": document.name})
