"""Per-host setup over SSH: preflight -> sysctl -> rdma -> firewall -> selinux."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
from pulumi_command import remote

from components.baremetal import connection
from qwen_cluster.config import ClusterConfig, Node
from qwen_cluster.render import firewall, preflight, privilege, rdma, selinux, sysctl


@dataclass(frozen=True)
class Step:
    name: str
    create: str
    delete: str | None
    # Who the step is for: the `triggers`. A change here replaces the step (revert, then apply);
    # any other change (the script) updates it in place.
    identity: tuple[str, ...]
    # Replace create-before-delete: the new step is applied before the old one is reverted.
    create_before_delete: bool = False
    # Run as the SSH user before `create` runs as root (privilege.as_root).
    first_as_user: str = ""


def steps_for(cluster: ClusterConfig, node: Node) -> list[Step]:
    """The rendered scripts of one host, in order (pure: no resources)."""
    flavour = cluster.bare_metal.firewall
    rules = firewall.host_rules(cluster, node.name)
    address = str(node.ip)
    # No lock-out: the address this deploy's SSH arrives from (or the bastion's) must stay
    # admitted by the new rules. Checked as the user (sshd's SSH_CONNECTION): at preflight, so
    # that nothing changes on day 0 (against adminCidrs and the segment), and by the firewall
    # step itself against its exact rules, which a day-2 change runs without preflight.
    preflight_admits = firewall.preflight_sources(cluster)
    admitted = firewall.deployer_check(cluster, node.name, firewall.ssh_sources(rules))
    return [
        # First on every host, and first as the user: what it lacks is said before anything
        # changes (every later step depends on this one).
        Step(
            "preflight",
            preflight.for_node(cluster, node.name),
            None,
            (address,),
            first_as_user=privilege.user_checks(node.name, address)
            + "\n"
            + firewall.deployer_check(cluster, node.name, preflight_admits, step="preflight"),
        ),
        Step("sysctl", sysctl.apply_script(cluster.tuning.sysctl), sysctl.revert_script(), (address,)),
        Step("rdma", rdma.apply_script(required=cluster.tuning.rdma), rdma.revert_script(), (address,)),
        Step(
            "firewall",
            # The script carries the rules as data, in the form the policy pack checks
            # (port-exposure, required-paths, node-count): firewall.embedded_documents.
            firewall.apply_script(
                rules,
                flavour,
                node_ip=address,
                document=firewall.policy_document(cluster, node.name, rules),
            ),
            firewall.revert_script(flavour),
            # Another flavour is another firewall: replaced, the new one first. While both
            # filter, a packet must pass both, and both allow the same set, so nothing opens;
            # the old one's revert runs last (the engine deletes a create-before-delete
            # replacement's old resource after every create and update).
            (address, flavour),
            create_before_delete=True,
            first_as_user=admitted,
        ),
        Step(
            "selinux",
            selinux.apply_script(selinux.service_ports(cluster, node.name)),
            selinux.revert_script(),
            (address,),
        ),
    ]


@dataclass(frozen=True)
class HostSetupArgs:
    cluster: ClusterConfig
    node: Node
    connection: remote.ConnectionArgs


class HostSetup(pulumi.ComponentResource):
    """One host's chain of remote commands, changed in place on Day 2.

    pulumi-command replaces a Command only when its `triggers` change: `triggers` is the one
    input tagged replaceOnChanges (pulumi/pulumi-command v1.2.1 provider/pkg/provider/common/
    inputs.go), and since Command implements CustomUpdate, pulumi-go-provider's default diff
    (infer/resource.go `diff`, v1.3.0) marks every other changed input an update. On an update
    Command runs `update`, or `create` when no `update` is given (remote/commandController.go
    `Update`). So `triggers` hold the step's identity (the host's address; the firewall's
    flavour) and a changed script is re-run in place: a node joining or leaving re-applies each
    host's firewall without reverting it first, a sysctl change rewrites the drop-in and
    applies it. A replacement (a new identity) is delete-before-replace, so a step's revert
    never runs after its successor on the same files, except the firewall (see steps_for)."""

    def __init__(self, name: str, args: HostSetupArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("qwen-cluster:baremetal:HostSetup", name, None, opts)
        self.commands: dict[str, remote.Command] = {}
        previous: remote.Command | None = None
        for step in steps_for(args.cluster, args.node):
            command = connection.command(
                f"{name}-{step.name}",
                connection=args.connection,
                create=step.create,
                first_as_user=step.first_as_user,
                delete=step.delete,
                triggers=list(step.identity),
                opts=pulumi.ResourceOptions(
                    parent=self,
                    depends_on=[previous] if previous is not None else None,
                    delete_before_replace=not step.create_before_delete,
                ),
            )
            self.commands[step.name] = command
            previous = command
        self.last = previous
        self.register_outputs({"host": str(args.node.ip), "steps": list(self.commands)})
