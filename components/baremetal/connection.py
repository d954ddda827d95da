"""How the program reaches a bare-metal host: SSH connection settings for pulumi-command (from
`bareMetal`; what they hold is computed in qwen_cluster/sshhosts.py), and `command`, the one way a
remote command is registered, which runs its scripts as root (qwen_cluster/render/privilege.py)."""

from __future__ import annotations

import os
from typing import Any

import pulumi
from pulumi_command import remote

from qwen_cluster import sshhosts
from qwen_cluster.config import ClusterConfig, Node
from qwen_cluster.render import privilege


def check_credentials(ssh_private_key: Any, environ: dict[str, str] | None = None) -> None:
    """Fail before registering anything when there is no way to authenticate."""
    message = sshhosts.missing_credentials(ssh_private_key, os.environ if environ is None else environ)
    if message:
        raise pulumi.RunError(message)


def check_host_keys(cluster: ClusterConfig, *, dry_run: bool) -> None:
    """`pulumi up` refuses unverified hosts unless the stack accepts them explicitly; a preview
    says so and goes on (it connects nowhere)."""
    message = sshhosts.unverified_hosts_refusal(cluster)
    if message is None:
        return
    if dry_run:
        pulumi.log.warn(f"{message}. `pulumi up` will refuse to deploy.")
        return
    raise pulumi.RunError(message)


def node_connection(cluster: ClusterConfig, node: Node, ssh_private_key: Any) -> remote.ConnectionArgs:
    """The key stays an Output secret; without one, pulumi-command uses SSH_AUTH_SOCK."""
    bare_metal = cluster.bare_metal
    key = pulumi.Output.secret(ssh_private_key) if ssh_private_key is not None else None
    proxy = None
    if bare_metal.bastion is not None:
        bastion = bare_metal.bastion
        proxy = remote.ProxyConnectionArgs(
            host=bastion.host,
            port=bastion.port,
            user=bastion.user or bare_metal.ssh_user,
            private_key=key,
            host_key=bastion.host_key,
        )
    return remote.ConnectionArgs(
        host=str(node.ip),
        user=bare_metal.ssh_user,
        private_key=key,
        host_key=bare_metal.host_keys.get(node.name),
        proxy=proxy,
        dial_error_limit=10,
    )


def command(
    name: str,
    *,
    connection: remote.ConnectionArgs,
    create: str | pulumi.Output[str] | None = None,
    update: str | pulumi.Output[str] | None = None,
    delete: str | pulumi.Output[str] | None = None,
    first_as_user: str = "",
    **kwargs: Any,
) -> remote.Command:
    """A `command:remote:Command` whose scripts run as root, whoever `bareMetal.sshUser` is:
    every bare-metal step goes through here, so elevation is decided once. `first_as_user`
    runs before `create`, as the SSH user itself (preflight's checks of that user)."""
    return remote.Command(
        name,
        connection=connection,
        create=_as_root(create, first_as_user=first_as_user),
        update=_as_root(update),
        delete=_as_root(delete),
        **kwargs,
    )


def _as_root(script: str | pulumi.Output[str] | None, first_as_user: str = "") -> Any:
    """privilege.as_root over a script, or over an Output of one (a script that carries a value
    known only once another input resolves, such as the rollout's fingerprint with Ray)."""
    if isinstance(script, pulumi.Output):
        return script.apply(lambda text: privilege.as_root(text, first_as_user=first_as_user))
    return privilege.as_root(script, first_as_user=first_as_user) if script else None


def barrier(
    name: str,
    *,
    connection: remote.ConnectionArgs,
    after: list[pulumi.Resource],
    opts: pulumi.ResourceOptions | None = None,
) -> remote.Command:
    """One resource that waits for many, so that many can wait for one: N resources depending
    on a barrier of M are N + M dependency edges, not N x M, and the SDK checks each edge for a
    cycle (pulumi/runtime/rpc.py `_add_dependency`) by walking what it reaches.

    A command without scripts does nothing and never connects: pulumi-command's Create returns
    before running anything when `create` is unset, Update runs `update` or else `create`,
    Delete runs only a `delete` (provider/pkg/provider/remote/commandController.go). Its only
    input is the connection (the host it would use, never dialled): the dependency edges are not
    inputs. The engine diffs inputs alone (pulumi/pulumi pkg/resource/deploy/step_generator.go
    `diff`: the provider reference, then the provider's Diff of old and new inputs) and ripples
    a replacement only through property dependencies (`calculateDependentReplacements`), never
    through dependsOn. So a node joining or leaving adds or removes an edge and the barrier stays
    `same`: nothing downstream re-runs or is replaced because of it, and the program still
    registers what waits on the barrier only once every resource behind it has finished.

    A component resource is no aggregate here: the SDK expands a dependency on a local component
    into a dependency on each of its children (`_add_dependency`), N x M edges again."""
    merged = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=after))
    return command(name, connection=connection, opts=merged)
