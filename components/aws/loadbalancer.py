"""ModelLoadBalancer: the NLB in front of the replica heads' model port."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
from pulumi_command import local

from qwen_cluster.config import NLB_IDLE_TIMEOUT_SECONDS
from qwen_cluster.render import vllm


@dataclass
class ModelLoadBalancerArgs:
    vpc_id: pulumi.Input[str]
    subnet_ids: list[pulumi.Input[str]]
    security_group_id: pulumi.Input[str]
    internal: bool
    listener_port: int
    model_port: int
    idle_timeout_seconds: int
    # rollout.drainTimeoutSeconds: how long a deregistered head keeps its open streams, the
    # same bound the model-server run waits for (qwen_cluster/render/ssm.py). One fact.
    deregistration_delay_seconds: int
    tags: dict[str, str]
    # HTTP, or HTTPS when the node proxy terminates TLS (loadBalancer.tls). A health-check change
    # updates the target group in place (elbv2/target_group.go: health_check is not ForceNew).
    health_check_protocol: str = "HTTP"

    def validate(self) -> None:
        if not self.subnet_ids:
            raise ValueError("the load balancer needs a subnet")
        low, high = NLB_IDLE_TIMEOUT_SECONDS
        if not low <= self.idle_timeout_seconds <= high:
            raise ValueError(f"NLB TCP idle timeout {self.idle_timeout_seconds} is outside {low}-{high}")


class ModelLoadBalancer(pulumi.ComponentResource):
    """A TCP NLB with a security group.

    Why an NLB security group: the node SG can then admit the model port from the LB's group
    alone, which holds even with client IP preservation, and clientCidrs are enforced on the
    LB (https://docs.aws.amazon.com/elasticloadbalancing/latest/network/load-balancer-security-groups.html).
    Without one, the targets would have to admit clientCidrs (or the LB subnets) on the model
    port directly. A security group can only be given to an NLB when it is created.
    """

    dns_name: pulumi.Output[str]
    arn: pulumi.Output[str]
    endpoint: pulumi.Output[str]
    target_group_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelLoadBalancerArgs, opts: pulumi.ResourceOptions | None = None):
        args.validate()
        super().__init__("qwen-cluster:aws:ModelLoadBalancer", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        load_balancer = aws.lb.LoadBalancer(
            f"{name}-nlb",
            load_balancer_type="network",
            internal=args.internal,
            subnets=args.subnet_ids,
            security_groups=[args.security_group_id],
            # The targets sit in one AZ (the placement group); an internet-facing NLB spans two.
            enable_cross_zone_load_balancing=len(args.subnet_ids) > 1,
            tags={**args.tags, "Name": f"{name}-nlb"},
            opts=child,
        )
        target_group = aws.lb.TargetGroup(
            f"{name}-heads",
            port=args.model_port,
            protocol="TCP",
            target_type="instance",
            vpc_id=args.vpc_id,
            deregistration_delay=args.deregistration_delay_seconds,
            # Client IP preservation off: a node calling the endpoint could otherwise be sent
            # to itself and time out (NLB does not support hairpinning with it on).
            preserve_client_ip="false",
            health_check={
                "enabled": True,
                "protocol": args.health_check_protocol,
                # Through the node's proxy to vLLM's own /health (the proxy lets it through
                # without a key: a health check sends none).
                "path": vllm.HEALTH_PATH,
                "port": "traffic-port",
                "matcher": "200",
                "interval": 10,
                "timeout": 6,
                "healthy_threshold": 3,
                "unhealthy_threshold": 3,
            },
            tags={**args.tags, "Name": f"{name}-heads"},
            opts=child,
        )
        aws.lb.Listener(
            f"{name}-listener",
            load_balancer_arn=load_balancer.arn,
            port=args.listener_port,
            protocol="TCP",
            tcp_idle_timeout_seconds=args.idle_timeout_seconds,
            default_actions=[{"type": "forward", "target_group_arn": target_group.arn}],
            tags={**args.tags, "Name": f"{name}-listener"},
            opts=child,
        )
        self._name, self._model_port = name, args.model_port
        self.target_group_arn = target_group.arn
        self.dns_name = load_balancer.dns_name
        self.arn = load_balancer.arn
        scheme = "https" if args.health_check_protocol == "HTTPS" else "http"
        self.endpoint = load_balancer.dns_name.apply(lambda dns: f"{scheme}://{dns}:{args.listener_port}")
        self.register_outputs({"dnsName": self.dns_name, "endpoint": self.endpoint})

    def attach(self, node_name: str, instance_id: pulumi.Input[str]) -> aws.lb.TargetGroupAttachment:
        """Register a replica head. Called by the node group as each head's instance is
        declared (the nodes' rollout chain needs the target group first). Every attachment
        field is ForceNew (elbv2/target_group_attachment.go): a new instance, a new attachment.

        The attachment's delete is DeregisterTargets and returns at once (elbv2/
        target_group_attachment.go resourceAttachmentDelete: no wait for the drain), and the
        engine deletes the instance next, which would end the streams the NLB still drains to
        it. `<lb>-<node>-drained` stands between them: it depends on the instance and the
        attachment on it, so its delete runs after the attachment's and before the instance's
        (the engine deletes dependents first): it waits until the target has left the group,
        i.e. the deregistration delay ran out or its connections closed. Its create does
        nothing; `triggers` replaces it with the instance (a machine change), so the old
        instance's drain is waited for too."""
        drained = local.Command(
            f"{self._name}-{node_name}-drained",
            delete=pulumi.Output.all(self.target_group_arn, instance_id).apply(
                lambda values: _drained_command(values[0], values[1], self._model_port)
            ),
            triggers=[instance_id],
            opts=pulumi.ResourceOptions(parent=self),
        )
        return aws.lb.TargetGroupAttachment(
            f"{self._name}-{node_name}",
            target_group_arn=self.target_group_arn,
            target_id=instance_id,
            port=self._model_port,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[drained]),
        )


def _drained_command(target_group_arn: str, instance_id: str, port: int) -> str:
    """The deployer's AWS CLI waits for the target to leave the group (the waiter polls
    DescribeTargetHealth every 15 s, at most 40 times: a delay over 10 min is cut there)."""
    region = target_group_arn.split(":")[3] if target_group_arn.count(":") >= 3 else ""
    where = f"--region {shlex.quote(region)} " if region else ""
    return (
        f"aws elbv2 wait target-deregistered {where}--target-group-arn {shlex.quote(target_group_arn)} "
        f"--targets Id={shlex.quote(instance_id)},Port={port} "
        f'|| echo "{instance_id}: not out of the target group after the waiter; terminating anyway"'
    )
