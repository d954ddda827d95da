"""The network verification script: a probe matrix, latency and (optionally) bandwidth.

Signatures:
    Probe(source, source_ip, dest, dest_ip, name, port, expect)   expect: service|reachable|closed
    Pair(source, source_ip, dest, dest_ip)                         ping (and iperf3) pair
    cluster_probes(cluster: ClusterConfig, source: str | None = None) -> list[Probe]
                                                                   every node (or source) to every other node
    cluster_pairs(cluster: ClusterConfig, source: str | None = None) -> list[Pair]
    apply_script(probes: list[Probe], pairs: list[Pair], *, max_latency_ms: float,
                 min_bandwidth_gbps: float | None = None, iperf_port: int = 5201,
                 connect_timeout_seconds: int = 2, service_wait_seconds: int = 0) -> str
    for_cluster(cluster: ClusterConfig, node_name: str | None = None, **options) -> str

The script runs the rows whose source address is local (a node's script holds only its own
rows, `for_cluster(cluster, node)`; a script of several sources runs its local ones), prints the
matrix and exits 1 naming the failing pairs. A TCP probe ends `open` (connected), `refused`
(RST: the firewall let it through, nothing listens) or `filtered` (timeout, or the ICMP reject
firewalld sends). `service` must be open, `reachable` open or refused, `closed` filtered.
`min_bandwidth_gbps` turns on iperf3 against `iperf3 -s -p <iperf_port>` on each peer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from qwen_cluster import kvlink
from qwen_cluster import ports as port_table
from qwen_cluster.ports import SSH_PORT
from qwen_cluster.render import nodecheck
from qwen_cluster.render.shell import MAX_ARG_STRLEN, script

PINGS = 5  # per pair; the median of the replies is held to maxLatencyMs
# NCCL, Gloo and vLLM's cross-node queues bind port 0 (NVIDIA/nccl#388: NCCL cannot be pinned to
# a range), so the kernel picks from net.ipv4.ip_local_port_range, 32768-60999 by default
# (Documentation/networking/ip-sysctl.rst). Its first port is probed (one row per peer: a node's
# script stays within sshd's argument limit at 256 nodes): a firewall that admits only the
# table's range between members hangs NCCL's bootstrap ("client socket has timed out").
DYNAMIC_PORTS = (32768,)
# iperf3 streams per pair: one TCP stream is bound by one core and one flow's hash; NCCL opens
# several sockets per peer (NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS) and so does this.
IPERF_STREAMS = 4
IPERF_SECONDS = 3  # how long each pair is measured (iperf3 -t)

EXPECTATIONS = ("service", "reachable", "closed")


@dataclass(frozen=True)
class Probe:
    source: str
    source_ip: str
    dest: str
    dest_ip: str
    name: str
    port: int
    expect: str

    def __post_init__(self) -> None:
        if self.expect not in EXPECTATIONS:
            raise ValueError(f"probe expect {self.expect!r} is not one of {EXPECTATIONS}")


@dataclass(frozen=True)
class Pair:
    source: str
    source_ip: str
    dest: str
    dest_ip: str


def cluster_pairs(cluster, source: str | None = None) -> list[Pair]:
    """Every ordered pair of nodes (`source`: only those from that node)."""
    return [
        Pair(a.name, str(a.ip), b.name, str(b.ip))
        for a in cluster.nodes
        if source is None or a.name == source
        for b in cluster.nodes
        if a.name != b.name
    ]


def _checks_of(cluster, dest: str, fenced: str | None = "reachable") -> list[tuple[str, int, str]]:
    """(name, port, expect) of what another node probes on `dest`: SSH, both ends of every
    table range (the all-traffic rule admits members), the model port on a replica head and
    the listener on the LB node as services. The same from every source, but for NIXL's rows
    (ports.POOL_FENCED_ROWS), which expect `fenced` (`_fenced_expect`; None: not probed)."""
    model_port = cluster.model_port
    head = cluster.topology.is_head(dest)
    checks = [("ssh", SSH_PORT, "service")]
    for entry in cluster.ports:
        fenced_row = entry.name in port_table.POOL_FENCED_ROWS
        if fenced_row and fenced is None:
            continue
        for port in sorted({entry.port.low, entry.port.high}):
            expect = "service" if port == model_port and head else "reachable"
            checks.append((entry.name, port, fenced if fenced_row else expect))
    checks += [("dynamic", port, "reachable") for port in DYNAMIC_PORTS]
    lb_node = cluster.load_balancer_node
    if lb_node is not None and lb_node.name == dest:
        checks.append(("listener", cluster.load_balancer.port, "service"))
    return checks


def _fenced_expect(cluster, source: str, dest: str) -> str | None:
    """What `source` expects of NIXL's rows on `dest` (ports.POOL_FENCED_ROWS): `reachable` where
    it reaches them (another pool, or no fence: ports.fenced); else `closed` from the member of
    dest's pool just before it in serving.<pool>.nodes (a ring: each host's drop is probed by one
    member of its pool), and None (not probed) from the rest of the pool. A closed port costs the
    whole connect timeout and a node probes one port after another: all of its pool would cost
    3 ports x 2 s per member, over 12 minutes per node at 256 nodes."""
    if not port_table.fenced(cluster.fenced_pool(source), cluster.fenced_pool(dest)):
        return "reachable"
    if not (_ring_cache and _ring_cache[0][0] is cluster):
        pools = (getattr(cluster.serving, pool).nodes for pool in ("prefill", "decode"))
        _ring_cache[:] = [(cluster, {node: nodes[i - 1] for nodes in pools for i, node in enumerate(nodes)})]
    return "closed" if _ring_cache[0][1][dest] == source else None


_ring_cache: list = []  # [(cluster, {node: the node before it in its pool})]: the last cluster only


def cluster_probes(cluster, source: str | None = None) -> list[Probe]:
    """From each node (`source`: that node) to each other node (`_checks_of`). What must be
    closed to non-members is probed by the lab, from its outsiders; NIXL's rows, closed within a
    pool on bare metal, by one member of the pool (`_fenced_expect`)."""
    checks: dict[tuple[str, str | None], list] = {}

    def checks_of(dest: str, fenced: str | None) -> list:
        if (dest, fenced) not in checks:
            checks[dest, fenced] = _checks_of(cluster, dest, fenced)
        return checks[dest, fenced]

    return [
        Probe(pair.source, pair.source_ip, pair.dest, pair.dest_ip, name, port, expect)
        for pair in cluster_pairs(cluster, source)
        for name, port, expect in checks_of(pair.dest, _fenced_expect(cluster, pair.source, pair.dest))
    ] + [
        Probe(node.name, str(node.ip), *check)
        for node in cluster.nodes
        if source is None or node.name == source
        for check in _kv_host_checks(cluster, node.name)
    ]


def _kv_host_checks(cluster, source: str) -> list[tuple[str, str, str, int, str]]:
    """serving.mode disaggregated: (dest, host, name, port, expect) of the side channel of each node
    of the other pool whose advertised host is not its node address
    (serving.kvTransfer.sideChannelHosts): the address vLLM tells `source` to connect to."""
    if not cluster.disaggregated:
        return []
    pool = cluster.serving.pool_of(source)
    port = port_table.port_of(cluster.ports, port_table.KV_SIDE_CHANNEL)
    return [
        (node.name, cluster.kv_side_channel_host(node), "kv-side-channel-host", port, "reachable")
        for node in cluster.nodes
        if cluster.serving.pool_of(node.name) != pool and cluster.kv_side_channel_host(node) != str(node.ip)
    ]


def _kv_options(cluster, node_name: str | None, options: dict) -> dict:
    """The verify script's P/D options (`_script`): this node's pool and the KV link floor."""
    if not cluster.disaggregated or node_name is None:
        return {}
    demand = kvlink.demand(cluster)
    return {
        "kv_pool": cluster.serving.pool_of(node_name),
        "kv_floor_gbps": demand.floor_gbps if demand is not None else None,
    }


def _rows(items: list, row) -> str:
    lines = []
    for (source, source_ip), group in itertools.groupby(
        items, key=lambda item: (item.source, item.source_ip)
    ):
        lines.append(f"@{source}|{source_ip}")
        lines += [row(item) for item in group]
    return "\n".join(lines)


def _probe_row(probe: Probe) -> str:
    return f"{probe.dest}|{probe.dest_ip}|{probe.name}|{probe.port}|{probe.expect}"


def _pair_row(pair: Pair) -> str:
    return f"{pair.dest}|{pair.dest_ip}"


def apply_script(probes: list[Probe], pairs: list[Pair], **options) -> str:
    """The script of these rows; `node_section` (nodecheck.section) runs after them."""
    # A row names its source once per run of rows from it (`@source|ip`): a node's script
    # stays within the one argument sshd passes to bash (shell.MAX_ARG_STRLEN).
    return _script(_rows(probes, _probe_row), _rows(pairs, _pair_row), **options)


def _script(
    probe_rows: str,
    pair_rows: str,
    *,
    max_latency_ms: float,
    min_bandwidth_gbps: float | None = None,
    iperf_port: int = 5201,
    connect_timeout_seconds: int = 2,
    service_wait_seconds: int = 0,
    node_section: str = "",
    kv_pool: str | None = None,
    kv_floor_gbps: float | None = None,
) -> str:
    """`kv_pool`: serving.mode disaggregated, this node's pool (pair rows then name the peer's):
    NIXL's ports report as `kv-port` (as `kv-fence` where they must be closed, within a pool), a
    side-channel host as `kv-host`, and with `min_bandwidth_gbps` a link to the other pool below
    `kv_floor_gbps` (kvlink) as `kv-link`."""
    bandwidth = "" if min_bandwidth_gbps is None else f"{min_bandwidth_gbps:g}"
    kv_checks = (
        '\n      case "$name:$expect" in kv-side-channel-host:*) check=kv-host ;;'
        " kv-*:closed) check=kv-fence ;; kv-*) check=kv-port ;; esac"
        if kv_pool
        else ""
    )
    pair_fields = "dst dst_ip dst_pool" if kv_pool else "dst dst_ip"
    kv_link = (
        f"""
      if [ -n "$dst_pool" ] && [ "$dst_pool" != {kv_pool} ] \\
        && awk -v g="$gbps" -v m={kv_floor_gbps:.1f} 'BEGIN {{exit !(g < m)}}'; then
        report kv-link "$src" "$dst" \\
          "iperf3 ({IPERF_STREAMS} streams): $gbps Gbit/s to the $dst_pool pool is below the" \\
          "KV link floor {kv_floor_gbps:.1f} Gbit/s"
      fi"""
        if kv_pool and kv_floor_gbps
        else ""
    )
    iperf = f"-t {IPERF_SECONDS} -P {IPERF_STREAMS}"
    body = f"""
connect_timeout={connect_timeout_seconds}
service_wait={service_wait_seconds}
max_latency_ms={max_latency_ms:g}
min_bandwidth_gbps={bandwidth}
iperf_port={iperf_port}
local_ips=$(ip -o addr show | awk '{{split($4, a, "/"); print a[1]}}')
failures=()

is_local() {{ grep -qxF -- "$1" <<<"$local_ips"; }}

# report CHECK NODE PEER DETAIL: a failure, for people and (the qwen| line) for doctor.
report() {{
  local where=$2 detail="${{*:4}}"
  if [ "$3" != - ]; then where="$2->$3"; fi
  failures+=("$where $detail")
  echo "qwen|finding|$1|$2|$3|$detail"
}}
# warn CHECK NODE PEER DETAIL: a risk the rendered settings already cover (doctor reports it;
# the deploy goes on).
warn() {{
  echo "qwen|finding|$1|$2|$3|${{*:4}}"
  echo "verify: warning: $2 ${{*:4}}" >&2
}}

# open | refused | filtered; $3: the seconds to wait (default connect_timeout)
probe() {{
  local err wait=${{3:-$connect_timeout}}
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  if err=$(timeout "$wait" bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>&1 </dev/null); then
    echo open
  elif [[ $err == *refused* ]]; then
    echo refused
  else
    echo filtered
  fi
}}

printf '%-14s %-14s %-16s %6s %-10s %-9s %s\\n' source dest name port expect got result
here=no
while IFS='|' read -r dst dst_ip name port expect; do
  [ -n "$dst" ] || continue
  if [[ $dst == @* ]]; then  # the rows that follow are from this source
    src=${{dst#@}} src_ip=$dst_ip here=no
    if is_local "$src_ip"; then here=yes; fi
    continue
  fi
  [ "$here" = yes ] || continue
  deadline=$((SECONDS + service_wait))
  while :; do
    got=$(probe "$dst_ip" "$port")
    # A port that must answer and did not, asked once more with three times the time: the timeout
    # also covers starting the probing bash, and on a busy host that alone took over a second.
    # Only a failure pays it; a closed port (expected to time out) is asked once.
    if [ "$expect" != closed ] && [ "$got" = filtered ]; then
      got=$(probe "$dst_ip" "$port" $((connect_timeout * 3)))
    fi
    if [ "$expect" != service ] || [ "$got" = open ] || [ "$SECONDS" -ge "$deadline" ]; then
      break
    fi
    sleep 5
  done
  case "$expect:$got" in
    service:open | reachable:open | reachable:refused | closed:filtered) result=ok ;;
    *)
      result=FAIL
      check=port
      if [ "$name" = dynamic ]; then check=dynamic-port; fi{kv_checks}
      report "$check" "$src" "$dst" "$name $port/tcp: expected $expect, got $got"
      ;;
  esac
  printf '%-14s %-14s %-16s %6s %-10s %-9s %s\\n' "$src" "$dst" "$name" "$port" "$expect" "$got" "$result"
done <<'QWEN_PROBES_EOF'
{probe_rows}
QWEN_PROBES_EOF

echo
printf '%-14s %-14s %12s %s\\n' source dest "rtt ms" result
here=no
while IFS='|' read -r {pair_fields}; do
  [ -n "$dst" ] || continue
  if [[ $dst == @* ]]; then
    src=${{dst#@}} src_ip=$dst_ip here=no
    if is_local "$src_ip"; then here=yes; fi
    continue
  fi
  [ "$here" = yes ] || continue
  # The median of the replies to {PINGS} pings: one late reply (the first packet waiting for
  # ARP, a busy scheduler on either host) does not decide it, as it would the average.
  rtt=$(ping -n -c {PINGS} -i 0.2 -W 1 "$dst_ip" </dev/null 2>/dev/null \\
    | sed -n 's/.* time=\\([0-9.]*\\) *ms.*/\\1/p' | LC_ALL=C sort -n \\
    | awk '{{v[NR] = $1}} END {{if (NR) print v[int((NR + 1) / 2)]}}' || true)
  if [ -z "$rtt" ]; then
    result=FAIL; report ping "$src" "$dst" "ping: no reply"
  elif awk -v r="$rtt" -v m="$max_latency_ms" 'BEGIN {{exit !(r > m)}}'; then
    result=FAIL; report latency "$src" "$dst" "ping: median RTT $rtt ms is above maxLatencyMs $max_latency_ms"
  else
    result=ok
  fi
  printf '%-14s %-14s %12s %s\\n' "$src" "$dst" "${{rtt:--}}" "$result"
  # The path carries a full frame of this node's MTU, unfragmented (NCCL's IB/RoCE and EFA
  # frames do not fragment: a smaller MTU on the way hangs them, IBV_WC_LOC_LEN_ERR).
  dev=$(ip -o route get "$dst_ip" 2>/dev/null | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p' || true)
  mtu=$(cat "/sys/class/net/$dev/mtu" 2>/dev/null || true)
  if [ -n "$rtt" ] && [ -n "$mtu" ] \\
    && ! ping -n -c 2 -i 0.2 -W 1 -M "do" -s $((mtu - 28)) "$dst_ip" </dev/null >/dev/null 2>&1; then
    report mtu "$src" "$dst" "ping: no reply to an unfragmentable $mtu-byte ping" \\
      "(ping -M do -s $((mtu - 28))): the path MTU is below $mtu"
  fi
  if [ -n "$min_bandwidth_gbps" ]; then
    bps=$(iperf3 -c "$dst_ip" -p "$iperf_port" {iperf} -J </dev/null 2>/dev/null \\
      | grep -o '"bits_per_second":[[:space:]]*[0-9.e+]*' | tail -n1 | grep -o '[0-9.e+]*$' || true)
    if [ -z "$bps" ]; then
      report bandwidth "$src" "$dst" "iperf3: no result (is iperf3 -s -p $iperf_port running on $dst?)"
      echo "  bandwidth: no result"
    else
      gbps=$(awk -v b="$bps" 'BEGIN {{printf "%.2f", b / 1e9}}')
      echo "  bandwidth: $gbps Gbit/s"
      if awk -v g="$gbps" -v m="$min_bandwidth_gbps" 'BEGIN {{exit !(g < m)}}'; then
        report bandwidth "$src" "$dst" \\
          "iperf3 ({IPERF_STREAMS} streams): $gbps Gbit/s is below minBandwidthGbps $min_bandwidth_gbps"
      fi{kv_link}
    fi
  fi
done <<'QWEN_PAIRS_EOF'
{pair_rows}
QWEN_PAIRS_EOF
{node_section}
if [ "${{#failures[@]}}" -gt 0 ]; then
  echo
  echo "verify: ${{#failures[@]}} failing:" >&2
  printf '  %s\\n' "${{failures[@]}}" >&2
  exit 1
fi
echo "verify: all checks passed"
"""
    return script("network verification: probe matrix, latency, bandwidth", body)


def for_cluster(cluster, node_name: str | None = None, **options) -> str:
    """The verify script of `node_name`: its own rows only. A script is the command string
    sshd hands to `bash -c`, one argument, which Linux caps at 128 KiB (MAX_ARG_STRLEN):
    the whole cluster's matrix in every node's script passed that at 17 nodes, one node's
    rows stay under it to beyond 256 (tests/test_render_scripts.py). None: every row."""
    latency = cluster.network.max_latency_ms
    if node_name is None:
        rows = (_rows(cluster_probes(cluster), _probe_row), _rows(cluster_pairs(cluster), _pair_row))
    else:
        rows = _own_rows(cluster, node_name)
    if node_name is not None:
        options.setdefault("node_section", nodecheck.section(cluster, node_name))
    options = {**_kv_options(cluster, node_name, options), **options}
    text = _script(*rows, max_latency_ms=latency, **options)
    if node_name is not None and len(text.encode()) >= MAX_ARG_STRLEN:
        raise ValueError(
            f"the verify script of {node_name} is {len(text.encode())} bytes, over the "
            f"{MAX_ARG_STRLEN} that sshd can pass to bash in one argument: this many nodes "
            f"({len(cluster.nodes)}) needs the probe table delivered another way"
        )
    return text


_rows_cache: list = []  # [(cluster, {dest: (probe rows, pair row)})]: the last cluster only


def _own_rows(cluster, source: str) -> tuple[str, str]:
    """`source`'s probe and pair rows, as apply_script writes them for cluster_probes(cluster,
    source) and cluster_pairs(cluster, source): each destination's rows are the same from every
    source, so they are written once per cluster and joined per node, not written again for
    every node (N x N rows)."""
    if not (_rows_cache and _rows_cache[0][0] is cluster):
        rows = {}
        # NIXL's rows expect one of these, by source (_fenced_expect); only fenced pools need more
        # than the first.
        any_fenced = any(cluster.fenced_pool(n.name) for n in cluster.nodes)
        expects = ("reachable", "closed", None) if any_fenced else ("reachable",)
        for dest in cluster.nodes:
            address = str(dest.ip)
            probe_rows = {
                fenced: "\n".join(
                    f"{dest.name}|{address}|{name}|{port}|{expect}"
                    for name, port, expect in _checks_of(cluster, dest.name, fenced)
                )
                for fenced in expects
            }
            pool = f"|{cluster.serving.pool_of(dest.name)}" if cluster.disaggregated else ""
            rows[dest.name] = (probe_rows, f"{dest.name}|{address}{pool}")
        _rows_cache[:] = [(cluster, rows)]
    rows = _rows_cache[0][1]
    node = next(n for n in cluster.nodes if n.name == source)
    others = [
        (probes[_fenced_expect(cluster, source, n.name) if len(probes) > 1 else "reachable"], pair)
        for n in cluster.nodes
        if n.name != source
        for probes, pair in [rows[n.name]]
    ]
    if not others:
        return "", ""
    header = f"@{source}|{node.ip}"
    kv_hosts = ["|".join(map(str, check)) for check in _kv_host_checks(cluster, source)]
    return (
        "\n".join([header, *(probe for probe, _ in others), *kv_hosts]),
        "\n".join([header, *(pair for _, pair in others)]),
    )
