"""vLLM's router as a container on bareMetal.loadBalancerNode (loadBalancer.routing cache-aware)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_docker as docker

from qwen_cluster import tags
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import router


def container_spec(cluster: ClusterConfig) -> dict[str, Any]:
    """Everything the router's container is given, as plain data (pure)."""
    return {
        "name": router.CONTAINER_NAME,
        "image": router.IMAGE,
        # The published image has no ENTRYPOINT (vllm-project/router Dockerfile.router): the
        # command is the whole argv, `vllm-router` first.
        "command": router.command(cluster),
        # Host networking, like nginx and vLLM: it binds loopback, which only this host reaches,
        # and no docker NAT rule bypasses the host firewall.
        "network_mode": "host",
        "restart": "unless-stopped",
        "labels": [{"label": tags.CONTAINER_ROLE_LABEL, "value": tags.ROUTER_CONTAINER}],
    }


@dataclass(frozen=True)
class RouterArgs:
    cluster: ClusterConfig
    provider: docker.Provider  # the load-balancer node's
    # The hosts' setup, nginx's files (which name the router) and every replica's health gate.
    depends_on: list[pulumi.Resource] = field(default_factory=list)


class Router(pulumi.ComponentResource):
    """The router's image and container on the load-balancer node.

    Every input given here but `restart` is ForceNew in the docker provider (tooling/changes/
    rules.py cites kreuzwerker/terraform-provider-docker): a new router image, a replica added or
    removed (its `--worker-urls`) or new thresholds replace the container. Its name and loopback
    port are fixed, so the old one goes first (pulumi-docker's docker_container is
    DeleteBeforeReplace, provider/resources.go); meanwhile nginx sends to the replicas directly
    (render/nginx.py router_server), and the rollout's admin calls find no router and go on."""

    def __init__(self, name: str, args: RouterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:Router", name, None, opts)
        self.spec = spec = container_spec(args.cluster)
        on_host = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=args.depends_on)
        self.image = docker.RemoteImage(f"{name}-image", name=spec["image"], keep_locally=True, opts=on_host)
        self.container = docker.Container(
            f"{name}-router",
            name=spec["name"],
            image=self.image.name,  # the pinned tag; the Output orders the pull first
            command=spec["command"],
            network_mode=spec["network_mode"],
            restart=spec["restart"],
            labels=[docker.ContainerLabelArgs(**label) for label in spec["labels"]],
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                depends_on=args.depends_on,
                delete_before_replace=True,
            ),
        )
        self.register_outputs({"container": self.container.id})
