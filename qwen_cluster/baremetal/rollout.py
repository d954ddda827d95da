"""The rolling model upgrade: one replica at a time, drained, replaced, healthy, back.

Per replica, in topology order (the master's first), on the load balancer's host:

    <head>-drain  ->  the replica's containers  ->  <head>-ready  ->  next replica's drain ...

Pulumi does the ordering: each step `depends_on` the one before, and the engine starts a
resource only when what it depends on has finished (the SDK registers it once their
RegisterResource calls have answered, which the engine does when their steps are done). A
`ready` that fails (no /health within rollout.healthTimeoutSeconds) fails the update there:
what depends on it never starts, so the replicas after it keep serving the old version.

What runs when (pulumi-command v1.2.1 remote/commandController.go: Create runs `create` and
nothing at all without one; Update runs `update`, or `create` without one; `triggers` alone
replace, common/inputs.go):
- `drain` has no `create`: day 0 and a node that joins cost nothing. Its `update` (out of
  rotation, wait for the streams in flight) carries the fingerprint of the replica's
  containers (their ForceNew inputs), so it runs exactly when one of them will be replaced.
- `ready`: `create` waits for /health only if the server is marked down (a node that joined
  a running cluster: the load balancer's install script lists it down); on day 0 every server
  starts in rotation, so the replicas start and load together. `update` (same fingerprint)
  always waits for /health, then puts the server back. `delete`, when a replica leaves: its
  streams finish before its containers go (deletes run dependents first).

Day 0 cost of the chain: the replicas' containers are created one replica after another
(`docker create` + start over SSH, seconds each; the model loads in the background), plus one
SSH command per replica (`ready`, which finds nothing down). Nothing waits for a model load.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
from pulumi_command import remote

from qwen_cluster.baremetal import connection
from qwen_cluster.baremetal.serving import LoadBalancer, ModelServer, replacing_fields
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import rollout


@dataclass(frozen=True)
class RolloutArgs:
    cluster: ClusterConfig
    servers: dict[str, ModelServer]  # by node name, not started yet
    load_balancer: LoadBalancer
    connection: remote.ConnectionArgs  # to the load balancer's host
    setup_done: list[pulumi.Resource]


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
        previous: pulumi.Resource | None = None
        for replica in cluster.topology.replicas:
            head = replica.head
            server = (head.ip, cluster.model_port)
            label = f"replica {replica.index} ({head.name})"
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
                f"{head.name}-drain",
                connection=args.connection,
                update=_with(
                    fingerprint,
                    lambda fp, server=server, label=label: rollout.drain_script(
                        server,
                        replica=label,
                        drain_timeout_seconds=settings.drain_timeout_seconds,
                        fingerprint=fp,
                    ),
                ),
                triggers=[head.ip],
                opts=pulumi.ResourceOptions(
                    parent=self, depends_on=[*after, previous] if previous is not None else after
                ),
            )
            containers = [args.servers[member.name].start([drain]) for member in replica.members]
            gate = dict(replica=label, health_timeout_seconds=settings.health_timeout_seconds)
            ready = connection.command(
                f"{head.name}-ready",
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
                    server, replica=label, drain_timeout_seconds=settings.drain_timeout_seconds
                ),
                triggers=[head.ip],
                opts=pulumi.ResourceOptions(parent=self, depends_on=containers),
            )
            self.drains[head.name], self.gates[head.name] = drain, ready
            previous = ready
        self.last = previous
        self.register_outputs({"replicas": list(self.gates)})
