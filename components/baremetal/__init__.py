"""The bare-metal target: hosts configured over SSH, vLLM and nginx as containers.

    build(cluster: ClusterConfig, ssh_private_key: Output[str] | None,
          secrets: EndpointSecrets | None = None, *,
          ray_auth_token: Output[str] | None = None) -> dict[str, Any]

Registers one `qwen-cluster:baremetal:Cluster` with, per node, a HostSetup chain and a
ModelServer; nginx (LoadBalancer) on bareMetal.loadBalancerNode; the Rollout chain that
starts (and on Day 2 replaces) the model containers in rollout.maxUnavailable lanes; and the verify
commands, the master's last of all. What waits for every host, or for everything, waits for one
barrier command (`connection.barrier`), so the dependency edges grow linearly with the nodes.
Returns the stack outputs.
"""

from __future__ import annotations

from typing import Any

import pulumi

from components.baremetal import connection
from components.baremetal import monitoring as node_monitoring
from components.baremetal.host import HostSetup, HostSetupArgs
from components.baremetal.rollout import Rollout, RolloutArgs
from components.baremetal.router import Router, RouterArgs
from components.baremetal.serving import LoadBalancer, LoadBalancerArgs, ModelServer, ModelServerArgs
from qwen_cluster import sshhosts
from qwen_cluster.config import ClusterConfig, EndpointSecrets
from qwen_cluster.render import router, verify
from qwen_cluster.render.monitoring import containers as monitoring_containers


class Cluster(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        cluster: ClusterConfig,
        ssh_private_key: Any,
        secrets: EndpointSecrets | None = None,
        ray_auth_token: Any = None,
        opts=None,
    ):
        super().__init__("qwen-cluster:baremetal:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.hosts: dict[str, HostSetup] = {}
        self.servers: dict[str, ModelServer] = {}
        connections = {n.name: connection.node_connection(cluster, n, ssh_private_key) for n in cluster.nodes}
        for node in cluster.nodes:
            self.hosts[node.name] = HostSetup(
                node.name, HostSetupArgs(cluster, node, connections[node.name]), opts=child
            )
        lb_node = cluster.load_balancer_node
        # Containers start once every host's firewall and tuning are in place: NCCL needs the
        # whole cluster reachable, not just its own host. They wait for one barrier that waits
        # for every host (connection.barrier): 2N dependency edges, not N x N.
        self.set_up = connection.barrier(
            "cluster-set-up",
            connection=connections[lb_node.name],
            after=[host.last for host in self.hosts.values()],
            opts=child,
        )
        setup_done: list[pulumi.Resource] = [self.set_up]
        # Each model container waits for its replica's drain, which the Rollout below registers
        # after the servers (a drain waits for every node's staging): one deferred Input per
        # replica, resolved once the Rollout is built.
        drained = {replica.head.name: pulumi.deferred_output() for replica in cluster.topology.replicas}
        head_of = {m.name: r.head.name for r in cluster.topology.replicas for m in r.members}
        for node in cluster.nodes:
            docker_host, ssh_opts = sshhosts.docker_host(cluster, node)
            self.servers[node.name] = ModelServer(
                f"{node.name}-model",
                ModelServerArgs(
                    cluster,
                    node,
                    docker_host,
                    ssh_opts,
                    connections[node.name],
                    setup_done,
                    ray_auth_token,
                    drained=drained[head_of[node.name]][0],
                ),
                opts=child,
            )
        # Every node's staging (image and weights). Each lane's first drain waits for all of them,
        # so no replica leaves the load balancer before every node holds what it will restart
        # into: through one barrier, k + N dependency edges rather than k x N.
        self.stage_resources: dict[str, pulumi.Resource] = {
            node_name: server.stage for node_name, server in self.servers.items()
        }
        self.staged = connection.barrier(
            "cluster-staged",
            connection=connections[lb_node.name],
            after=list(self.stage_resources.values()),
            opts=child,
        )
        self.monitoring = _monitoring(
            cluster, self.servers, connections, setup_done, child, secrets or EndpointSecrets()
        )
        self.load_balancer = LoadBalancer(
            "load-balancer",
            LoadBalancerArgs(
                cluster,
                self.servers[lb_node.name].provider,
                connections[lb_node.name],
                setup_done,
                secrets or EndpointSecrets(),
            ),
            opts=child,
        )
        # The model containers start through the rollout lanes: in each lane one replica after
        # another, drained before its containers are replaced and healthy before the next starts.
        try:
            self.rollout = Rollout(
                "rollout",
                RolloutArgs(
                    cluster,
                    self.servers,
                    self.load_balancer,
                    connections[lb_node.name],
                    setup_done,
                    staged=[self.staged],
                ),
                opts=child,
            )
        except BaseException as error:
            # The containers would wait for their drains forever, and the SDK for them.
            for _, resolve in drained.values():
                resolve(pulumi.Output.from_input(_raise(error)))
            raise
        for head, (_, resolve) in drained.items():
            resolve(pulumi.Output.from_input(self.rollout.drains[head]))
        # vLLM's router behind nginx (loadBalancer.routing cache-aware), on the same host, after
        # every replica's gate: it listens only once every worker of its command line answers
        # /health (measured, docs/routing.md), so it starts (or, replaced, restarts) last. The
        # rollout's scripts find it at run time and pass over a router that is not running.
        self.router: Router | None = None
        if router.needs_router(cluster):
            args = RouterArgs(
                cluster,
                self.servers[lb_node.name].provider,
                [*setup_done, self.load_balancer.config, *self.rollout.gates.values()],
            )
            self.router = Router("router", args, opts=child)
        # Every check runs once everything is started: one barrier again, not N x N edges.
        self.started = connection.barrier(
            "cluster-started",
            connection=connections[lb_node.name],
            after=[
                *setup_done,
                *(s.container for s in self.servers.values()),
                self.load_balancer.container,
                *([self.router.container] if self.router else []),
                *self.rollout.gates.values(),
            ],
            opts=child,
        )

        def script(node_name: str) -> str:
            # vLLM loads Qwen3-32B's weights before it answers; the verify step waits for a model
            # port as long as the rollout waits for a replica's health (one bound, one key).
            return verify.for_cluster(
                cluster, node_name, service_wait_seconds=cluster.rollout.health_timeout_seconds
            )

        worker_checks = [
            connection.command(
                f"{node.name}-verify",
                connection=connections[node.name],
                create=script(node.name),
                triggers=[str(node.ip)],  # identity only: a changed script re-runs as an update
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.started]),
            )
            for node in cluster.nodes
            if node.name != cluster.master.name
        ]
        # The final check, on the master, after everything including the other nodes' checks.
        self.verify = connection.command(
            f"{cluster.master.name}-verify",
            connection=connections[cluster.master.name],
            create=script(cluster.master.name),
            triggers=[str(cluster.master.ip)],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.started, *worker_checks]),
        )
        self.register_outputs({"verify": self.verify.stdout})


async def _raise(error: BaseException) -> pulumi.Resource:
    raise error


def _monitoring(
    cluster, servers, connections, setup_done, child, secrets: EndpointSecrets
) -> list[pulumi.ComponentResource]:
    """The monitoring pieces (components/baremetal/monitoring.py), beside the model servers."""
    built: list[pulumi.ComponentResource] = []
    if cluster.monitoring.exporters:
        for node in cluster.nodes:
            args = node_monitoring.NodeMonitoringArgs(cluster, node, servers[node.name].provider, setup_done)
            built.append(node_monitoring.NodeMonitoring(f"{node.name}-monitoring", args, opts=child))
    if (where := cluster.monitoring_node) is not None:
        args = node_monitoring.ClusterMonitoringArgs(
            cluster,
            servers[where.name].provider,
            connections[where.name],
            setup_done,
            password=secrets.monitoring_password,
            tls_certificate=secrets.monitoring_tls_certificate,
            tls_private_key=secrets.monitoring_tls_private_key,
        )
        built.append(node_monitoring.ClusterMonitoring("monitoring", args, opts=child))
    return built


def build(
    cluster: ClusterConfig,
    ssh_private_key: Any,
    secrets: EndpointSecrets | None = None,
    *,
    ray_auth_token: Any = None,
) -> dict[str, Any]:
    connection.check_credentials(ssh_private_key)
    connection.check_host_keys(cluster, dry_run=pulumi.runtime.is_dry_run())
    built = Cluster("bare-metal", cluster, ssh_private_key, secrets, ray_auth_token)
    lb_node = cluster.load_balancer_node
    settings = cluster.rollout
    scheme = "https" if cluster.load_balancer.tls else "http"
    return {
        "endpoint": f"{scheme}://{lb_node.ip}:{cluster.load_balancer.port}",
        "loadBalancerNode": lb_node.name,
        "modelServers": [f"{head.ip}:{cluster.model_port}" for head in cluster.topology.heads],
        "firewall": cluster.bare_metal.firewall,
        "hosts": {name: str(node.ip) for name, node in ((n.name, n) for n in cluster.nodes)},
        "verify": built.verify.stdout,
        "rollout": {
            "maxUnavailable": cluster.max_unavailable,
            "lanes": built.rollout.lanes,
            "staged": [stage.urn for stage in built.stage_resources.values()],
            # The longest one replica holds its lane: its drain's and its gate's deadlines.
            "replicaBoundSeconds": settings.drain_timeout_seconds + settings.health_timeout_seconds,
            "drainTimeoutSeconds": settings.drain_timeout_seconds,
            "healthTimeoutSeconds": settings.health_timeout_seconds,
        },
        **monitoring_containers.stack_outputs(cluster),
    }
