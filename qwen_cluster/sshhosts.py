"""How the program reaches a bare-metal host over SSH, as plain data: which hosts have no pinned
host key, OpenSSH's options that pin one, and the docker provider's `ssh://` host and options.
No Pulumi: components/baremetal/connection.py registers with these, and the lab and
`scripts/hostkeys.py` pin keys the same way."""

from __future__ import annotations

from collections.abc import Mapping

from qwen_cluster.config import ClusterConfig, Node

MISSING_KEY = (
    "qwen-cluster:sshPrivateKey is not set and no SSH agent is running (SSH_AUTH_SOCK). Set it with "
    "`pulumi config set --secret qwen-cluster:sshPrivateKey < ~/.ssh/id_ed25519`, or load the key "
    "into ssh-agent."
)


def missing_credentials(ssh_private_key: object, environ: Mapping[str, str]) -> str | None:
    """Why nothing could authenticate (no key in the stack and no agent), or None."""
    if ssh_private_key is None and not environ.get("SSH_AUTH_SOCK"):
        return MISSING_KEY
    return None


def unverified_hosts(cluster: ClusterConfig) -> list[str]:
    """The hosts pulumi would reach without checking who answers: pulumi-command accepts any
    host key when `connection.hostKey` is unset (provider/pkg/provider/remote/connection.go:
    ssh.InsecureIgnoreHostKey), and the docker provider's ssh then has none to pin."""
    bare_metal = cluster.bare_metal
    names = [node.name for node in cluster.nodes if node.name not in bare_metal.host_keys]
    if bare_metal.bastion is not None and not bare_metal.bastion.host_key:
        names.append(f"the bastion {bare_metal.bastion.host}")
    return names


def unverified_hosts_refusal(cluster: ClusterConfig) -> str | None:
    """Why `pulumi up` refuses this stack's unverified hosts, or None when every host is pinned
    or the stack accepts unverified hosts explicitly."""
    missing = unverified_hosts(cluster)
    if not missing or cluster.bare_metal.allow_unverified_hosts:
        return None
    return (
        f"bareMetal.hostKeys pins no host key for {', '.join(missing)}: pulumi would connect "
        "without checking who answers. Pin them with `scripts/hostkeys.py <stack> --write` (it asks "
        "each host, as ssh-keyscan does, and writes bareMetal.hostKeys), or accept unverified hosts "
        "explicitly with bareMetal.allowUnverifiedHosts: true"
    )


def known_host_options(host: str, port: int, key: str) -> list[str]:
    """Pin `key` for `host` without touching ~/.ssh/known_hosts: OpenSSH (8.5+) asks
    KnownHostsCommand for the known-hosts line, and a mismatch refuses the connection."""
    name = host if port == 22 else f"[{host}]:{port}"
    return ["-o", "StrictHostKeyChecking=yes", "-o", f"KnownHostsCommand=/bin/echo {name} {key}"]


def docker_host(cluster: ClusterConfig, node: Node) -> tuple[str, list[str]]:
    """`ssh://user@ip` and ssh options for pulumi-docker, which runs the system `ssh`: it takes
    the key from ssh-agent or ~/.ssh/config, never from the stack config. Pinned host keys are
    handed to ssh directly, for the node and for the bastion."""
    bare_metal = cluster.bare_metal
    options = ["-o", "BatchMode=yes"]
    if node.name in bare_metal.host_keys:
        options += known_host_options(str(node.ip), 22, bare_metal.host_keys[node.name])
    if bare_metal.bastion is not None:
        bastion = bare_metal.bastion
        user = bastion.user or bare_metal.ssh_user
        if bastion.host_key:
            # -J does not pass -o options on to the jump connection; a ProxyCommand does.
            pinned = " ".join(
                f'"{option}"' if " " in option else option
                for option in known_host_options(bastion.host, bastion.port, bastion.host_key)
            )
            options += [
                "-o",
                f"ProxyCommand=ssh -o BatchMode=yes {pinned} -p {bastion.port} -W %h:%p "
                f"{user}@{bastion.host}",
            ]
        else:
            options += ["-J", f"{user}@{bastion.host}:{bastion.port}"]
    return f"ssh://{bare_metal.ssh_user}@{node.ip}", options
