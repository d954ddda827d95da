"""doctor: the guide's troubleshooting (telnet a port, ping, route -n) as one command, for
the failures multi-node vLLM clusters really hit (docs/monitoring.md, "The ten failures").

    scripts/doctor.py STACK [--lab] [--json] [--from all|monitoring|hosts] [--bandwidth]
                            [--prometheus URL] [--label LABEL]

Two sources. From monitoring: what the cluster's Prometheus sees (the alert rules rendered from
the stack config). From the hosts: each node runs its verify script (qwen_cluster/render/verify.py
and nodecheck.py: the probe matrix, ping and the path MTU, the node's name, the model server's
environment, /dev/shm, memlock, devices and what NCCL logged), and doctor compares what the
nodes report (MTU, image, model path) across the cluster and each replica.

Each finding names the node (or the pair), the check that failed, what it means for the cluster
and the fix, in the guide's order: connectivity, then latency, then bandwidth.

Which Prometheus: `--prometheus URL`; with `--lab`, the lab's (inside the lab's namespaces);
otherwise the stack's `prometheus` output (`pulumi stack output`, when the CLI is there), else
the address the stack config gives it; with monitoring.tls over https, verified against
monitoring.tls.caCertificate alone, logged in with QWEN_MONITORING_PASSWORD. Which hosts: with
`--lab`, the lab's nodes (root); on bare metal over SSH as bareMetal.sshUser with sudo (the keys
of your ssh agent or config); on AWS the hosts are asked through monitoring only (SSM is not
driven from here).

Exit 0 healthy, 1 with findings, 2 when a source cannot be asked.
`--json` prints {"healthy": bool, "prometheus": url, "findings": [{"step", "check", "severity",
"what", "where", "cause", "fix"}], "notes": [...]}; `where` lists the node names.
"""

from __future__ import annotations

import argparse
import base64
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from qwen_cluster import kvlink
from qwen_cluster.config import ClusterConfig, ConfigError
from qwen_cluster.render import verify
from qwen_cluster.render.monitoring import alerts, containers, prometheus, webconfig
from tooling import stackfile

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
# The guide's troubleshooting order: can the nodes connect, then is it fast enough to answer,
# then is the bandwidth there.
STEPS = ("connectivity", "latency", "bandwidth")


class Unreachable(Exception):
    """Prometheus did not answer, or not with its API."""


@dataclass
class Finding:
    severity: str
    what: str
    where: list[str]
    cause: str
    fix: str
    alert: str = ""  # the alert behind it (not in the JSON)
    step: str = "connectivity"
    check: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "check": self.check or self.alert,
            "severity": self.severity,
            "what": self.what,
            "where": self.where,
            "cause": self.cause,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Check:
    """How a host check's failure reads in the guide's terms. `row`: the issue-26 table's row
    (docs/monitoring.md) it detects, 0 for the guide's own checks."""

    step: str
    severity: str
    cause: str  # what it means for the cluster, and why it happens
    fix: str  # {node} (where the finding was seen from) and {peer} (what it probed) are filled in
    row: int = 0


CHECKS: dict[str, Check] = {
    "ping": Check(
        "connectivity",
        "critical",
        "the node does not answer the other: it is down, its link is cut or a route is missing",
        "ping {peer} from {node}; route -n and ip link on both",
    ),
    "port": Check(
        "connectivity",
        "critical",
        "a port of the table is closed between the two nodes (a host firewall or security group)",
        "telnet the port from {node} to {peer}; ufw status / nft list ruleset on {peer}",
    ),
    "dynamic-port": Check(
        "connectivity",
        "critical",
        "the firewall drops the ports NCCL, Gloo and vLLM pick at random between members: NCCL's "
        "bootstrap hangs ('client socket has timed out after 60s', ActorUnavailableError)",
        "allow all traffic between the members' own addresses on {peer} (the program's rule); "
        "remove the rule that admits only 6000-6100",
        row=8,
    ),
    "hostname": Check(
        "connectivity",
        "warning",
        "the node's name resolves to loopback or another address: Gloo and Ray advertise it and the "
        "other members try to reach 127.0.0.1 (Gloo connectFullMesh failed ... remote=127.0.0.1)",
        "map the hostname to the node address in /etc/hosts on {node} (not 127.0.1.1); the "
        "program's GLOO_SOCKET_IFNAME keeps Gloo on the cluster interface meanwhile",
        row=1,
    ),
    "interface": Check(
        "connectivity",
        "critical",
        "no interface holds the node's configured address",
        "ip -o -4 addr show on {node}; the stack's nodes[].ip must be on the cluster NIC",
    ),
    "container": Check(
        "connectivity",
        "critical",
        "the model server's container cannot be checked on this node (it is not running, or docker "
        "does not answer or tells nothing of it): what the checks of the table look for in it "
        "(interface variables, /dev/shm, memlock, devices, what NCCL logged) is unknown",
        "docker ps -a and docker logs qwen-vllm on {node}; systemctl status docker; pulumi up "
        "starts a model server that is missing",
    ),
    "interface-env": Check(
        "connectivity",
        "critical",
        "NCCL or Gloo on this member is not pinned to the cluster interface (set on another member "
        "only, or naming another NIC): this worker uses another NIC than the head",
        "redeploy the model server on {node} (pulumi up): the program sets NCCL_SOCKET_IFNAME and "
        "GLOO_SOCKET_IFNAME on every member from the one NIC finder",
        row=9,
    ),
    "node-address": Check(
        "connectivity",
        "critical",
        "vLLM and its launcher disagree on the node's address: the placement never completes "
        "('every node should have a unique IP')",
        "VLLM_HOST_IP must be the node address; redeploy the model server on {node}",
        row=2,
    ),
    "mtu": Check(
        "connectivity",
        "critical",
        "a full frame does not cross the path between the two nodes: RDMA and EFA frames are not "
        "fragmented, so NCCL hangs (IBV_WC_LOC_LEN_ERR)",
        "ip link show on both and every switch port between: set one MTU along the path "
        "(ping -M do -s <mtu-28> {peer} from {node} passes when it is fixed)",
        row=7,
    ),
    "foreign-host": Check(
        "connectivity",
        "warning",
        "a host on the cluster's segment that is not a member: the members trust each other by source "
        "address (all traffic between the node IPs), so a host there that claims a member's address "
        "gets what a member gets (docs/security.md, the threat model)",
        "give network.cidr a dedicated segment or VLAN that only the members join; find {peer} "
        "(`ip neigh show {peer}` on {node} gives its MAC, your switch the port) and take it off the "
        "segment",
    ),
    "mtu-skew": Check(
        "connectivity",
        "critical",
        "the members' cluster interfaces have different MTUs: NCCL hangs on the larger frames",
        "ip link set dev <nic> mtu <the cluster's MTU> on {node}, and in its network config",
        row=7,
    ),
    "efa-devices": Check(
        "connectivity",
        "critical",
        "the model server cannot open the RDMA/EFA devices (fi_getinfo() failed): NCCL stays on TCP or hangs",
        "the container needs --device=/dev/infiniband (the program sets it); on AWS check the node "
        "security group's self rules in and out; fi_info -p efa on {node}",
        row=4,
    ),
    "memlock": Check(
        "connectivity",
        "critical",
        "the container's memlock limit is too small to register NCCL's buffers (ibv_reg_mr: Cannot "
        "allocate memory at NCCL init)",
        "run the model server with --ulimit memlock=-1 (the program does); check dockerd's own "
        "LimitMEMLOCK on {node}",
        row=5,
    ),
    "shm": Check(
        "connectivity",
        "critical",
        "the container has docker's 64 MB /dev/shm: NCCL cannot create its shared memory segments",
        "run the model server with --ipc=host (the program does) on {node}",
        row=6,
    ),
    "image-skew": Check(
        "connectivity",
        "critical",
        "the members of a replica run different images: Ray or vLLM refuse to join "
        "('Version mismatch: the cluster was started with Ray X / Python Y')",
        "pulumi up to put model.image on every member; docker inspect on {node}",
        row=10,
    ),
    "image": Check(
        "connectivity",
        "critical",
        "this member runs another image than model.image: with the other members of a replica Ray "
        "or vLLM refuse to join ('Version mismatch: the cluster was started with Ray X / Python Y'), "
        "alone it serves another vLLM than the stack says",
        "pulumi up to put model.image back on {node}; docker inspect qwen-vllm on {node}",
        row=10,
    ),
    "model-path": Check(
        "connectivity",
        "critical",
        "a member of the replica loads another model path than the others",
        "pulumi up to put the same weights on every member of {node}'s replica",
        row=10,
    ),
    "transport-pin": Check(
        "bandwidth",
        "warning",
        "NCCL_NET is not pinned on this member: a missing RDMA/EFA device falls back to TCP sockets silently",
        "redeploy the model server on {node}: the program pins NCCL_NET",
        row=3,
    ),
    "latency": Check(
        "latency",
        "warning",
        "a congested or long path between the nodes (a switch hop, a shaped link, another segment)",
        "ping -c 20 between the two; keep the nodes on one switch (a cluster placement group on AWS)",
    ),
    "transport": Check(
        "bandwidth",
        "warning",
        "NCCL fell back to TCP sockets (NET/Socket): cross-node parallelism works, very slowly",
        "give the container the RDMA devices and memlock (the program does), check ibv_devices / "
        "fi_info -p efa on {node}, then restart the model server",
        row=3,
    ),
    "bandwidth": Check(
        "bandwidth",
        "warning",
        "the link between the nodes carries less than network.minBandwidthGbps (another tenant, a "
        "slower NIC or port, a shaped path)",
        "ethtool on both NICs; iperf3 -P 4 again off-peak; on AWS look at the ENA allowance counters",
    ),
    "kv-events": Check(
        "connectivity",
        "warning",
        "a replica head's KV-event publisher (loadBalancer.routing kv-aware, port row kv-events) does "
        "not accept a connection from the router's node: the router's kv_aware policy gets no events "
        "from that replica and places its prompts as if it held nothing (no request fails)",
        "docker logs qwen-vllm on {peer} (\"Starting ZMQ publisher thread\"); the kv-events row "
        "must stay scope cluster and the host firewall or security group must admit the router's node; "
        "pulumi up",
    ),
    "router": Check(
        "connectivity",
        "warning",
        "vLLM's router (loadBalancer.routing cache-aware) is not running on its node (bare metal: the "
        "load-balancer node; AWS: the master): nginx, or each node's proxy, sends to the replicas "
        "directly, without cache-aware routing (no request fails)",
        "docker logs qwen-router on {node}; it listens only once every replica answers /health "
        "(docs/routing.md); docker start qwen-router, or pulumi up",
    ),
    # serving.mode disaggregated (docs/disaggregation.md): NIXL between the pools.
    "kv-port": Check(
        "connectivity",
        "critical",
        "NIXL's side channel or UCX's data ports are closed between the pools (a host firewall, a "
        "security group): the decode node cannot pull a prompt's KV, and the request fails (HTTP 500, "
        "serving.kvTransfer.loadFailurePolicy fail) or is prefilled again on the decode node "
        "(recompute)",
        "telnet the port from {node} to {peer}; ufw status / nft list ruleset on {peer}: the "
        "kv-side-channel and kv-data rows must admit the other pool's nodes (pulumi up restores them)",
    ),
    "kv-host": Check(
        "connectivity",
        "critical",
        "the address a node's vLLM advertises for its side channel (serving.kvTransfer.sideChannelHosts) "
        "is not reachable from the other pool: every handshake fails ('handshake_failed', KV load "
        "failure) although the node address answers",
        "route the side-channel host from {node} (ip route get <host>), or remove the node from "
        "serving.kvTransfer.sideChannelHosts so its vLLM advertises its node address; pulumi up",
    ),
    "kv-fence": Check(
        "connectivity",
        "warning",
        "NIXL's side channel or UCX's data ports answer a node of the same pool: the host firewall's "
        "drop of its own pool there is missing (nothing fails; NIXL's ports are open wider than the "
        "other pool, which alone needs them)",
        "ufw status numbered / nft list ruleset / firewall-cmd --list-rich-rules on {peer}: the "
        "kv-side-channel and kv-data drops of its own pool must come before the member rule (pulumi "
        "up restores them)",
    ),
    "kv-link": Check(
        "bandwidth",
        "critical",
        "the prefill->decode path carries less than the KV the prefill pool makes (qwen_cluster/kvlink.py): "
        "transfers fall behind, time to first token grows without bound, and reads outlive the prefill "
        "node's 30 s KV lease (QwenKvReadAfterLeaseExpired)",
        "ethtool and ibv_devinfo on {node} and {peer} (is RDMA really used? UCX falls back to TCP "
        "without an error); faster NICs, more decode nodes, or serving.mode aggregated",
    ),
}
UNKNOWN_CHECK = Check("connectivity", "warning", "", "")


def config_findings(cluster: ClusterConfig) -> list[Finding]:
    """What the stack itself says is wrong, before any host is asked: a disaggregated stack whose
    declared link cannot carry the KV its prefill pool makes (kvlink.demand; the policy pack refuses
    it too), or carries it only above kvlink.TRANSFER_SHARE of the prefill time."""
    demand = kvlink.demand(cluster)
    if demand is None or demand.share <= kvlink.TRANSFER_SHARE:
        return []
    pools = [*cluster.serving.prefill.nodes, *cluster.serving.decode.nodes]
    check = CHECKS["kv-link"]
    if demand.carried:
        return [
            Finding(
                "warning",
                f"the KV transfer takes {demand.share:.0%} of the prefill time: {demand.figures()}",
                pools,
                "the transfer is a visible part of every request's time to first token",
                f"links of {demand.advised_gbps:,.0f} Gbit/s per node keep it under "
                f"{kvlink.TRANSFER_SHARE:.0%}, or more decode nodes",
                step=check.step,
                check="kv-link",
            )
        ]
    return [
        Finding(
            check.severity,
            f"the prefill->decode link is below the KV floor: {demand.figures()}",
            pools,
            check.cause,
            f"links of at least {demand.floor_gbps:,.1f} Gbit/s per node (bareMetal.nicSpeedGbps or the "
            "instance type), more decode nodes, or serving.mode aggregated",
            step=check.step,
            check="kv-link",
        )
    ]


Fetch = Callable[[str], Any]  # API path -> the decoded `data` of the answer


# The monitoring password (the stack's secret), from the environment: never a command-line
# argument, which every local user can read in the process list.
PASSWORD_ENV = "QWEN_MONITORING_PASSWORD"


def http_fetch(
    base: str, timeout: float = 5.0, password: str | None = None, ca_certificate: str | None = None
) -> Fetch:
    """Prometheus's API at `base`; with `password`, logged in as the web config's user
    (qwen_cluster/render/monitoring/webconfig.py). Over https it verifies the server against
    `ca_certificate` (PEM text, monitoring.tls.caCertificate) alone, else the system's CAs."""
    context = ssl.create_default_context(cadata=ca_certificate) if ca_certificate else None
    headers = {}
    if password is not None:
        token = base64.b64encode(f"{webconfig.USER}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"

    def fetch(path: str) -> Any:
        url = base.rstrip("/") + path
        try:
            request = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code == 401:
                given = "was refused" if password is not None else f"is not set ({PASSWORD_ENV})"
                raise Unreachable(
                    f"{url}: HTTP 401: Prometheus asks for credentials and the monitoring password {given}"
                ) from None
            raise Unreachable(f"{url}: HTTP {error.code}") from None
        except urllib.error.URLError as error:
            if isinstance(error.reason, ssl.SSLCertVerificationError):
                raise Unreachable(
                    f"{url}: its certificate is not one monitoring.tls.caCertificate issued for this "
                    f"address ({error.reason.verify_message})"
                ) from None
            raise Unreachable(f"{url}: {error.reason}") from None
        except (OSError, ValueError) as error:
            raise Unreachable(f"{url}: {error}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise Unreachable(f"{url}: not a Prometheus API answer")
        return body.get("data")

    return fetch


def _where(alert: alerts.Alert | None, labels: dict[str, str], cluster: ClusterConfig) -> list[str]:
    names = {node.name for node in cluster.nodes}
    keys = alert.where if alert is not None else ("node",)
    found = [labels[key] for key in keys if labels.get(key) in names]
    if alert is not None and not alert.where:  # cluster-wide: every replica head
        found = [head.name for head in cluster.topology.heads]
    return list(dict.fromkeys(found))


def findings(fetch: Fetch, cluster: ClusterConfig) -> list[Finding]:
    """What is wrong now: alerts firing, and rules that are not loaded or fail."""
    known = {alert.name: alert for alert in alerts.alerts(cluster)}
    result: list[Finding] = []
    groups = (fetch("/api/v1/rules") or {}).get("groups", [])
    loaded = {}
    for group in groups:
        for rule in group.get("rules", []):
            if rule.get("type") == "alerting":
                loaded[rule.get("name")] = rule
    missing = sorted(set(known) - set(loaded))
    if missing:
        result.append(
            Finding(
                "critical",
                f"Prometheus has not loaded the alert rules {', '.join(missing)}",
                [cluster.monitoring_node.name] if cluster.monitoring_node else [],
                "its rule file is not the one rendered for this stack, or a reload failed",
                "promtool check rules on the rule file; docker logs qwen-prometheus",
            )
        )
    for name, rule in sorted(loaded.items()):
        if rule.get("health") not in (None, "ok", "unknown"):
            result.append(
                Finding(
                    "warning",
                    f"rule {name} does not evaluate: {rule.get('lastError', '')}",
                    [],
                    "a query error (a changed metric name, a bad expression)",
                    "promtool check rules; query the expression in Prometheus's UI",
                )
            )
    for item in (fetch("/api/v1/alerts") or {}).get("alerts", []):
        if item.get("state") != "firing":
            continue
        labels = item.get("labels", {})
        annotations = item.get("annotations", {})
        alert = known.get(labels.get("alertname", ""))
        result.append(
            Finding(
                labels.get("severity", "warning"),
                annotations.get("summary") or labels.get("alertname", "an alert"),
                _where(alert, labels, cluster),
                annotations.get("cause", ""),
                annotations.get("fix", ""),
                labels.get("alertname", ""),
                step=alert.step if alert is not None else "connectivity",
            )
        )
    return ordered(result)


def ordered(found: list[Finding]) -> list[Finding]:
    """The guide's order (connectivity, latency, bandwidth), the gravest first in each step."""
    return sorted(
        found,
        key=lambda f: (
            STEPS.index(f.step) if f.step in STEPS else 9,
            SEVERITY_ORDER.get(f.severity, 9),
            f.what,
        ),
    )


# ---------------------------------------------------------------- from the hosts

Runner = Callable[[str, str], tuple[int, str]]  # (node, script) -> (exit code, stdout + stderr)
MARK = "qwen|"


def host_script(cluster: ClusterConfig, node_name: str, *, bandwidth: bool, connect_timeout: int) -> str:
    """The node's verify script (its probe rows, its pings and its own checks): what `verify`
    runs at deploy time, without waiting for a model port to come up."""
    options: dict[str, Any] = {"connect_timeout_seconds": connect_timeout}
    if bandwidth:
        options["min_bandwidth_gbps"] = cluster.network.min_bandwidth_gbps
    return verify.for_cluster(cluster, node_name, **options)


def _finding(check_name: str, node: str, peer: str, detail: str) -> Finding:
    check = CHECKS.get(check_name, UNKNOWN_CHECK)
    where = [node] if peer in ("", "-") else [node, peer]
    pair = node if len(where) == 1 else f"{node} -> {peer}"
    return Finding(
        check.severity,
        f"{pair}: {detail}",
        where,
        check.cause,
        check.fix.format(node=node, peer=peer),
        step=check.step,
        check=check_name,
    )



def _skew(cluster: ClusterConfig, facts: dict[str, dict[str, str]], key: str, check: str) -> list[Finding]:
    """Members of a replica (or, for the MTU, of the cluster) whose `key` differs from the rest."""
    result = []
    groups = (
        [[node.name for node in cluster.nodes]]
        if key == "mtu"
        else [[member.name for member in replica.members] for replica in cluster.topology.replicas]
    )
    for group in groups:
        seen = {name: facts[name][key] for name in group if key in facts.get(name, {})}
        if len(set(seen.values())) < 2:
            continue
        # The value of the most members (ties: the first member's, the head) is the cluster's.
        values = list(seen.values())
        usual = max(values, key=lambda value: (values.count(value), -values.index(value)))
        reference = next(name for name, value in seen.items() if value == usual)
        for name, value in seen.items():
            if value != usual:
                finding = _finding(check, name, "-", f"{key} {value}, where {reference} has {usual}")
                finding.where = [name, reference]
                result.append(finding)
    return result


def _foreign_hosts(cluster: ClusterConfig, facts: dict[str, dict[str, str]]) -> list[Finding]:
    """Addresses of network.cidr in the nodes' neighbour tables (nodecheck's `neighbours` fact)
    that are no member's: one finding per host, naming the nodes that saw it. The segment's
    router (any node's default gateway, the `gateway` fact) is expected there and left out."""
    segment = cluster.network.cidr
    members = {str(node.ip) for node in cluster.nodes}
    routers = {facts[name]["gateway"] for name in facts if facts[name].get("gateway")}
    seen_by: dict[str, list[str]] = {}
    for node in cluster.nodes:
        for address in facts.get(node.name, {}).get("neighbours", "").split():
            try:
                inside = ipaddress.ip_address(address) in segment
            except ValueError:
                continue
            if inside and address not in members and address not in routers:
                seen_by.setdefault(address, []).append(node.name)
    result = []
    for address, nodes in sorted(seen_by.items(), key=lambda item: ipaddress.ip_address(item[0])):
        finding = _finding("foreign-host", nodes[0], address, "")
        finding.what = (
            f"{address} is on network.cidr {segment} and is not a member (seen by {', '.join(nodes)})"
        )
        finding.where = nodes
        result.append(finding)
    return result


def host_findings(
    cluster: ClusterConfig,
    run: Runner,
    *,
    bandwidth: bool = False,
    connect_timeout: int = 2,
    workers: int = 8,
) -> tuple[list[Finding], list[str]]:
    """Every node's checks, run at once (`run` reaches the node), and the comparisons across
    nodes. Returns the findings and the notes (`qwen|note` lines; nodecheck writes none: a check
    a node cannot run is a `container` finding)."""
    names = [node.name for node in cluster.nodes]
    scripts = {
        name: host_script(cluster, name, bandwidth=bandwidth, connect_timeout=connect_timeout)
        for name in names
    }
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names)))) as pool:
        answers = dict(zip(names, pool.map(lambda name: run(name, scripts[name]), names), strict=True))
    found: list[Finding] = []
    notes: list[str] = []
    facts: dict[str, dict[str, str]] = {}
    for name, (code, output) in answers.items():
        reported = 0
        for line in output.splitlines():
            if not line.startswith(MARK):
                continue
            parts = line.split("|", 5)
            kind = parts[1] if len(parts) > 1 else ""
            if kind == "finding" and len(parts) == 6:
                found.append(_finding(parts[2], parts[3], parts[4], parts[5]))
                reported += 1
            elif kind == "fact" and len(parts) >= 5:
                facts.setdefault(parts[3], {})[parts[2]] = "|".join(parts[4:])
            elif kind == "note" and len(parts) == 6:
                notes.append(f"{parts[3]}: {parts[5]}")
        if code != 0 and not reported:
            tail = "; ".join(output.strip().splitlines()[-3:])
            found.append(
                Finding(
                    "critical",
                    f"{name}: its checks did not run (exit {code}: {tail})",
                    [name],
                    "doctor could not reach the node or run its script there (SSH, sudo, a missing tool)",
                    f"ssh to {name} and run the verify script by hand",
                    check="host",
                )
            )
    found += _foreign_hosts(cluster, facts)
    found += _skew(cluster, facts, "mtu", "mtu-skew")
    found += _skew(cluster, facts, "image", "image-skew")
    found += _skew(cluster, facts, "model", "model-path")
    return ordered(found), notes


def ssh_runner(cluster: ClusterConfig) -> Runner:
    """Bare metal: the script over SSH as bareMetal.sshUser, run with `sudo -n` (docker needs
    root), with the user's own SSH setup (agent, config, known hosts)."""
    user = cluster.bare_metal.ssh_user

    def run(node: str, text: str) -> tuple[int, str]:
        address = str(next(n.ip for n in cluster.nodes if n.name == node))
        argv = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            f"{user}@{address}",
            # The whole script lands in a file before it runs: nothing it starts reads its text.
            'f=$(mktemp) && cat >"$f" && sudo -n bash "$f"; rc=$?; rm -f "$f"; exit $rc',
        ]
        try:
            done = subprocess.run(argv, input=text, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as error:
            return 255, str(error)
        return done.returncode, done.stdout + done.stderr

    return run


def stack_output_url(stack: str) -> str | None:
    """The `prometheus` stack output, when the Pulumi CLI can tell it."""
    if shutil.which("pulumi") is None:
        return None
    try:
        done = subprocess.run(
            ["pulumi", "stack", "output", "prometheus", "--stack", stack],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    url = done.stdout.strip()
    return url if done.returncode == 0 and url.startswith("http") else None


def configured_url(cluster: ClusterConfig) -> str | None:
    where = cluster.monitoring_node
    if where is None:
        return None
    return f"{containers.scheme(cluster)}://{where.ip}:{prometheus.prometheus_port(cluster)}"


def monitoring_ca(cluster: ClusterConfig) -> str | None:
    """The CA the stack's Prometheus is verified with (monitoring.tls.caCertificate)."""
    return cluster.monitoring.tls.ca_certificate if cluster.monitoring.tls is not None else None


def print_human(
    stack: str, url: str | None, found: list[Finding], notes: list[str], errors: list[str]
) -> None:
    asked = url or "the hosts"
    for error in errors:
        print(f"doctor {stack}: {error}", file=sys.stderr)
    if not found and not errors:
        print(f"doctor {stack}: healthy ({asked}: nothing failing)")
    elif found:
        print(f"doctor {stack}: {len(found)} finding{'s' if len(found) != 1 else ''} ({asked})")
    step = None
    for finding in found:
        if finding.step != step:
            step = finding.step
            print(f"\n== {step}")
        print(f"\n[{finding.severity}] {finding.what}")
        if finding.where:
            print(f"  where: {', '.join(finding.where)}")
        if finding.check:
            print(f"  check: {finding.check}")
        if finding.cause:
            print(f"  cause: {finding.cause}")
        if finding.fix:
            print(f"  fix:   {finding.fix}")
    for note in notes:
        print(f"  (not checked) {note}")


@dataclass(frozen=True)
class Lab:
    """The lab's Prometheus and nodes, reached inside the lab: labkit/cluster/doctor.py passes them (the
    tooling never imports the lab; scripts/doctor.py goes through labkit)."""

    fetch: Callable[[str, str | None], tuple[Fetch, str]]  # (stack, label) -> (fetch, its URL)
    runner: Callable[[str, str | None], tuple[Runner, ClusterConfig]]  # -> (run, what was deployed)


def main(argv: list[str] | None = None, lab: Lab | None = None) -> int:
    parser = argparse.ArgumentParser(prog="doctor.py", description=__doc__.splitlines()[0])
    parser.add_argument("stack", help="a stack name (Pulumi.<stack>.yaml)")
    parser.add_argument("--lab", action="store_true", help="ask the lab's Prometheus and nodes (root)")
    parser.add_argument("--label", help="the lab's label (default: the stack name)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--prometheus", metavar="URL", help="ask this Prometheus")
    parser.add_argument(
        "--from",
        dest="sources",
        choices=("all", "monitoring", "hosts"),
        help="where to look (default: all; monitoring alone with --prometheus)",
    )
    parser.add_argument(
        "--bandwidth", action="store_true", help="also iperf3 every pair (loads the links for seconds)"
    )
    args = parser.parse_args(argv)
    sources = args.sources or ("monitoring" if args.prometheus and not args.lab else "all")
    try:
        cluster = stackfile.load(args.stack)
    except (ConfigError, FileNotFoundError) as error:
        print(f"doctor {args.stack}: cannot read the stack: {error}", file=sys.stderr)
        return 2
    found: list[Finding] = config_findings(cluster)
    notes: list[str] = []
    errors: list[str] = []
    url = None
    if sources in ("all", "monitoring"):
        try:
            if args.prometheus:
                password = os.environ.get(PASSWORD_ENV)
                url = args.prometheus
                fetch = http_fetch(url, password=password, ca_certificate=monitoring_ca(cluster))
            elif args.lab:
                if lab is None:
                    raise Unreachable("--lab needs the lab library: run scripts/doctor.py")
                fetch, url = lab.fetch(args.stack, args.label)
            else:
                url = stack_output_url(args.stack) or configured_url(cluster)
                if url is None:
                    raise Unreachable(
                        f"stack {args.stack} runs no Prometheus (monitoring.prometheus is false)"
                    )
                fetch = http_fetch(
                    url, password=os.environ.get(PASSWORD_ENV), ca_certificate=monitoring_ca(cluster)
                )
            found += findings(fetch, cluster)
        except Unreachable as error:
            errors.append(f"cannot ask Prometheus: {error}")
    if sources in ("all", "hosts"):
        if args.lab:
            if lab is None:
                raise SystemExit("doctor: --lab needs the lab library: run scripts/doctor.py")
            run, cluster = lab.runner(args.stack, args.label)
            from_hosts, notes = host_findings(cluster, run, bandwidth=args.bandwidth, connect_timeout=1)
            found += from_hosts
        elif cluster.bare_metal is not None:
            from_hosts, notes = host_findings(cluster, ssh_runner(cluster), bandwidth=args.bandwidth)
            found += from_hosts
        else:
            notes.append(
                "AWS: the hosts are asked through monitoring only (their alerts); run verify through SSM"
            )
    found = ordered(found)
    if args.json:
        document: dict[str, Any] = {
            "healthy": not found and not errors,
            "prometheus": url,
            "findings": [f.as_json() for f in found],
            "notes": notes,
        }
        if errors:
            document["error"] = "; ".join(errors)
        print(json.dumps(document, indent=2))
    else:
        print_human(args.stack, url, found, notes, errors)
    if errors:
        return 2
    return 1 if found else 0
