"""The lab's one seam to the project's renderers (components/render/*): every script and
config the lab runs is rendered here, with the paths a namespace needs and nothing else
changed. A node's files go under its /etc/netns/<ns>/ (ufw and /etc/default via `ip netns
exec`'s bind mounts, the nftables rules file by the `etc` root) and its state under /run.
"""

from __future__ import annotations

from components.config import ClusterConfig
from components.render import firewall, nginx, preflight, sysctl, verify

SYSCTL_DROPIN = sysctl.DROPIN_PATH
INTERFACE = "eth0"  # scripts.labkit.plan.MEMBER_IF; repeated to keep this module import-light
NFT_TABLE = firewall.NFT_TABLE


def sysctl_script(cluster: ClusterConfig) -> str:
    # system=False: apply only our drop-in; re-applying the host's own files inside a
    # namespace is not the lab's business. Global keys come back as namespace-exempt.
    return sysctl.apply_script(cluster.tuning.sysctl, system=False)


def firewall_rules(cluster: ClusterConfig, node: str) -> list[firewall.Rule]:
    return firewall.host_rules(cluster, node)


def firewall_script(
    cluster: ClusterConfig,
    node: str,
    *,
    etc_root: str,
    state_dir: str,
    flavour: str | None = None,
    rules: list[firewall.Rule] | None = None,
) -> str:
    """The node's host firewall in the stack's flavour; `rules` replaces the port table's
    (the fault tests render the guide's strict rule set through the same script)."""
    node_ip = str(next(n.ip for n in cluster.nodes if n.name == node))
    return firewall.apply_script(
        firewall_rules(cluster, node) if rules is None else rules,
        flavour or cluster.bare_metal.firewall,
        node_ip=node_ip,
        interface=INTERFACE,
        etc=etc_root,
        state_dir=state_dir,
        persist=False,  # no boot-time services in a namespace (and no systemd here)
    )


def nginx_conf(cluster: ClusterConfig, *, state_dir: str) -> str:
    # user=None: workers run as nginx's built-in default (nobody); all paths in the lab's state dir.
    return nginx.for_cluster(
        cluster,
        runtime_dir=f"{state_dir}/nginx-temp",
        log_dir=state_dir,
        pid_file=f"{state_dir}/nginx.pid",
        user=None,
    )


def nginx_connect_timeout_seconds() -> int:
    return nginx.CONNECT_TIMEOUT_SECONDS


def verify_script(cluster: ClusterConfig, node: str) -> str:
    # Bandwidth is measured by the lab's own probe (a veth is not a NIC: see check.bandwidth).
    return verify.for_cluster(cluster, connect_timeout_seconds=1)


def preflight_script(cluster: ClusterConfig, node: str) -> str:
    # declared_gbps=None: a veth reports its own nominal speed, not the hosts' NICs;
    # no time-sync check (no timedatectl/chrony inside a namespace of this machine).
    node_ip = str(next(n.ip for n in cluster.nodes if n.name == node))
    return preflight.apply_script(
        node_ip,
        min_bandwidth_gbps=cluster.network.min_bandwidth_gbps,
        declared_gbps=None,
        interface=INTERFACE,
        check_time_sync=False,
    )
