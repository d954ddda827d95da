"""The lab's one seam to the project's renderers: every text the lab runs comes from here.

The bare-metal target's renderers (components/render/*, issue 4) are the source of truth.
Until they are merged, the functions below marked STAND-IN render the same facts from the
same inputs (cluster.exposures(), the topology, the sysctl drop-in) so that the lab can run;
switching to the project's renderers is a change to this file only.
"""

from __future__ import annotations

import shlex

from components import ports as port_table
from components.config import ClusterConfig
from components.render import sysctl as sysctl_render

SYSCTL_DROPIN = sysctl_render.DROPIN_PATH


def sysctl_script(cluster: ClusterConfig) -> str:
    """Write the drop-in and load it key by key; a key the kernel refuses (e.g. a global
    key inside a network namespace) is reported on stderr, the others still apply.
    STAND-IN for components.render.sysctl's apply script."""
    text = sysctl_render.dropin(cluster.tuning.sysctl)
    return "\n".join(
        [
            "#!/bin/sh",
            "set -u",
            f"mkdir -p {shlex.quote(SYSCTL_DROPIN.rsplit('/', 1)[0])}",
            f"cat > {shlex.quote(SYSCTL_DROPIN)} <<'QWEN_SYSCTL'",
            text.rstrip("\n"),
            "QWEN_SYSCTL",
            "status=0",
            f"sysctl -e -p {shlex.quote(SYSCTL_DROPIN)} || status=$?",
            "exit 0",
            "",
        ]
    )


def _node_ips(cluster: ClusterConfig, node: str) -> list[str]:
    return [str(other.ip) for other in cluster.nodes if other.name != node]


def _rules(cluster: ClusterConfig, node: str) -> list[tuple[str | None, port_table.PortRange | None]]:
    """(source or None for anyone, tcp ports or None for all traffic) this node admits."""
    lb = cluster.load_balancer_node
    admitted: list[tuple[str | None, port_table.PortRange | None]] = []
    for rule in cluster.exposures():
        if rule.target is port_table.Target.LOAD_BALANCER and node != lb.name:
            continue
        if rule.peer is port_table.Peer.NODES:
            admitted += [(ip, None) for ip in _node_ips(cluster, node)]
        elif rule.peer is port_table.Peer.LOAD_BALANCER:
            admitted.append((str(lb.ip), rule.ports))
        else:
            admitted += [(cidr, rule.ports) for cidr in rule.cidrs if ":" not in cidr]
    return admitted


def firewall_script(cluster: ClusterConfig, node: str, *, flavour: str | None = None) -> str:
    """The host firewall of `node` in the stack's flavour (ufw or nftables). STAND-IN for
    components.render.firewall."""
    flavour = flavour or cluster.bare_metal.firewall
    rules = _rules(cluster, node)
    if flavour == "ufw":
        lines = ["#!/bin/sh", "set -eu", "ufw --force reset >/dev/null", "ufw default deny incoming"]
        lines += ["ufw default allow outgoing", "ufw default deny routed"]
        for source, ports in rules:
            if ports is None:
                lines.append(f"ufw allow from {source}")
            else:
                port = str(ports).replace("-", ":")
                lines.append(f"ufw allow from {source} to any port {port} proto tcp")
        lines += ["ufw --force enable", ""]
        return "\n".join(lines)
    if flavour == "nftables":
        return "#!/bin/sh\nset -eu\nnft -f - <<'QWEN_NFT'\n" + nftables_ruleset(rules) + "QWEN_NFT\n"
    raise ValueError(f"firewall flavour {flavour} is not rendered for the lab")


def nftables_ruleset(rules: list[tuple[str | None, port_table.PortRange | None]]) -> str:
    lines = [
        "table inet qwen_cluster",
        "delete table inet qwen_cluster",
        "table inet qwen_cluster {",
        "  chain input {",
        "    type filter hook input priority filter; policy drop;",
        "    ct state established,related accept",
        "    ct state invalid drop",
        '    iifname "lo" accept',
        "    icmp type { echo-request, destination-unreachable, time-exceeded } accept",
    ]
    for source, ports in rules:
        match = f"ip saddr {source}"
        if ports is None:
            lines.append(f"    {match} accept")
        else:
            lines.append(f"    {match} tcp dport {ports} accept")
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def nginx_conf(cluster: ClusterConfig) -> str:
    """The load balancer's server block. STAND-IN for components.render.nginx."""
    topology = cluster.topology
    timeout = cluster.load_balancer.idle_timeout_seconds
    servers = "\n".join(
        f"    server {head.ip}:{topology.model_port} max_fails=1 fail_timeout=2s;" for head in topology.heads
    )
    return f"""upstream qwen_model {{
{servers}
    keepalive 16;
}}
server {{
    listen {cluster.load_balancer.port};
    location / {{
        proxy_pass http://qwen_model;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Real-IP $remote_addr;
        proxy_buffering off;
        proxy_connect_timeout 2s;
        proxy_read_timeout {timeout}s;
        proxy_send_timeout {timeout}s;
        proxy_next_upstream error timeout http_502 http_503;
        proxy_next_upstream_tries 0;
    }}
}}
"""


def verify_script(cluster: ClusterConfig, node: str) -> str | None:
    """Checks run on the node after setup; exit non-zero on a failure. STAND-IN for
    components.render.verify."""
    lines = ["#!/bin/sh", "set -u", "fail=0"]
    for key, value in sorted(cluster.tuning.sysctl.items()):
        lines.append(
            f'got=$(sysctl -n {key} 2>/dev/null || echo unset); [ "$got" = "{value}" ] '
            f'&& echo "ok   sysctl {key}={value}" || echo "warn sysctl {key}=$got (want {value})"'
        )
    if cluster.topology.is_head(node):
        port = cluster.model_port
        lines.append(
            f'ss -ltnH "sport = :{port}" | grep -q . && echo "ok   model port {port} listening" '
            f'|| {{ echo "FAIL model port {port} not listening"; fail=1; }}'
        )
    lines.append('ip route get 8.8.8.8 >/dev/null 2>&1 && echo "note a route leaves the segment" || true')
    lines += ['exit "$fail"', ""]
    return "\n".join(lines)


def preflight_script(cluster: ClusterConfig, node: str) -> str | None:
    """Host checks before setup (NIC speed, GPUs, RDMA); not meaningful on a veth without GPUs."""
    return None
