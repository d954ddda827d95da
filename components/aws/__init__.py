"""The AWS target (stacks dev, prod): network, security groups, GPU nodes, NLB, optional bastion."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws

from qwen_cluster import summary
from qwen_cluster.config import ClusterConfig, EndpointSecrets
from qwen_cluster.render import router as router_render
from qwen_cluster.render import sg_rules, ssm, vpc_plan
from qwen_cluster.render.monitoring import containers as monitoring_containers
from qwen_cluster.render.sg_rules import Group
from qwen_cluster.tags import STACK_TAG

from .bastion import Bastion, BastionArgs
from .loadbalancer import ModelLoadBalancer, ModelLoadBalancerArgs
from .monitoring import Monitoring, MonitoringArgs
from .network import Network, NetworkArgs
from .nodes import GpuNodeGroup, GpuNodeGroupArgs
from .proxy import NodeProxy, NodeProxyArgs
from .router import Router, RouterArgs
from .security import SecurityGroups, SecurityGroupsArgs
from .serving import ModelServerDocument, ModelServerDocumentArgs, NodeRole, NodeRoleArgs

__all__ = ["build"]


def check_existing_vpc(vpc_id: str, plan: vpc_plan.VpcPlan) -> None:
    """An existing VPC must hold the node and public subnets. Looked up before anything is
    registered, so a VPC that cannot hold them stops the preview cleanly, naming both."""
    vpc = aws.ec2.get_vpc(id=vpc_id)
    listed = [vpc.cidr_block, *(a.cidr_block for a in vpc.cidr_block_associations or [])]
    cidrs = sorted({cidr for cidr in listed if cidr})
    missing = vpc_plan.outside_vpc(plan, cidrs)
    if missing:
        raise pulumi.RunError(
            f"aws.vpcId {vpc_id} ({', '.join(cidrs)}) cannot hold {', '.join(missing)}: choose "
            "network.cidr inside the VPC with room beside it"
        )


def build(
    cluster: ClusterConfig, secrets: EndpointSecrets | None = None, *, ray_auth_token: Any = None
) -> dict[str, Any]:
    """Register the AWS resources for a validated cluster; return the stack outputs. `secrets`:
    the endpoint's API keys and TLS files, Output secrets (config.EndpointSecrets)."""
    aws_target = cluster.aws
    if aws_target is None:
        raise ValueError("components.aws.build needs target aws")
    internet_facing = cluster.load_balancer.scheme == "internet-facing"
    tags = {STACK_TAG: pulumi.get_stack()}

    plan = vpc_plan.plan(cluster.network.cidr, internet_facing=internet_facing)
    if aws_target.vpc_id:
        check_existing_vpc(aws_target.vpc_id, plan)

    network = Network(
        "network",
        NetworkArgs(
            plan=plan,
            availability_zone=aws_target.availability_zone,
            region=aws_target.region,
            vpc_id=aws_target.vpc_id,
            tags=tags,
        ),
    )
    security = SecurityGroups(
        "security",
        SecurityGroupsArgs(vpc_id=network.vpc_id, rules=sg_rules.rules(cluster.exposures()), tags=tags),
    )
    topology = cluster.topology
    load_balancer = ModelLoadBalancer(
        "model-lb",
        ModelLoadBalancerArgs(
            vpc_id=network.vpc_id,
            # Internal: in the node subnet, next to its targets. Internet-facing: the public
            # subnets in two AZs.
            subnet_ids=network.public_subnet_ids if internet_facing else [network.node_subnet_id],
            security_group_id=security.group_ids[Group.LOAD_BALANCER],
            internal=not internet_facing,
            listener_port=cluster.load_balancer.port,
            model_port=cluster.model_port,
            idle_timeout_seconds=cluster.load_balancer.idle_timeout_seconds,
            deregistration_delay_seconds=cluster.rollout.drain_timeout_seconds,
            # The node proxy terminates TLS: the NLB's health check speaks it too.
            health_check_protocol="HTTPS" if cluster.load_balancer.tls else "HTTP",
            tags=tags,
        ),
    )
    role = NodeRole("gpu-node-role", NodeRoleArgs(tags=tags))
    serving = ModelServerDocument(
        "model-server",
        ModelServerDocumentArgs(
            role_name=role.role_name,
            target_group_arn=load_balancer.target_group_arn,
            tags=tags,
            weights=cluster.model.weights,
            ray_auth_token=ray_auth_token,
            routed=router_render.needs_router(cluster),
            pd=cluster.disaggregated,
        ),
    )
    node_proxy = NodeProxy(
        "node-proxy",
        NodeProxyArgs(
            cluster=cluster, secrets=secrets or EndpointSecrets(), role_name=role.role_name, tags=tags
        ),
    )
    nodes = GpuNodeGroup(
        "gpu-nodes",
        GpuNodeGroupArgs(
            cluster=cluster,
            subnet_id=network.node_subnet_id,
            security_group_id=security.group_ids[Group.NODES],
            monitoring_security_group_id=security.group_ids.get(Group.MONITORING_NODE),
            tags=tags,
            instance_profile_name=role.instance_profile_name,
            document_name=serving.document_name,
            stage_document_name=serving.stage_document_name,
            target_group_arn=load_balancer.target_group_arn,
            attach=load_balancer.attach,
            ready=serving.ready,
            ray_token_parameter=serving.ray_token_parameter,
            ray_token_version=serving.ray_token_version,
            front=node_proxy.front,
        ),
    )
    if router_render.needs_router(cluster):
        # One router for every node's proxy, on the master (docs/routing.md, "AWS").
        master_id = nodes.instance_ids[cluster.master.name]
        Router("router", RouterArgs(cluster=cluster, instance_id=master_id, tags=tags))
    if cluster.monitoring.exporters or cluster.monitoring.prometheus:
        Monitoring(
            "monitoring",
            MonitoringArgs(
                cluster=cluster,
                instance_ids=nodes.instance_ids,
                tags=tags,
                password=(secrets or EndpointSecrets()).monitoring_password,
                tls_certificate=(secrets or EndpointSecrets()).monitoring_tls_certificate,
                tls_private_key=(secrets or EndpointSecrets()).monitoring_tls_private_key,
                role_name=role.role_name,
                instance_arns=nodes.instance_arns,
            ),
        )
    data = summary.summary(cluster)
    outputs: dict[str, Any] = {
        "endpoint": load_balancer.endpoint,
        "loadBalancerDnsName": load_balancer.dns_name,
        "nodes": {
            node.name: {
                "id": nodes.instance_ids[node.name],
                "ip": str(node.ip),
                "head": topology.is_head(node.name),
            }
            for node in cluster.nodes
        },
        "nodeIds": [nodes.instance_ids[node.name] for node in cluster.nodes],
        "nodeIps": [str(node.ip) for node in cluster.nodes],
        "securityGroupIds": {str(group): sg_id for group, sg_id in security.group_ids.items()},
        "placementGroup": nodes.placement_group_name,
        # The image each node was launched from: a looked-up DLAMI is kept (ignoreChanges), so
        # this is what runs, not what the lookup answers today.
        "ami": {
            "source": "aws.amiId" if aws_target.ami_id else "looked up once, kept (set aws.amiId to upgrade)",
            "ids": nodes.image_ids,
        },
        "rollout": {
            "order": nodes.rollout_order,
            "maxUnavailable": cluster.max_unavailable,
            "lanes": nodes.lanes,
            "staged": [nodes.staged.urn],
            # The longest one replica holds its lane: its association's wait (ssm.wait_seconds).
            "replicaBoundSeconds": ssm.wait_seconds(cluster),
            "drainTimeoutSeconds": cluster.rollout.drain_timeout_seconds,
            "healthTimeoutSeconds": cluster.rollout.health_timeout_seconds,
        },
        "vpcId": network.vpc_id,
        "portTable": data["ports"],
        "topology": data["topology"],
        **monitoring_containers.stack_outputs(cluster),
    }
    if aws_target.bastion:
        bastion = Bastion(
            "bastion",
            BastionArgs(
                subnet_id=network.public_subnet_ids[0],
                security_group_id=security.group_ids[Group.BASTION],
                tags=tags,
            ),
        )
        outputs["bastionPublicIp"] = bastion.public_ip
    return outputs
