"""Monitoring, rendered from the stack config: every node's :8000 endpoint, the cluster's
Prometheus (scrape config, alert rules) and Alertmanager. Pure: text and data, no Pulumi.

The pieces and why:
- Host: node_exporter (Debian's prometheus-node-exporter, `prom/node-exporter` in a
  container), with its default `infiniband` collector, which reads the EFA devices' counters
  under /sys/class/infiniband as AWS's HyperPod observability stack does, and `netclass`
  for the NIC speed.
- GPUs: NVIDIA's dcgm-exporter, a pinned image run with `--gpus all` (only where the node
  has GPUs), with a counters file that enables `DCGM_EXP_XID_ERRORS_COUNT`: XID errors
  counted over a window by the exporter, not `DCGM_FI_DEV_XID_ERRORS`, the last XID seen,
  which a scrape can miss.
- vLLM: its own `/metrics` on the model port (heads only: a pipeline worker runs Ray).
- Peers: blackbox_exporter probes from this node, ICMP to every other member and TCP
  connect to each member's model port and the pinned inter-node ports that listen there.
- One port: `qwen_cluster/node/nodemetrics.py`, a small stdlib aggregator on :8000 that fetches all
  of the above from loopback and serves them as one `/metrics`, every sample labelled with
  `qwen_source`, and `qwen_source_up{qwen_source}` for each source, so a dead exporter is
  an alert, never a silent gap. exporter_exporter (Debian's prometheus-exporter-exporter)
  was the other candidate; it serves one module per `/proxy?module=` URL and refuses by
  design to merge them ("merging of module outputs into one query ... would break up
  behaviour", its README), so `GET :8000/metrics` could not be the node's metrics and the
  probes of each peer would be one scrape job per peer and port.

One clock: every duration (alert `for:`, rate and XID windows, Alertmanager's grouping) is
written for the default 15 s scrape and scales with `monitoring.scrapeIntervalSeconds` (an
alert waits four scrapes, not a fixed minute). The lab puts that key on its clock like the
thinking pause, and the whole monitoring stack runs at the lab's pace.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlencode

import yaml

from qwen_cluster import ports as port_table

# Pinned: the versions Debian bookworm ships, so the configs promtool and amtool check in
# the tests (Debian's packages) are read by the same versions on the nodes.
NODE_EXPORTER_IMAGE = "prom/node-exporter:v1.5.0"
BLACKBOX_EXPORTER_IMAGE = "prom/blackbox-exporter:v0.23.0"
PROMETHEUS_IMAGE = "prom/prometheus:v2.42.0"
ALERTMANAGER_IMAGE = "prom/alertmanager:v0.25.0"
# NVIDIA's README quick start pins this tag (github.com/NVIDIA/dcgm-exporter).
DCGM_EXPORTER_IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:4.4.2-4.7.1-ubuntu22.04"
# The aggregator is stdlib-only Python; any pinned CPython image runs it.
AGGREGATOR_IMAGE = "python:3.12.7-slim-bookworm"

LOOPBACK = "127.0.0.1"
NODE_EXPORTER_PORT = port_table.MONITORING_LOOPBACK_PORTS["node exporter"]
BLACKBOX_PORT = port_table.MONITORING_LOOPBACK_PORTS["blackbox exporter"]
DCGM_PORT = port_table.MONITORING_LOOPBACK_PORTS["dcgm exporter"]
JOB = "qwen-node"
# Where an XID counts: the exporter's window and the alert's look-back.
XID_WINDOW_SECONDS = 600
KV_CACHE_FULL = 0.95


DEFAULT_SCRAPE_SECONDS = 15


def clock(cluster) -> float:
    """How much faster or slower than the default every monitoring duration runs."""
    return cluster.monitoring.scrape_interval_seconds / DEFAULT_SCRAPE_SECONDS


def duration(seconds: float, scale: float = 1.0) -> str:
    """A Prometheus duration for `seconds` on a clock running at `scale` (at least 100 ms)."""
    millis = max(100, round(seconds * scale * 1000))
    if millis % 60000 == 0:
        return f"{millis // 60000}m"
    if millis % 1000 == 0:
        return f"{millis // 1000}s"
    return f"{millis}ms"


@dataclass(frozen=True)
class Timing:
    """The scrape interval and the timeouts that must fit inside it."""

    scrape: float  # seconds

    @property
    def scrape_timeout(self) -> float:
        return round(self.scrape * 0.8, 3)

    @property
    def probe_timeout(self) -> float:
        """blackbox_exporter's module timeout: a probe of a peer that is gone ends here."""
        return round(min(2.0, self.scrape * 0.4), 3)

    @property
    def fetch_timeout(self) -> float:
        """How long the endpoint waits for each source and probe (all in parallel): longer
        than a probe, so a failed probe arrives as probe_success 0 (not as a silent blackbox),
        and shorter than Prometheus's scrape timeout, so the scrape still succeeds."""
        return round(min(self.probe_timeout + 1.0, self.scrape * 0.7), 3)


def timing(cluster) -> Timing:
    return Timing(scrape=cluster.monitoring.scrape_interval_seconds)


# ---------------------------------------------------------------- the node endpoint


def endpoint_port(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.MONITORING_ENDPOINT)


def prometheus_port(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.PROMETHEUS)


def alertmanager_port(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.ALERTMANAGER)


def listening_ports(cluster, node_name: str) -> list[tuple[str, int]]:
    """(name, port) of what listens on `node_name` for the other members: the model port
    on a replica head; with pipeline parallelism the Ray ports pinned in the cluster range
    (GCS on the head; node and object manager on every member)."""
    topology = cluster.topology
    found: list[tuple[str, int]] = []
    if topology.is_head(node_name):
        found.append(
            (next(e.name for e in cluster.ports if e.scope is port_table.Scope.CLIENTS), cluster.model_port)
        )
    if topology.pipeline_parallel > 1:
        pinned = topology.ports
        if topology.is_head(node_name):
            found.append(("ray-gcs", pinned.gcs))
        found += [("ray-node-manager", pinned.node_manager), ("ray-object-manager", pinned.object_manager)]
    return found


@dataclass(frozen=True)
class Probe:
    peer: str
    peer_ip: str
    module: str  # blackbox module: icmp | tcp_connect
    port: int | None = None
    port_name: str = ""

    def url(self) -> str:
        target = self.peer_ip if self.port is None else f"{self.peer_ip}:{self.port}"
        return f"http://{LOOPBACK}:{BLACKBOX_PORT}/probe?" + urlencode(
            {"module": self.module, "target": target}
        )

    def labels(self) -> dict[str, str]:
        labels = {"peer": self.peer, "peer_ip": self.peer_ip, "module": self.module}
        if self.port is not None:
            labels |= {"port": str(self.port), "port_name": self.port_name}
        return labels


def probes(
    cluster, node_name: str, listening: Mapping[str, list[tuple[str, int]]] | None = None
) -> list[Probe]:
    """From `node_name` to every other member: ICMP, and TCP to what listens there
    (`listening` overrides per peer, e.g. the lab's stand-ins that hold other ports)."""
    result: list[Probe] = []
    for peer in cluster.nodes:
        if peer.name == node_name:
            continue
        ip = str(peer.ip)
        result.append(Probe(peer.name, ip, "icmp"))
        ports = (
            listening[peer.name]
            if listening and peer.name in listening
            else listening_ports(cluster, peer.name)
        )
        result += [Probe(peer.name, ip, "tcp_connect", port, name) for name, port in ports]
    return result


def _aggregator_base(cluster, node_name: str, gpu: bool | None) -> dict:
    node = next(n for n in cluster.nodes if n.name == node_name)
    gpu = cluster.gpus_per_node > 0 if gpu is None else gpu
    times = timing(cluster)
    sources = [{"name": "node", "url": f"http://{LOOPBACK}:{NODE_EXPORTER_PORT}/metrics"}]
    if gpu:
        sources.append({"name": "gpu", "url": f"http://{LOOPBACK}:{DCGM_PORT}/metrics"})
    if cluster.topology.is_head(node_name):
        sources.append({"name": "vllm", "url": f"http://{LOOPBACK}:{cluster.model_port}/metrics"})
    return {
        "node": node_name,
        "node_ip": str(node.ip),
        "listen": f"0.0.0.0:{endpoint_port(cluster)}",
        "timeout": times.fetch_timeout,
        "sources": sources,
    }


def _probe_entry(probe: Probe) -> dict:
    return {"url": probe.url(), "labels": probe.labels()}


def aggregator_config(
    cluster,
    node_name: str,
    *,
    gpu: bool | None = None,
    listening: Mapping[str, list[tuple[str, int]]] | None = None,
) -> dict:
    """What `qwen_cluster/node/nodemetrics.py` on `node_name` fetches and serves on the endpoint port.
    `gpu` defaults to whether the nodes have GPUs (the lab's stand-ins have none)."""
    return {
        **_aggregator_base(cluster, node_name, gpu),
        "probes": [_probe_entry(probe) for probe in probes(cluster, node_name, listening)],
    }


def _dumps(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


_PROBES_SLOT = "__qwen_cluster_probes__"
_peer_entries_cache: list = []  # [(cluster, {peer name: [entry text, ...]})]: the last cluster only


def _peer_entries(cluster) -> dict[str, list[str]]:
    """Every peer's probe entries as aggregator_json writes them inside "probes" (indented
    two levels), encoded once per cluster: a peer is probed the same way from every node."""
    if _peer_entries_cache and _peer_entries_cache[0][0] is cluster:
        return _peer_entries_cache[0][1]
    entries: dict[str, list[str]] = {node.name: [] for node in cluster.nodes}
    # From a node outside the cluster, every member is a peer.
    for probe in probes(cluster, node_name=""):
        text = json.dumps(_probe_entry(probe), indent=2, sort_keys=True)
        entries[probe.peer].append(text.replace("\n", "\n    ").join(("    ", "")))
    _peer_entries_cache[:] = [(cluster, entries)]
    return entries


def aggregator_json(
    cluster,
    node_name: str,
    *,
    gpu: bool | None = None,
    listening: Mapping[str, list[tuple[str, int]]] | None = None,
) -> str:
    """aggregator_config as the file the endpoint reads: json.dumps(indent=2, sort_keys=True),
    byte for byte (tests/test_monitoring_rules.py holds it). A node probes every other member,
    so at 256 nodes the files hold 65,280 probes; each peer's entries are encoded once per
    cluster and spliced into every node's file instead of encoded again per node."""
    if listening:
        return _dumps(aggregator_config(cluster, node_name, gpu=gpu, listening=listening))
    text = _dumps({**_aggregator_base(cluster, node_name, gpu), "probes": _PROBES_SLOT})
    by_peer = _peer_entries(cluster)
    items = [entry for node in cluster.nodes if node.name != node_name for entry in by_peer[node.name]]
    probes_text = "[\n" + ",\n".join(items) + "\n  ]" if items else "[]"
    return text.replace(json.dumps(_PROBES_SLOT), probes_text, 1)


def blackbox_config(cluster) -> str:
    return _blackbox_yaml(duration(timing(cluster).probe_timeout))


@functools.lru_cache(maxsize=8)  # every node's file is the same: YAML-dumped once, not per node
def _blackbox_yaml(timeout: str) -> str:
    modules = {
        "icmp": {"prober": "icmp", "timeout": timeout, "icmp": {"preferred_ip_protocol": "ip4"}},
        "tcp_connect": {"prober": "tcp", "timeout": timeout, "tcp": {"preferred_ip_protocol": "ip4"}},
    }
    return yaml.safe_dump({"modules": modules}, sort_keys=False)


# Enabled on top of what dcgm-exporter's defaults watch: the windowed XID count the alert
# reads (dcgm-exporter's own field, `--xid-count-window-size`), and the usual health rows.
DCGM_COUNTERS = """\
# DCGM field, Prometheus type, help (dcgm-exporter counters file; rendered by qwen-cluster)
DCGM_FI_DEV_GPU_UTIL, gauge, GPU utilization (in %).
DCGM_FI_DEV_FB_FREE, gauge, Framebuffer memory free (in MiB).
DCGM_FI_DEV_FB_USED, gauge, Framebuffer memory used (in MiB).
DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).
DCGM_FI_DEV_POWER_USAGE, gauge, Power draw (in W).
DCGM_FI_DEV_XID_ERRORS, gauge, Value of the last XID error encountered.
DCGM_EXP_XID_ERRORS_COUNT, gauge, XID errors counted over --xid-count-window-size.
"""


def dcgm_args(counters_path: str) -> list[str]:
    return [
        "-f",
        counters_path,
        "-a",
        f"{LOOPBACK}:{DCGM_PORT}",
        f"--xid-count-window-size={XID_WINDOW_SECONDS * 1000}",
    ]


def node_exporter_args(*, rootfs: str | None = "/host") -> list[str]:
    args = [f"--web.listen-address={LOOPBACK}:{NODE_EXPORTER_PORT}"]
    if rootfs:
        # In a container: the host's filesystem mounted read-only at /host (node_exporter's
        # README, "Docker"); /proc and /sys are read through it.
        args.append(f"--path.rootfs={rootfs}")
    return args


def blackbox_args(config_path: str) -> list[str]:
    return [f"--config.file={config_path}", f"--web.listen-address={LOOPBACK}:{BLACKBOX_PORT}"]


# ---------------------------------------------------------------- Prometheus


def scrape_targets(cluster) -> list[dict]:
    """One static target per node: its endpoint, labelled with what the rules group by."""
    topology = cluster.topology
    port = endpoint_port(cluster)
    targets = []
    for node in cluster.nodes:
        replica = topology.replica_of(node.name)
        targets.append(
            {
                "targets": [f"{node.ip}:{port}"],
                "labels": {
                    "node": node.name,
                    "replica": str(replica.index),
                    "replica_head": replica.head.name,
                    "role": "head" if replica.head.name == node.name else "pipeline-worker",
                },
            }
        )
    return targets


def prometheus_config(cluster, *, rules_path: str = "rules.yml", cluster_name: str = "qwen-cluster") -> str:
    """`rules_path` relative to the config file's directory (Prometheus resolves it there), so
    the pair can be moved together (the lab runs them from its own directory)."""
    times = timing(cluster)
    am_port = alertmanager_port(cluster)
    config = {
        "global": {
            "scrape_interval": duration(times.scrape),
            "scrape_timeout": duration(times.scrape_timeout),
            "evaluation_interval": duration(times.scrape),
            "external_labels": {"cluster": cluster_name},
        },
        "rule_files": [rules_path],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"{LOOPBACK}:{am_port}"]}]}]},
        "scrape_configs": [
            {"job_name": JOB, "static_configs": scrape_targets(cluster)},
            {
                "job_name": "prometheus",
                "static_configs": [{"targets": [f"{LOOPBACK}:{prometheus_port(cluster)}"]}],
            },
            {"job_name": "alertmanager", "static_configs": [{"targets": [f"{LOOPBACK}:{am_port}"]}]},
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def prometheus_args(cluster, *, config_path: str, data_path: str) -> list[str]:
    return [
        f"--config.file={config_path}",
        f"--storage.tsdb.path={data_path}",
        f"--web.listen-address=0.0.0.0:{prometheus_port(cluster)}",
        # SIGHUP or POST /-/reload re-reads the rules: a new alert bound needs no restart.
        "--web.enable-lifecycle",
    ]


def alertmanager_args(cluster, *, config_path: str, data_path: str) -> list[str]:
    return [
        f"--config.file={config_path}",
        f"--storage.path={data_path}",
        f"--web.listen-address=0.0.0.0:{alertmanager_port(cluster)}",
        # One Alertmanager: no gossip listener on 9094 (a port that is in no table).
        "--cluster.listen-address=",
    ]


# ---------------------------------------------------------------- alert rules


@dataclass(frozen=True)
class Alert:
    """One alert: its rule, and how `doctor` tells it in the guide's terms."""

    name: str
    severity: str
    expr: str
    for_seconds: float
    summary: str  # Prometheus template, also what doctor prints as `what`
    cause: str
    fix: str
    where: tuple[str, ...] = ("node",)  # labels naming the node(s)
    labels: dict[str, str] = field(default_factory=dict)


def _budget_seconds(cluster) -> float:
    return cluster.network.max_latency_ms / 1000


def alerts(cluster) -> list[Alert]:
    """The guide's requirements as alerts, bounds from the stack config. `for_seconds` is
    written for the default scrape; `rules` puts it on the cluster's clock."""
    scale = clock(cluster)
    net = cluster.network
    mon = cluster.monitoring
    unreachable_peer = 'label_replace(qwen:peer_reachable == 0, "node", "$1", "peer", "(.*)")'
    rate_window = duration(300, scale)
    return [
        Alert(
            "QwenReplicaDown",
            "critical",
            "qwen:replica_up == 0",
            60,
            "replica {{ $labels.replica }} (head {{ $labels.replica_head }}) is not serving",
            "the model server on {{ $labels.replica_head }} does not answer /metrics, or a member of the "
            "replica cannot be scraped (node down, link cut, container stopped)",
            "check the node (ping, route -n) and its container: docker logs qwen-head",
            where=("replica_head",),
        ),
        Alert(
            "QwenAllReplicasDown",
            "critical",
            "max(qwen:replica_up) == 0",
            60,
            "no replica is serving: the load balancer has no healthy upstream",
            "every model server is down or unreachable",
            "start with the first replica's head: ping it, then docker logs qwen-head",
            where=(),
        ),
        Alert(
            "QwenNodeUnreachable",
            "critical",
            unreachable_peer,
            60,
            "node {{ $labels.node }} does not answer ping from any other member",
            "the node is down, its link is cut, or a route is missing",
            "ping {{ $labels.node }} from another node; check `route -n` and the link (ip link)",
        ),
        Alert(
            "QwenNodeLatencyHigh",
            "warning",
            'max by (node, peer) (probe_icmp_duration_seconds{phase="rtt"})'
            f" > {_budget_seconds(cluster):g}",
            60,
            "latency {{ $labels.node }} to {{ $labels.peer }} is "
            f"{{{{ $value | humanizeDuration }}}}, over network.maxLatencyMs {net.max_latency_ms:g} ms",
            "a congested or long path between the nodes (a switch hop, a shaped link, another segment)",
            "ping -c 20 between the two; keep the nodes on one switch (a cluster placement group on AWS)",
            where=("node", "peer"),
        ),
        Alert(
            "QwenInterNodePortUnreachable",
            "critical",
            'probe_success{module="tcp_connect"} == 0 unless on(peer) (qwen:peer_reachable == 0)',
            60,
            "{{ $labels.node }} cannot connect to {{ $labels.peer }} port {{ $labels.port }} "
            "({{ $labels.port_name }})",
            "a firewall port closed between {{ $labels.node }} and {{ $labels.peer }}, or nothing listens "
            "there (the service on {{ $labels.peer }} is down)",
            "telnet {{ $labels.peer_ip }} {{ $labels.port }} from {{ $labels.node }}; check the host "
            "firewall (ufw status / nft list ruleset) and the security group",
            where=("node", "peer"),
        ),
        Alert(
            "QwenNicBelowFloor",
            "warning",
            "(node_network_speed_bytes * on(instance, device) group_left() qwen_node_nic_info) * 8 / 1e9"
            f" < {net.min_bandwidth_gbps:g}",
            300,
            "NIC {{ $labels.device }} on {{ $labels.node }} runs at {{ $value }} Gbit/s, below "
            f"network.minBandwidthGbps {net.min_bandwidth_gbps:g}",
            "the link negotiated a lower speed (cable, transceiver, switch port) or the wrong NIC carries "
            "the node IP",
            "ethtool {{ $labels.device }}; check the cable and the switch port",
        ),
        Alert(
            "QwenKvCacheFull",
            "warning",
            f"max by (node, replica) (vllm:kv_cache_usage_perc) > {KV_CACHE_FULL:g}",
            300,
            "KV cache on {{ $labels.node }} is {{ $value | humanizePercentage }} full",
            "more concurrent tokens than the replica holds: requests queue and get preempted",
            "add replicas (nodes), lower max_model_len, or raise tensorParallel",
        ),
        Alert(
            "QwenRequestsWaiting",
            "warning",
            f"sum by (node, replica) (vllm:num_requests_waiting) > {mon.max_requests_waiting}",
            120,
            "{{ $value }} requests waiting on {{ $labels.node }}, over monitoring.maxRequestsWaiting "
            f"{mon.max_requests_waiting}",
            "more load than the replicas serve",
            "add replicas, or check that the load balancer spreads requests (every upstream up)",
        ),
        Alert(
            "QwenTtftP99High",
            "warning",
            "histogram_quantile(0.99, sum by (node, replica, le) "
            f"(rate(vllm:time_to_first_token_seconds_bucket[{rate_window}]))) > {mon.max_ttft_p99_seconds:g}",
            300,
            "TTFT p99 on {{ $labels.node }} is {{ $value | humanizeDuration }}, over "
            f"monitoring.maxTtftP99Seconds {mon.max_ttft_p99_seconds:g} s",
            "requests queue before prefill (load, KV cache full) or prompts are very long",
            "look at QwenRequestsWaiting and QwenKvCacheFull on the same node; add replicas",
        ),
        Alert(
            "QwenGpuXidErrors",
            "critical",
            "max by (node, gpu, xid) "
            f"(max_over_time(DCGM_EXP_XID_ERRORS_COUNT[{duration(XID_WINDOW_SECONDS, scale)}])) > 0",
            0,
            "GPU {{ $labels.gpu }} on {{ $labels.node }} reported XID {{ $labels.xid }} "
            "({{ $value }} in the window)",
            "a GPU hardware, driver or application fault (see NVIDIA's XID catalogue)",
            "dmesg | grep -i xid on {{ $labels.node }}; drain the node if it repeats",
        ),
        Alert(
            "QwenMonitoringEndpointDown",
            "warning",
            f'up{{job="{JOB}"}} == 0 unless on(node) {unreachable_peer}',
            60,
            "Prometheus cannot scrape {{ $labels.node }}'s monitoring endpoint ({{ $labels.instance }})",
            "the endpoint container is stopped, or the firewall closes the monitoring port to the "
            "Prometheus node",
            "curl {{ $labels.instance }}/metrics from the Prometheus node; docker logs qwen-nodemetrics",
        ),
        Alert(
            "QwenMonitoringSourceDown",
            "warning",
            "qwen_source_up == 0",
            60,
            "{{ $labels.qwen_source }} metrics on {{ $labels.node }} are missing",
            "that exporter is stopped or not answering on loopback",
            "docker ps on {{ $labels.node }}; restart the {{ $labels.qwen_source }} exporter container",
        ),
    ]


def recording_rules() -> list[dict]:
    return [
        {
            # A member serves when Prometheus scrapes it and, where it runs vLLM, vLLM answers.
            "record": "qwen:member_serving",
            "expr": f'up{{job="{JOB}"}} * on(instance) group_left() qwen_source_up{{qwen_source="vllm"}}'
            f' or up{{job="{JOB}"}}',
        },
        {"record": "qwen:replica_up", "expr": "min by (replica, replica_head) (qwen:member_serving)"},
        # A node is reachable while any other member's ping reaches it.
        {"record": "qwen:peer_reachable", "expr": 'max by (peer) (probe_success{module="icmp"})'},
    ]


def rules(cluster) -> str:
    """The rule file: recording rules, then the alerts."""
    alert_rules = []
    for alert in alerts(cluster):
        rule = {"alert": alert.name, "expr": alert.expr}
        if alert.for_seconds:
            rule["for"] = duration(alert.for_seconds, clock(cluster))
        rule["labels"] = {"severity": alert.severity, **alert.labels}
        rule["annotations"] = {"summary": alert.summary, "cause": alert.cause, "fix": alert.fix}
        alert_rules.append(rule)
    groups = [
        {"name": "qwen-cluster-records", "rules": recording_rules()},
        {"name": "qwen-cluster-alerts", "rules": alert_rules},
    ]
    return yaml.safe_dump({"groups": groups}, sort_keys=False, width=1000)


# ---------------------------------------------------------------- Alertmanager


def alertmanager_config(cluster) -> str:
    scale = clock(cluster)
    receiver: dict = {"name": "default"}
    if cluster.monitoring.webhook_url:
        receiver["webhook_configs"] = [{"url": cluster.monitoring.webhook_url, "send_resolved": True}]
    config = {
        "route": {
            "receiver": "default",
            "group_by": ["alertname", "node", "replica"],
            "group_wait": duration(30, scale),
            "group_interval": duration(300, scale),
            "repeat_interval": "4h",
        },
        "receivers": [receiver],
        "inhibit_rules": [
            {
                # One page for "nothing serves", not one per replica as well.
                "source_matchers": ['alertname="QwenAllReplicasDown"'],
                "target_matchers": ['alertname="QwenReplicaDown"'],
            }
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


# ---------------------------------------------------------------- on the Prometheus node

HOST_CONFIG_DIR = "/etc/qwen-cluster/monitoring"
HOST_DATA_DIR = "/var/lib/qwen-cluster"
CONTAINER_CONFIG_DIR = "/etc/qwen-monitoring"
PROMETHEUS_CONTAINER = "qwen-prometheus"
ALERTMANAGER_CONTAINER = "qwen-alertmanager"
# prom/prometheus and prom/alertmanager run as nobody (their Dockerfiles: USER nobody).
CONTAINER_UID = 65534


def server_files(cluster) -> dict[str, str]:
    """File name (in HOST_CONFIG_DIR, mounted at CONTAINER_CONFIG_DIR) -> text."""
    return {
        "prometheus.yml": prometheus_config(cluster, rules_path="rules.yml"),
        "rules.yml": rules(cluster),
        "alertmanager.yml": alertmanager_config(cluster),
    }


def server_files_script(files: Mapping[str, str], *, config_dir: str = HOST_CONFIG_DIR) -> str:
    """Write the Prometheus/Alertmanager files atomically (temp file + rename in the same
    directory), then ask the running servers to re-read them: SIGHUP reloads Prometheus's
    config and rules and Alertmanager's config in place, no restart, no gap in the data.
    On the first run the containers do not exist yet and read the files when they start."""
    from qwen_cluster.render.shell import quote, script

    writes = []
    for name, text in sorted(files.items()):
        marker = f"QWEN_{name.upper().replace('.', '_')}_EOF"
        writes.append(
            f"cat >{quote(config_dir)}/.{name}.new <<'{marker}'\n{text.rstrip()}\n{marker}\n"
            f"mv -f {quote(config_dir)}/.{name}.new {quote(config_dir)}/{name}\n"
        )
    body = f"""
install -d -m 0755 {quote(config_dir)}
install -d -m 0750 -o {CONTAINER_UID} -g {CONTAINER_UID} {quote(HOST_DATA_DIR + "/prometheus")} \\
  {quote(HOST_DATA_DIR + "/alertmanager")}
{"".join(writes)}chmod 0644 {quote(config_dir)}/*.yml
for name in {PROMETHEUS_CONTAINER} {ALERTMANAGER_CONTAINER}; do
  if docker inspect -f '{{{{.State.Running}}}}' "$name" 2>/dev/null | grep -qx true; then
    docker kill --signal HUP "$name" >/dev/null
    echo "monitoring: $name re-reads its configuration"
  fi
done
"""
    return script("Prometheus and Alertmanager configuration (reloaded in place)", body)


# ---------------------------------------------------------------- the containers, as data

IN_CONTAINER = "/etc/qwen-monitoring"


@dataclass(frozen=True)
class Mount:
    host: str
    container: str
    read_only: bool = False
    propagation: str | None = None


@dataclass(frozen=True)
class ContainerSpec:
    """One monitoring container, for every target: bare metal registers it with the Docker
    provider, AWS runs it with `docker run` from an SSM document. Host network always."""

    role: str  # node-exporter, blackbox-exporter, dcgm-exporter, nodemetrics, prometheus, alertmanager
    name: str  # the container's name on the host
    image: str
    command: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()  # (path in the container, content): uploads
    mounts: tuple[Mount, ...] = ()
    capabilities: tuple[str, ...] = ()
    gpus: bool = False
    pid_host: bool = False


def node_containers(cluster, node_name: str, nodemetrics_source: str) -> list[ContainerSpec]:
    """One node's exporters and its endpoint. `nodemetrics_source` is qwen_cluster/node/nodemetrics.py's
    text (the caller reads it: renderers do no I/O)."""
    blackbox_file = f"{IN_CONTAINER}/blackbox.yml"
    script, config = f"{IN_CONTAINER}/nodemetrics.py", f"{IN_CONTAINER}/nodemetrics.json"
    specs = [
        ContainerSpec(
            "node-exporter",
            "qwen-node-exporter",
            NODE_EXPORTER_IMAGE,
            command=tuple(node_exporter_args(rootfs="/host")),
            # node_exporter's README (Docker): the host's / read-only at /host, rslave so mounts
            # made later (a new disk) show up too; the host's PID namespace for its processes.
            mounts=(Mount("/", "/host", read_only=True, propagation="rslave"),),
            pid_host=True,
        ),
        ContainerSpec(
            "blackbox-exporter",
            "qwen-blackbox-exporter",
            BLACKBOX_EXPORTER_IMAGE,
            command=tuple(blackbox_args(blackbox_file)),
            files=((blackbox_file, blackbox_config(cluster)),),
            capabilities=("NET_RAW",),  # ICMP echo needs a raw socket
        ),
    ]
    if cluster.gpus_per_node > 0:
        counters = f"{IN_CONTAINER}/dcgm-counters.csv"
        specs.append(
            # NVIDIA's quick start: --gpus all --cap-add SYS_ADMIN (github.com/NVIDIA/dcgm-exporter).
            ContainerSpec(
                "dcgm-exporter",
                "qwen-dcgm-exporter",
                DCGM_EXPORTER_IMAGE,
                command=tuple(dcgm_args(counters)),
                files=((counters, DCGM_COUNTERS),),
                capabilities=("SYS_ADMIN",),
                gpus=True,
            )
        )
    specs.append(
        ContainerSpec(
            "nodemetrics",
            "qwen-nodemetrics",
            AGGREGATOR_IMAGE,
            entrypoint=("python3", script, config),
            files=((script, nodemetrics_source), (config, aggregator_json(cluster, node_name))),
        )
    )
    return specs


def server_containers(cluster) -> list[ContainerSpec]:
    """Prometheus and Alertmanager: their files on the host (server_files_script), mounted."""
    config = Mount(HOST_CONFIG_DIR, CONTAINER_CONFIG_DIR, read_only=True)
    return [
        ContainerSpec(
            "prometheus",
            PROMETHEUS_CONTAINER,
            PROMETHEUS_IMAGE,
            command=tuple(
                prometheus_args(
                    cluster, config_path=f"{CONTAINER_CONFIG_DIR}/prometheus.yml", data_path="/prometheus"
                )
            ),
            # On the host, so a replaced container (a new image) keeps the history.
            mounts=(config, Mount(f"{HOST_DATA_DIR}/prometheus", "/prometheus")),
        ),
        ContainerSpec(
            "alertmanager",
            ALERTMANAGER_CONTAINER,
            ALERTMANAGER_IMAGE,
            command=tuple(
                alertmanager_args(
                    cluster, config_path=f"{CONTAINER_CONFIG_DIR}/alertmanager.yml", data_path="/alertmanager"
                )
            ),
            mounts=(config, Mount(f"{HOST_DATA_DIR}/alertmanager", "/alertmanager")),
        ),
    ]


def stack_outputs(cluster) -> dict[str, object]:
    """Stack outputs: where a central Prometheus scrapes, and the cluster's own (doctor reads it)."""
    result: dict[str, object] = {}
    if cluster.monitoring.exporters:
        port = endpoint_port(cluster)
        result["monitoringEndpoints"] = {n.name: f"http://{n.ip}:{port}/metrics" for n in cluster.nodes}
    if cluster.monitoring_node is not None:
        result["prometheus"] = f"http://{cluster.monitoring_node.ip}:{prometheus_port(cluster)}"
        result["alertmanager"] = f"http://{cluster.monitoring_node.ip}:{alertmanager_port(cluster)}"
    return result
