"""What the lab still renders itself (qwen_cluster/render/*), apart from the program.

`lab up` runs what the program registered (labkit/engine/executor.py). Rendered here only:
the verify script `check` runs with its own vantages, and the rule sets the fault tests
choose (another flavour, the guide's strict rule), with the paths a namespace needs.
"""

from __future__ import annotations

from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import firewall, nginx, sysctl, verify

SYSCTL_DROPIN = sysctl.DROPIN_PATH
INTERFACE = "eth0"  # labkit.cluster.blueprint.MEMBER_IF; repeated to keep this module import-light
NFT_TABLE = firewall.NFT_TABLE


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


def nginx_connect_timeout_seconds() -> int:
    return nginx.CONNECT_TIMEOUT_SECONDS


def verify_script(cluster: ClusterConfig, node: str) -> str:
    # Bandwidth is measured by the lab's own probe (a veth is not a NIC: see check.bandwidth).
    return verify.for_cluster(cluster, node, connect_timeout_seconds=1)
