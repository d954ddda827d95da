"""The rolling model upgrade, in lanes: each replica drained, replaced, healthy, back.

Replica i rolls in lane i mod k, k = rollout.maxUnavailable as a count
(ClusterConfig.rollout_lanes; disaggregated, lanes by pool that never empty one). Per lane, in
topology order (the master's lane first), on the load balancer's host:

    staged  ->  <head>-drain  ->  the replica's containers  ->  <head>-ready  ->  the lane's
    next drain ...

`staged` (RolloutArgs) is every node's staging: no replica leaves the load balancer before what
the change stages is on every node. A pipeline-parallel replica drains as a whole: every
member's container waits for the head's drain, and the gate for all of them.

Why lanes, what runs when (pulumi-command's create and update) and what day 0 costs:
docs/day2.md, "Bare metal" and "Lanes, and a replica that does not come back";
docs/decisions.md, "Changes roll in lanes; day 0 does not wait on them".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
from pulumi_command import remote

from components.baremetal import connection
from components.baremetal.serving import LoadBalancer, ModelServer, replacing_fields
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import nginx, rollout, router


@dataclass(frozen=True)
class RolloutArgs:
    cluster: ClusterConfig
    # By node name; each container waits for its replica's drain (ModelServerArgs.drained), which
    # the caller resolves from `drains` once this component is built.
    servers: dict[str, ModelServer]
    load_balancer: LoadBalancer
    connection: remote.ConnectionArgs  # to the load balancer's host
    setup_done: list[pulumi.Resource]
    # What must be on every node before any replica drains (images and weights staged while
    # the old servers still serve): each lane's first drain depends on all of it.
    staged: Sequence[pulumi.Resource] = ()


def _with(fingerprint: str | pulumi.Output[str], render) -> str | pulumi.Output[str]:
    """A script rendered with the fingerprint, or an Output of it when the fingerprint is one."""
    return fingerprint.apply(render) if isinstance(fingerprint, pulumi.Output) else render(fingerprint)


class Rollout(pulumi.ComponentResource):
    def __init__(self, name: str, args: RolloutArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:Rollout", name, None, opts)
        cluster = args.cluster
        settings = cluster.rollout
        self.drains: dict[str, remote.Command] = {}
        self.gates: dict[str, remote.Command] = {}
        # With vLLM's router the steps also take each replica out of its worker set and back.
        routed = nginx.router_server(cluster) is not None
        ready_of: list[remote.Command] = []  # by replica index
        for replica in cluster.topology.replicas:
            before = cluster.previous_in_lane(replica)
            # The lane's previous gate, or (a lane's first) everything staged.
            waits_for = [ready_of[before]] if before is not None else list(args.staged)
            head = replica.head
            server = (head.ip, cluster.model_port)
            label = f"replica {replica.index} ({head.name})"
            # P/D mode: the router's own health checks take the replica out and back (rollout.py).
            pd_url = ""
            if cluster.disaggregated:
                pd_url = router.worker_url(*router.pd_listener(cluster, head.name))
            specs = [replacing_fields(args.servers[member.name].spec) for member in replica.members]
            tags = [args.servers[m.name].token_tag for m in replica.members if args.servers[m.name].token_tag]
            # With Ray the token is part of what the containers run (their secret `envs`): its
            # digest joins the fingerprint, so a new token drains the replica before replacing it.
            fingerprint: str | pulumi.Output[str] = (
                pulumi.Output.all(*tags).apply(
                    lambda found, specs=specs: rollout.fingerprint([*specs, found])
                )
                if tags
                else rollout.fingerprint(specs)
            )
            after = [args.load_balancer.config, args.load_balancer.container]
            drain = connection.command(
                f"{head.name}{rollout.DRAIN_SUFFIX}",
                connection=args.connection,
                update=_with(
                    fingerprint,
                    lambda fp, server=server, label=label, pd_url=pd_url: rollout.drain_script(
                        server,
                        replica=label,
                        drain_timeout_seconds=settings.drain_timeout_seconds,
                        fingerprint=fp,
                        routed=routed,
                        pd_worker_url=pd_url or None,
                    ),
                ),
                triggers=[head.ip],
                opts=pulumi.ResourceOptions(parent=self, depends_on=[*after, *waits_for]),
            )
            containers = [args.servers[member.name].container for member in replica.members]
            gate = dict(
                replica=label,
                health_timeout_seconds=settings.health_timeout_seconds,
                routed=routed,
                pd_worker_url=pd_url or None,
            )
            ready = connection.command(
                f"{head.name}{rollout.READY_SUFFIX}",
                connection=args.connection,
                create=_with(
                    fingerprint,
                    lambda fp, server=server, gate=gate: rollout.ready_script(
                        server, only_if_down=True, fingerprint=fp, **gate
                    ),
                ),
                update=_with(
                    fingerprint,
                    lambda fp, server=server, gate=gate: rollout.ready_script(
                        server, only_if_down=False, fingerprint=fp, **gate
                    ),
                ),
                delete=rollout.retire_script(
                    server,
                    replica=label,
                    drain_timeout_seconds=settings.drain_timeout_seconds,
                    routed=routed,
                    pd_worker_url=pd_url or None,
                ),
                triggers=[head.ip],
                opts=pulumi.ResourceOptions(parent=self, depends_on=containers),
            )
            self.drains[head.name], self.gates[head.name] = drain, ready
            ready_of.append(ready)
        self.lanes = [[replica.head.name for replica in lane] for lane in cluster.rollout_lanes]
        self.register_outputs({"replicas": list(self.gates), "lanes": self.lanes})
