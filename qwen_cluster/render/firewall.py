"""Host firewall rules from the port table, rendered for ufw, firewalld or nftables.

Signatures:
    host_rules(cluster: ClusterConfig, node_name: str) -> list[Rule]
        the node's ingress rules as data
    policy_document(cluster: ClusterConfig, node_name: str, rules: list[Rule]) -> dict
        those rules as the host-firewall document the firewall command carries in its triggers,
        the form the policy pack (policies/normalized.py) checks
    apply_script(rules: list[Rule], flavour: str, *, node_ip: str, interface: str | None = None,
                 etc: str = "/etc", state_dir: str = hostpaths.STATE_DIR, persist: bool = True,
                 document: dict | None = None) -> str
    revert_script(flavour: str, *, etc: str = "/etc", state_dir: str = ..., persist: bool = True) -> str
    embedded_documents(script: str) -> list[str]
        the JSON texts of the documents an apply script carries (what the policy pack reads)
    ssh_sources(rules: list[Rule]) -> list[str]
        the sources the rules admit to SSH (adminCidrs, and the other nodes: all traffic)
    deployer_check(cluster: ClusterConfig, node_name: str, rules: list[Rule]) -> str
        POSIX sh, run as the SSH user before anything changes: stops unless the address this
        deploy's SSH connection arrives from stays admitted to SSH by `rules`
    lockout_notices(cluster: ClusterConfig, deployer: str | None = None) -> list[Notice]
        what preview can tell about it offline (the deployer's address, a bastion, a
        documentation range)

Every script allows SSH from adminCidrs before the default deny takes effect, accepts
loopback and established traffic, admits all traffic from the other nodes' exact addresses
(never the whole segment: NCCL uses ports that cannot be pinned, NVIDIA/nccl#388), the
clients ports from the load-balancer node only, the listener from clientCidrs on that node,
monitoring from monitoringCidrs, and denies the rest. With serving.mode disaggregated it first
drops the node's own pool's other members on NIXL's rows (ports.POOL_FENCED_ROWS), ahead of the
member rule, so that only the other pool reaches them: a `deny` Rule, rendered before the
member rule in each flavour's own terms (see `_ufw`, `_nftables_ruleset`, `_rich_rule`).
`interface` defaults to the one that holds `node_ip` (firewalld binds its zone to it); `etc` and
`state_dir` let a lab point the scripts at `/etc/netns/<ns>`-style roots; `persist=False` skips
enabling boot-time services.

Day 2: the same script is the resource's `create` and (pulumi-command runs `create` when no
`update` is given) its update, so it changes a live firewall in place, never revert-then-apply:
nftables replaces its table in one transaction; ufw and firewalld add the new rules first and
remove the stale ones after, and no rule that stays is ever missing in between (see `_ufw`).
At run time `QWEN_STATE_DIR` overrides `state_dir` and `QWEN_PERSIST=no` skips persistence:
the lab's hooks (qwen_cluster/render/shell.py LAB_HOOKS), unset on a real host.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from qwen_cluster import hostpaths
from qwen_cluster.ports import POOL_FENCED_ROWS, SSH_PORT, Exposure, Peer, Target
from qwen_cluster.render.shell import (
    INTERFACE_OF,
    interface_of_function,
    persist_guard,
    quote,
    script,
    state_dir_line,
)
from qwen_cluster.tags import GPU_NODE

FLAVOURS = ("ufw", "firewalld", "nftables")
TAG = "qwen-cluster"
NFT_TABLE = "qwen_cluster"
ZONE = "qwen-cluster"


@dataclass(frozen=True)
class Rule:
    """One ingress rule on a host: `source` (a CIDR, /32 for a host) may reach `ports`
    ("all", "22", "6000-6100") over `protocol` ("all" or "tcp"); with `action` "deny" it may
    not, whatever a later allow says (NIXL's rows from the own pool: every flavour renders the
    denies ahead of the allows)."""

    name: str
    source: str
    ports: str
    protocol: str
    # Why the rule exists (the exposure's description); it opens nothing, so it is not compared.
    description: str = field(default="", compare=False)
    action: str = "allow"  # allow | deny, as ufw spells them

    @property
    def denies(self) -> bool:
        return self.action == "deny"

    @property
    def family(self) -> str:
        return "ipv6" if ipaddress.ip_network(self.source).version == 6 else "ipv4"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# [(cluster, {pool or None (every node): collapsed blocks of its node addresses})]: the last cluster only
_members_cache: list = []


def _other_members(cluster, node, pool: str | None = None) -> list[str]:
    """Every other node's address (of `pool` only, if given), contiguous ones merged into exact
    blocks (.101, .102/31, .104/29 ...): the same addresses, never one more. The whole cluster
    (or pool) is collapsed once per cluster and this node cut out of its block, instead of
    collapsing the others anew for every node (a parse of every address per node). The answer
    is the same: a set of addresses has one cover by the fewest aligned blocks, which
    collapse_addresses returns."""
    if not (_members_cache and _members_cache[0][0] is cluster):
        _members_cache[:] = [(cluster, {})]
    collapsed: dict = _members_cache[0][1]
    if pool not in collapsed:
        names = None if pool is None else set(getattr(cluster.serving, pool).nodes)
        collapsed[pool] = list(
            ipaddress.collapse_addresses(
                ipaddress.ip_network(f"{n.ip}/32") for n in cluster.nodes if names is None or n.name in names
            )
        )
    blocks: list = collapsed[pool]
    own = ipaddress.ip_network(f"{node.ip}/32")
    rest = [block for block in blocks if not own.subnet_of(block)]
    rest += [piece for block in blocks if own.subnet_of(block) for piece in block.address_exclude(own)]
    return [str(block) for block in ipaddress.collapse_addresses(rest)]


def host_rules(cluster, node_name: str) -> list[Rule]:
    """The ingress rules of one node, SSH first. Raises ValueError if SSH would be locked out."""
    node = next(n for n in cluster.nodes if n.name == node_name)
    lb_node = cluster.load_balancer_node
    rules: list[Rule] = []
    exposures: list[Exposure] = cluster.exposures()
    ssh = [e for e in exposures if e.name == "ssh"]
    if not ssh:
        raise ValueError(
            "access.adminCidrs is empty: a default-deny host firewall would lock out SSH, "
            "including pulumi's own connection"
        )
    for exposure in ssh + [e for e in exposures if e.name != "ssh"]:
        ports = "all" if exposure.ports is None else str(exposure.ports)
        if exposure.target is Target.LOAD_BALANCER and (lb_node is None or lb_node.name != node.name):
            continue
        if exposure.node is not None and exposure.node != node.name:
            continue  # a service of one node (Prometheus, Alertmanager) is admitted there only
        if exposure.peer is Peer.NODES:
            # Contiguous members merge into exact blocks: O(log N) rules instead of N - 1. ufw
            # runs once per rule, so this is what keeps a 64-node setup (and the lab's) from
            # crawling.
            sources = _other_members(cluster, node)
        elif exposure.peer is Peer.LOAD_BALANCER:
            sources = [f"{lb_node.ip}/32"] if lb_node is not None and lb_node.name != node.name else []
        else:
            sources = list(exposure.cidrs)
        rules += [
            Rule(exposure.name, source, ports, exposure.protocol, exposure.description) for source in sources
        ]
    # serving.mode disaggregated on bare metal: the node's own pool's other members, dropped on
    # NIXL's rows before the all-traffic member rule admits them (each flavour renders a deny ahead
    # of every allow; see the renderers). Right after SSH, so that ufw also adds them first.
    fenced = cluster.fenced_pool(node.name)
    if fenced is not None:
        same_pool = _other_members(cluster, node, fenced)
        fence = []
        for entry in (e for e in cluster.ports if e.name in POOL_FENCED_ROWS):
            why = (
                f"{entry.name} {entry.port}/tcp dropped from the {fenced} pool's other members: "
                "NIXL goes between the pools only"
            )
            fence += [Rule(entry.name, source, str(entry.port), "tcp", why, "deny") for source in same_pool]
        after_ssh = sum(1 for rule in rules if rule.name == "ssh")
        rules[after_ssh:after_ssh] = fence
    return rules


# --- no lock-out -------------------------------------------------------------------------------
# A default-deny firewall that does not admit the address the deploy connects from drops every
# later SSH connection: the rest of this `pulumi up`, and every later one, cannot reach the host
# (the session applying it survives on conntrack's established state, the next one does not).
# Each host checks it before anything changes, as the SSH user, where sshd's SSH_CONNECTION
# ("client-address client-port server-address server-port", sshd(8) ENVIRONMENT) names the
# client: the deployer, or the bastion when there is one (the jump host opens the connection).
ADMIN_KEY = "access.adminCidrs"
# RFC 5737 and RFC 3849: addresses for documentation, which no deployer holds.
DOCUMENTATION_RANGES = tuple(
    ipaddress.ip_network(cidr)
    for cidr in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")
)


def _admits_ssh(rule: Rule) -> bool:
    if rule.protocol not in ("all", "tcp"):
        return False
    if rule.ports == "all":
        return True
    low, _, high = rule.ports.partition("-")
    return int(low) <= SSH_PORT <= int(high or low)


def ssh_sources(rules: list[Rule]) -> list[str]:
    """The sources `rules` admit to SSH: adminCidrs, and the other nodes (all traffic)."""
    return [rule.source for rule in rules if not rule.denies and _admits_ssh(rule)]


def _admin_cidrs(cluster) -> str:
    return ", ".join(str(cidr) for cidr in cluster.access.admin_cidrs) or "none"


def preflight_sources(cluster) -> list[str]:
    """What preflight admits the deploy from: adminCidrs and the node segment. Not the exact
    member list the firewall step checks, so that a node joining or leaving does not re-run
    every host's preflight; a deployer in the segment but not a member is stopped by the
    firewall step, still before its firewall changes."""
    return [str(cidr) for cidr in cluster.access.admin_cidrs] + [str(cluster.network.cidr)]


def deployer_check(cluster, node_name: str, sources: list[str], *, step: str = "firewall") -> str:
    """POSIX sh for the SSH user's part of a step (privilege.as_root `first_as_user`): exit 1,
    naming access.adminCidrs and the address, unless the deploy connection's client address is
    inside one of `sources` (the firewall step: `ssh_sources(rules)`; preflight:
    `preflight_sources`). IPv4 is compared in awk; IPv6 with python3 where it exists."""
    node = next(n for n in cluster.nodes if n.name == node_name)
    where = f"{step} on {node.name} ({node.ip})"
    sources_text = " ".join(sources)
    admin = _admin_cidrs(cluster)
    return f"""qwen_where={quote(where)}
qwen_from=${{SSH_CONNECTION%% *}}
qwen_in() {{
  case "$1" in
    *:*) command -v python3 >/dev/null 2>&1 || return 2
         python3 -c 'import ipaddress as i, sys; a = sys.argv
sys.exit(0 if i.ip_address(a[1]) in i.ip_network(a[2]) else 1)' "$1" "$2" 2>/dev/null ;;
    *) case "$2" in *:*) return 1 ;; esac
       awk -v a="$1" -v c="$2" '
         function n(ip, p) {{ split(ip, p, "."); return ((p[1] * 256 + p[2]) * 256 + p[3]) * 256 + p[4] }}
         BEGIN {{ split(c, x, "/"); bits = (x[2] == "") ? 32 : x[2]; size = 2 ^ (32 - bits)
                 exit !(int(n(a) / size) == int(n(x[1]) / size)) }}' ;;
  esac
}}
if [ -z "$qwen_from" ]; then
  qwen_say="$qwen_where: SSH_CONNECTION is not set: the deploy connection's address is not"
  echo "$qwen_say checked against {ADMIN_KEY}" >&2
else
  qwen_admitted=no
  qwen_unknown=no
  for qwen_source in {sources_text}; do
    qwen_in "$qwen_from" "$qwen_source"
    case $? in 0) qwen_admitted=yes; break ;; 2) qwen_unknown=yes ;; esac
  done
  if [ "$qwen_admitted" = yes ]; then
    echo "$qwen_where: the deploy connects from $qwen_from, which the new rules admit to SSH"
  elif [ "$qwen_unknown" = yes ]; then
    echo "$qwen_where: cannot compare $qwen_from with {ADMIN_KEY} (no python3 for IPv6): not checked" >&2
  else
    qwen_say="$qwen_where: FAILED: this deploy connects from $qwen_from, which {ADMIN_KEY} ({admin})"
    qwen_say="$qwen_say does not admit to SSH: the new host firewall would lock this deploy, and"
    qwen_say="$qwen_say every later one, out of {node.name}. Add $qwen_from (or your bastion's address)"
    qwen_say="$qwen_say to {ADMIN_KEY}, or deploy from an address inside it. Nothing was changed."
    echo "$qwen_say" >&2
    exit 1
  fi
fi"""


@dataclass(frozen=True)
class Notice:
    """What preview can tell about a lock-out before anything runs; `certain`: it will happen."""

    message: str
    certain: bool


def lockout_notices(cluster, deployer: str | None = None) -> list[Notice]:
    """Offline, where the answer is known: the deploying machine's address (`deployer`, as the
    hosts see it) or the bastion's, against what every host's new rules admit to SSH; or an
    adminCidrs of documentation addresses only, which nobody deploys from."""
    if cluster.bare_metal is None or not cluster.access.admin_cidrs:
        return []
    admin = _admin_cidrs(cluster)
    notices: list[Notice] = []
    bastion = cluster.bare_metal.bastion
    arriving = []
    if bastion is not None:
        with contextlib.suppress(ValueError):  # a name: resolved where it is used, not here
            arriving.append(("bareMetal.bastion.host", ipaddress.ip_address(bastion.host)))
    elif deployer:
        arriving.append(("the deploying machine", ipaddress.ip_address(deployer)))
    for what, address in arriving:
        locked = [
            node.name
            for node in cluster.nodes
            if not any(
                address in ipaddress.ip_network(source)
                for source in ssh_sources(host_rules(cluster, node.name))
            )
        ]
        if locked:
            notices.append(
                Notice(
                    f"{what} {address} is not in {ADMIN_KEY} ({admin}): the new host firewall would lock "
                    f"the deploy out of {', '.join(locked)}; each host stops before changing it. Add "
                    f"{address} to {ADMIN_KEY}",
                    certain=True,
                )
            )
    if not arriving and all(
        any(cidr.subnet_of(doc) for doc in DOCUMENTATION_RANGES if doc.version == cidr.version)
        for cidr in (ipaddress.ip_network(str(c)) for c in cluster.access.admin_cidrs)
    ):
        notices.append(
            Notice(
                f"{ADMIN_KEY} ({admin}) holds only documentation addresses (RFC 5737/3849), which no "
                "deployer holds: set your own (the address the hosts see your SSH come from, or your "
                "bastion's); otherwise each host stops before changing its firewall",
                certain=False,
            )
        )
    return notices


DOCUMENT_SCHEMA = "qwen-cluster/host-firewall@1"


def policy_document(cluster, node_name: str, rules: list[Rule]) -> dict[str, Any]:
    """One host's firewall as the policy pack reads it (`DOCUMENT_SCHEMA`): who the host is, and
    exactly the rules `apply_script` installs: the allows (the default is deny, so nothing else
    opens) and NIXL's denies (`action` "deny", which the pack reads as opening nothing).

        {"schema": "qwen-cluster/host-firewall@1", "host": "master", "address": "192.168.1.100",
         "role": "gpu-node", "nicSpeedGbps": 25, "loadBalancer": true, "listenerPort": 80,
         "rules": [{"action": "allow", "direction": "in", "protocol": "tcp",   # tcp | all
                    "ports": "5000",                                             # null: every port
                    "sources": ["192.168.1.100/32"], "description": "..."}]}
    """
    node = next(n for n in cluster.nodes if n.name == node_name)
    lb_node = cluster.load_balancer_node
    serves_listener = lb_node is not None and lb_node.name == node_name
    return {
        "schema": DOCUMENT_SCHEMA,
        "host": node.name,
        "address": str(node.ip),
        "role": GPU_NODE,  # every bare-metal host is a GPU node
        "nicSpeedGbps": cluster.bare_metal.nic_speed_gbps,
        "loadBalancer": serves_listener,
        "listenerPort": cluster.load_balancer.port if serves_listener else None,
        "rules": [
            {
                "action": rule.action,
                "direction": "in",
                "protocol": rule.protocol,
                "ports": None if rule.ports == "all" else rule.ports,
                "sources": [rule.source],
                "description": rule.description,
            }
            for rule in rules
        ],
    }


# The heredoc that carries the policy document inside an apply script (see `embedded_documents`).
DOCUMENT_HEREDOC = "QWEN_FIREWALL_DOCUMENT"
_EMBEDDED = re.compile(rf"<<'{DOCUMENT_HEREDOC}'\n(.*?)\n{DOCUMENT_HEREDOC}\n", re.DOTALL)


def embedded_documents(text: Any) -> list[str]:
    """The JSON texts of the host-firewall documents an apply script writes (none or one).

    The document used to travel in the command's `triggers`. It changes whenever a node joins
    or leaves, and pulumi-command marks `triggers` replaceOnChanges (provider/pkg/provider/
    common/inputs.go: `Triggers *[]any ... provider:"replaceOnChanges"`), so it made every
    membership change a replacement. It now travels in the script itself, which the script
    also leaves on the host (`$state_dir/firewall.json`), and the policy pack reads it here."""
    if not isinstance(text, str):
        return []
    return _EMBEDDED.findall(text)


def _document_step(document: dict[str, Any] | None) -> str:
    if document is None:
        return ""
    return f"""
# What this host's firewall now allows, as the policy pack reads it ({DOCUMENT_SCHEMA}).
mkdir -p "$state_dir"
cat >"$state_dir/firewall.json" <<'{DOCUMENT_HEREDOC}'
{json.dumps(document, sort_keys=True, separators=(",", ":"))}
{DOCUMENT_HEREDOC}
"""


# ufw matches a packet against its user rules in order, the first match deciding (ufw-user-input),
# and appends what `ufw allow|deny` adds; `ufw prepend` puts a rule first instead, and skips one that
# exists already ("Skipping inserting existing rule": ufw 0.36 frontend.py set_rule with position -1,
# backend_iptables.py set_rule), so a rerun adds nothing. `ufw show added` prints a prepended rule as
# `ufw deny ...`, without the position: that is the form the stale-rule pass compares.
_UFW_PREPEND_DENIES = """
  case "$rule" in "ufw deny "*) rule="ufw prepend ${rule#ufw }" ;; esac  # before the member allows"""


def _ufw(rules: list[Rule]) -> str:
    def command(rule: Rule) -> str:
        where = "" if rule.ports == "all" else f" to any port {rule.ports.replace('-', ':')} proto tcp"
        # ufw's canonical form: `ufw show added` prints a host without /32 (/128), and the
        # stale-rule pass below compares with that text; with the suffix it would delete them all.
        source = rule.source.removesuffix("/32").removesuffix("/128")
        return f"ufw {rule.action} from {source}{where} comment '{TAG}:{rule.name}'"

    wanted = "\n".join(command(rule) for rule in rules)
    ssh = [command(rule) for rule in rules if rule.name == "ssh"]
    prepend = _UFW_PREPEND_DENIES if any(rule.denies for rule in rules) else ""
    return f"""
command -v ufw >/dev/null || {{ echo "firewall: ufw is not installed" >&2; exit 1; }}
mkdir -p "$state_dir"
if [ ! -e "$state_dir/ufw.before" ]; then
  ufw status | head -n1 >"$state_dir/ufw.before"
fi
# SSH from adminCidrs first: the default deny below must never cut this session off.
{chr(10).join(ssh)}
# Each `ufw default` reloads the whole firewall (~2 s): change the policy only if it differs.
grep -qx 'DEFAULT_INPUT_POLICY="DROP"' /etc/default/ufw 2>/dev/null || ufw default deny incoming
grep -qx 'DEFAULT_OUTPUT_POLICY="ACCEPT"' /etc/default/ufw 2>/dev/null || ufw default allow outgoing
wanted=$(cat <<'QWEN_UFW_EOF'
{wanted}
QWEN_UFW_EOF
)
# New rules first. On an active ufw an added rule is appended to the live chain (`-A`), so
# nothing that was open closes while we add (ufw 0.36 backend_iptables.py, set_rule).
while IFS= read -r rule; do
  case "$rule" in *"'{TAG}:ssh'") continue ;; esac  # added above, before the deny{prepend}
  eval "$rule" >/dev/null
done <<<"$wanted"
# Then drop our rules that the config no longer asks for (e.g. a node that left). A delete
# reloads ufw's user rules with `iptables-restore -n` (set_rule -> _reload_user_rules), which
# empties and refills ufw-user-input in one commit: the rules that stay never go missing
# (tests/test_render_firewall.py probes it while a node leaves and another joins).
stale=$(ufw show added | grep -F "comment '{TAG}:" | grep -vxF -- "$wanted" || true)
[ -z "$stale" ] || while IFS= read -r rule; do
  echo "firewall: removing stale rule: $rule"
  eval "ufw delete ${{rule#ufw }}" >/dev/null
done <<<"$stale"
# Loopback and established traffic are accepted by ufw's before.rules. Enabling persists; on an
# active ufw it changes nothing live (ufw-init: "Firewall already started").
ufw --force enable >/dev/null
ufw status verbose
"""


def _nftables_ruleset(rules: list[Rule]) -> str:
    members = [rule.source.removesuffix("/32") for rule in rules if rule.name == "cluster-all"]
    lines, fence = [], []
    for rule in rules:
        if rule.name == "cluster-all":
            continue
        match = "ip6 saddr" if rule.family == "ipv6" else "ip saddr"
        port = "" if rule.ports == "all" else f" tcp dport {rule.ports}"
        verdict = "drop" if rule.denies else "accept"
        line = f'    {match} {rule.source}{port} {verdict} comment "{rule.name}"'
        (fence if rule.denies else lines).append(line)
    # NIXL's rows from the own pool dropped before the member accept: a chain's rules are evaluated
    # in order and a verdict ends it (nft(8), CHAINS / VERDICT STATEMENT).
    if members:
        # All traffic, from the exact member addresses only: NCCL ports cannot be pinned.
        fence.append('    ip saddr @cluster_nodes accept comment "cluster-all"')
    lines[1:1] = fence
    body = "\n".join(lines)
    node_set = (
        f"""  set cluster_nodes {{
    type ipv4_addr
    flags interval
    elements = {{ {", ".join(members)} }}
  }}
"""
        if members
        else ""
    )
    return f"""# Managed by qwen-cluster. Loaded atomically: SSH is allowed with the drop.
table inet {NFT_TABLE}
delete table inet {NFT_TABLE}
table inet {NFT_TABLE} {{
{node_set}  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state established,related accept
    ct state invalid drop
    # Path MTU discovery and neighbour discovery must pass.
    ip protocol icmp icmp type {{ destination-unreachable, time-exceeded, parameter-problem }} accept
    ip6 nexthdr icmpv6 icmpv6 type {{ destination-unreachable, packet-too-big, time-exceeded, \\
parameter-problem, nd-neighbor-solicit, nd-neighbor-advert, nd-router-advert }} accept
{body}
  }}
}}
"""


def _nftables(rules: list[Rule], etc: str, persist: bool) -> str:
    ruleset = _nftables_ruleset(rules)
    persist_step = persist_guard(f"""
# Persist: the distribution's nftables service loads its main file at boot; include ours.
main={quote(etc)}/nftables.conf
[ -e {quote(etc)}/sysconfig/nftables.conf ] && main={quote(etc)}/sysconfig/nftables.conf
include="include \\"$rules_file\\""
touch "$main"
grep -qxF "$include" "$main" || echo "$include" >>"$main"
systemctl enable nftables >/dev/null 2>&1 || echo "firewall: could not enable nftables.service" >&2
""")
    return f"""
command -v nft >/dev/null || {{ echo "firewall: nft is not installed" >&2; exit 1; }}
mkdir -p {quote(etc)}/qwen-cluster "$state_dir"
rules_file={quote(etc)}/qwen-cluster/firewall.nft
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
cat >"$tmp" <<'QWEN_NFT_EOF'
{ruleset.rstrip(chr(10))}
QWEN_NFT_EOF
# Create the table first so the `delete table` line is valid on the first run.
nft add table inet {NFT_TABLE}
nft -c -f "$tmp"
install -m 0600 "$tmp" "$rules_file"
# One transaction: `nft -f` commits the whole file (delete and re-create the table) at once, so
# no packet ever meets a half-loaded table, on the first run or on any later change.
nft -f "$rules_file"
{persist_step if persist else ""}
nft list table inet {NFT_TABLE}
"""


# A deny is a rich rule with a negative priority: firewalld puts those in the zone's `_pre` chain,
# which it jumps to before the rules of priority 0 (the accepts, in `_allow`): the chains in order
# pre, log, deny, allow, post (firewalld src/firewall/core/nftables.py, _rich_rule_chain_suffix and
# the zone's chain list; firewalld.richlanguage(5), "priority"; Red Hat's "Prioritizing rich rules",
# https://docs.redhat.com/en/documentation/red_hat_enterprise_linux/9/html/configuring_firewalls_and_packet_filters/prioritizing-rich-rules).
# At priority 0 a drop would also precede the accepts (in `_deny`), but by firewalld's sorting by
# action, not by anything the rule says. The text is firewalld's own (core/rich.py Rich_Rule.__str__:
# priority before family); both it and the zone file parse with firewalld's reader.
RICH_DENY_PRIORITY = -1


def _rich_rule(rule: Rule) -> str:
    port = "" if rule.ports == "all" else f' port port="{rule.ports}" protocol="tcp"'
    priority = f'priority="{RICH_DENY_PRIORITY}" ' if rule.denies else ""
    verdict = "drop" if rule.denies else "accept"
    return f'rule {priority}family="{rule.family}" source address="{rule.source}"{port} {verdict}'


def _firewalld_zone(rules: list[Rule]) -> str:
    lines = []
    for rule in rules:
        port = "" if rule.ports == "all" else f'<port port="{rule.ports}" protocol="tcp"/>'
        priority = f' priority="{RICH_DENY_PRIORITY}"' if rule.denies else ""
        verdict = "<drop/>" if rule.denies else "<accept/>"
        source = f'<source address="{rule.source}"/>'
        lines.append(f'  <rule family="{rule.family}"{priority}>{source}{port}{verdict}</rule>')
    body = "\n".join(lines)
    return f"""<?xml version="1.0" encoding="utf-8"?>
<!-- Managed by qwen-cluster. target default: everything not accepted below is rejected. -->
<!-- cluster-all admits all traffic from the node IPs: NCCL ports cannot be pinned. -->
<zone target="default">
  <short>{ZONE}</short>
  <description>qwen-cluster nodes: SSH from adminCidrs, cluster members, load balancer</description>
  <interface name="QWEN_IFACE"/>
{body}
</zone>
"""


def _firewalld(rules: list[Rule], etc: str, persist: bool) -> str:
    zone = _firewalld_zone(rules)
    rich = "\n".join(_rich_rule(rule) for rule in rules)
    enable = persist_guard("systemctl enable --now firewalld >/dev/null") if persist else ""
    return f"""
command -v firewall-cmd >/dev/null || {{ echo "firewall: firewalld is not installed" >&2; exit 1; }}
{enable}
mkdir -p {quote(etc)}/firewalld/zones "$state_dir"
zone_file={quote(etc)}/firewalld/zones/{ZONE}.xml
if [ ! -e "$state_dir/firewalld.before" ]; then
  firewall-cmd --get-zone-of-interface="$iface" >"$state_dir/firewalld.before" 2>/dev/null || true
fi
wanted=$(cat <<'QWEN_RICH_EOF'
{rich}
QWEN_RICH_EOF
)
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
sed "s/QWEN_IFACE/$iface/" >"$tmp" <<'QWEN_ZONE_EOF'
{zone.rstrip(chr(10))}
QWEN_ZONE_EOF
install -m 0644 "$tmp" "$zone_file"
firewall-cmd --check-config >/dev/null
if firewall-cmd --get-zones | tr ' ' '\\n' | grep -qx {ZONE}; then
  # The zone is live: change it in place. A reload would flush every zone and set the
  # policy to DROP while it rebuilds (firewalld core/fw.py reload), so established flows
  # and every rule would be gone for that moment. New rich rules first, then the stale ones
  # go (the permanent zone file above already holds the new set for the next boot).
  while IFS= read -r rule; do
    firewall-cmd --zone={ZONE} --add-rich-rule="$rule" >/dev/null
  done <<<"$wanted"
  if [ -e "$state_dir/firewalld.rules" ]; then
    {{ grep -vxF -- "$wanted" "$state_dir/firewalld.rules" || true; }} | while IFS= read -r rule; do
      echo "firewall: removing stale rule: $rule"
      firewall-cmd --zone={ZONE} --remove-rich-rule="$rule" >/dev/null
    done
  fi
else
  # First run: a new zone becomes live only with a reload. It holds the SSH rule already, so
  # the session applying it is never cut off.
  firewall-cmd --reload >/dev/null
fi
printf '%s\\n' "$wanted" >"$state_dir/firewalld.rules"
if [ "$(firewall-cmd --get-zone-of-interface="$iface" 2>/dev/null || true)" != {ZONE} ]; then
  # NetworkManager may hold the interface in another zone.
  firewall-cmd --permanent --zone={ZONE} --change-interface="$iface" >/dev/null
  firewall-cmd --zone={ZONE} --change-interface="$iface" >/dev/null
fi
zone_now=$(firewall-cmd --get-zone-of-interface="$iface" 2>/dev/null || true)
if [ "$zone_now" != {ZONE} ]; then
  echo "firewall: $iface is in zone '$zone_now', not {ZONE}" >&2
  exit 1
fi
firewall-cmd --zone={ZONE} --list-all
"""


def _interface(node_ip: str, interface: str | None) -> str:
    if interface:
        return f"iface={quote(interface)}"
    return f"""node_ip={quote(node_ip)}
{interface_of_function()}
iface=$({INTERFACE_OF} "$node_ip")
if [ -z "$iface" ]; then
  echo "firewall: no interface holds $node_ip" >&2
  exit 1
fi"""


def apply_script(
    rules: list[Rule],
    flavour: str,
    *,
    node_ip: str,
    interface: str | None = None,
    etc: str = "/etc",
    state_dir: str = hostpaths.STATE_DIR,
    persist: bool = True,
    document: dict[str, Any] | None = None,
) -> str:
    if flavour not in FLAVOURS:
        raise ValueError(f"firewall {flavour!r} is not one of {', '.join(FLAVOURS)}")
    if not any(rule.name == "ssh" for rule in rules):
        raise ValueError("no SSH rule: a default-deny host firewall would lock out the session applying it")
    if flavour == "ufw":
        body = _ufw(rules)
    elif flavour == "nftables":
        body = _nftables(rules, etc, persist)
    else:
        body = _interface(node_ip, interface) + "\n" + _firewalld(rules, etc, persist)
    body = state_dir_line(state_dir) + "\n" + body + _document_step(document)
    return script(f"{flavour} host firewall from the port table (default deny incoming)", body)


def revert_script(
    flavour: str, *, etc: str = "/etc", state_dir: str = hostpaths.STATE_DIR, persist: bool = True
) -> str:
    """Remove our rules. ufw/firewalld go back to their state before the first apply (ufw is
    disabled again only if it was inactive then, so SSH is never left behind a deny);
    nftables drops our table, which holds the deny as well."""
    if flavour == "ufw":
        body = f"""
command -v ufw >/dev/null || exit 0
ufw show added | grep -F "comment '{TAG}:" | grep -vF "comment '{TAG}:ssh'" | while IFS= read -r rule; do
  eval "ufw delete ${{rule#ufw }}" >/dev/null
done
if grep -q inactive "$state_dir/ufw.before" 2>/dev/null; then
  ufw --force disable >/dev/null
  ufw show added | grep -F "comment '{TAG}:" | while IFS= read -r rule; do
    eval "ufw delete ${{rule#ufw }}" >/dev/null
  done
else
  echo "firewall: ufw was active before; the SSH rule stays so the host remains reachable"
fi
rm -f "$state_dir/ufw.before" "$state_dir/firewall.json"
"""
    elif flavour == "nftables":
        persist_step = persist_guard(f"""
for main in {quote(etc)}/nftables.conf {quote(etc)}/sysconfig/nftables.conf; do
  [ -e "$main" ] && sed -i '\\|include "{etc}/qwen-cluster/firewall.nft"|d' "$main"
done
""")
        body = f"""
command -v nft >/dev/null || exit 0
nft delete table inet {NFT_TABLE} 2>/dev/null || true
rm -f {quote(etc)}/qwen-cluster/firewall.nft "$state_dir/firewall.json"
{persist_step if persist else ""}
"""
    elif flavour == "firewalld":
        body = f"""
command -v firewall-cmd >/dev/null || exit 0
before=$(cat "$state_dir/firewalld.before" 2>/dev/null || true)
rm -f {quote(etc)}/firewalld/zones/{ZONE}.xml
firewall-cmd --reload >/dev/null
echo "firewall: removed zone {ZONE}; interfaces fall back to ${{before:-the default zone}}"
rm -f "$state_dir/firewalld.before" "$state_dir/firewalld.rules" "$state_dir/firewall.json"
"""
    else:
        raise ValueError(f"firewall {flavour!r} is not one of {', '.join(FLAVOURS)}")
    return script(f"remove the qwen-cluster {flavour} rules", state_dir_line(state_dir) + "\n" + body)
