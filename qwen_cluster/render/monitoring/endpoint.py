"""Every node's monitoring endpoint: what `qwen_cluster/node/nodemetrics.py` on a node fetches
from loopback and serves on the endpoint port, the peer probes, and the exporters' arguments
and files. Pure: text and data.

What each piece is and serves: docs/monitoring.md, "What answers on each node"; why one
endpoint of our own and not exporter_exporter, and XIDs as a windowed count:
docs/decisions.md, "Monitoring".
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode

import yaml

from qwen_cluster import ports as port_table
from qwen_cluster.render import vllm
from qwen_cluster.render.monitoring.clock import duration, timing

LOOPBACK = "127.0.0.1"
NODE_EXPORTER_PORT = port_table.MONITORING_LOOPBACK_PORTS["node exporter"]
BLACKBOX_PORT = port_table.MONITORING_LOOPBACK_PORTS["blackbox exporter"]
DCGM_PORT = port_table.MONITORING_LOOPBACK_PORTS["dcgm exporter"]
# Where an XID counts: the exporter's window and the alert's look-back.
XID_WINDOW_SECONDS = 600


# The endpoint's source name for vLLM's router (every sample labelled qwen_source="router").
ROUTER_SOURCE = "router"


def router_node(cluster) -> str | None:
    """Where vLLM's router runs and is scraped with loadBalancer.routing cache-aware: the
    load-balancer node on bare metal, the master on AWS (docs/routing.md); None otherwise."""
    where = cluster.router_node
    return where.name if where is not None else None


def endpoint_port(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.MONITORING_ENDPOINT)


def listening_ports(cluster, node_name: str) -> list[tuple[str, int]]:
    """(name, port) of what listens on `node_name` for the other members at a pinned port: the
    model port on a replica head; for a replica that spans nodes, vLLM's `--master-port` on its
    head (mp), or the Ray ports pinned in the cluster range (GCS on the head; node and object
    manager on every member). The ports vLLM, NCCL and Gloo choose at random are not probed."""
    topology = cluster.topology
    found: list[tuple[str, int]] = []
    if topology.is_head(node_name):
        found.append(
            (next(e.name for e in cluster.ports if e.scope is port_table.Scope.CLIENTS), cluster.model_port)
        )
    if topology.pipeline_parallel == 1:
        return found
    pinned = topology.ports
    if not cluster.runs_ray:
        if topology.is_head(node_name):
            found.append(("vllm-master", pinned.vllm_master))
        return found
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
        result += _kv_probes(cluster, cluster.serving.pool_of(node_name), peer)
    return result


def _kv_probes(cluster, source_pool: str | None, peer) -> list[Probe]:
    """serving.mode disaggregated: from a node of one pool, NIXL's side channel on each node of
    the other (where it connects), at the address that node advertises (its side-channel host).
    Never within a pool, nor from or to a node of neither: the port table closes it there, and a
    probe would hold QwenKvSideChannelUnreachable firing on a healthy cluster."""
    peer_pool = cluster.serving.pool_of(peer.name)
    if not cluster.disaggregated or None in (source_pool, peer_pool) or source_pool == peer_pool:
        return []
    port = port_table.port_of(cluster.ports, port_table.KV_SIDE_CHANNEL)
    host = cluster.kv_side_channel_host(peer)
    return [Probe(peer.name, host, "tcp_connect", port, port_table.KV_SIDE_CHANNEL)]


def _aggregator_base(cluster, node_name: str, gpu: bool | None) -> dict:
    node = next(n for n in cluster.nodes if n.name == node_name)
    gpu = cluster.gpus_per_node > 0 if gpu is None else gpu
    times = timing(cluster)
    sources = [{"name": "node", "url": f"http://{LOOPBACK}:{NODE_EXPORTER_PORT}/metrics"}]
    if gpu:
        sources.append({"name": "gpu", "url": f"http://{LOOPBACK}:{DCGM_PORT}/metrics"})
    if cluster.topology.is_head(node_name):
        # Where vLLM listens (render/vllm.py): the node address on bare metal, loopback on AWS.
        address = vllm.listen_address(cluster, node_name)
        sources.append({"name": "vllm", "url": f"http://{address}:{cluster.model_port}/metrics"})
    if router_node(cluster) == node_name:
        # vLLM's router's own metrics listener, loopback only (render/router.py).
        sources.append(
            {"name": ROUTER_SOURCE, "url": f"http://{LOOPBACK}:{port_table.ROUTER_METRICS_PORT}/metrics"}
        )
    base = {
        "node": node_name,
        "node_ip": str(node.ip),
        # The node's cluster address: Prometheus and monitoringCidrs reach it there; nothing
        # listens for it on the node's other interfaces.
        "listen": f"{node.ip}:{endpoint_port(cluster)}",
        "timeout": times.fetch_timeout,
        "sources": sources,
    }
    if cluster.aws is not None and cluster.aws.efa:
        base["efa_sysfs"] = EFA_SYSFS  # the EFA error counters (nodemetrics.efa_errors)
    return base


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
# [(cluster, {source pool: {peer name: [entry text, ...]}})]: the last cluster only
_peer_entries_cache: list = []


def _peer_entries(cluster, source_pool: str | None) -> dict[str, list[str]]:
    """Every peer's probe entries as aggregator_json writes them inside "probes" (indented
    two levels), encoded once per cluster and source pool: a peer is probed the same way from
    every node of a pool (from every node, aggregated; the side channel only across pools)."""
    if not (_peer_entries_cache and _peer_entries_cache[0][0] is cluster):
        _peer_entries_cache[:] = [(cluster, {})]
    by_pool = _peer_entries_cache[0][1]
    if source_pool in by_pool:
        return by_pool[source_pool]
    entries: dict[str, list[str]] = {node.name: [] for node in cluster.nodes}
    # From a node outside the cluster every member is a peer; then the pool's own probes.
    found = probes(cluster, node_name="")
    found += [probe for peer in cluster.nodes for probe in _kv_probes(cluster, source_pool, peer)]
    for probe in found:  # bucketed per peer: its own probes first, then the side channel's
        text = json.dumps(_probe_entry(probe), indent=2, sort_keys=True)
        entries[probe.peer].append(text.replace("\n", "\n    ").join(("    ", "")))
    by_pool[source_pool] = entries
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
    by_peer = _peer_entries(cluster, cluster.serving.pool_of(node_name))
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


# What the ENA driver counts when the instance's network allowance shaped or dropped packets
# (Linux drivers/net/ethernet/amazon/ena/ena_ethtool.c ENA_STAT_ENI_ENTRY; AWS "Monitor network
# performance for ENA settings on your EC2 instance"): `ethtool -S`, node_ethtool_<name> in Prometheus.
ENA_ALLOWANCES = (
    "bw_in_allowance_exceeded",
    "bw_out_allowance_exceeded",
    "pps_allowance_exceeded",
    "conntrack_allowance_exceeded",
    "linklocal_allowance_exceeded",
)
EFA_SYSFS = "/sys/class/infiniband"


def node_exporter_args(*, rootfs: str | None = "/host", ena: bool = False) -> list[str]:
    """`ena`: also the ENA driver's allowance counters (AWS), through node_exporter's ethtool
    collector (off by default; it names each statistic node_ethtool_<stat>)."""
    args = [f"--web.listen-address={LOOPBACK}:{NODE_EXPORTER_PORT}"]
    if ena:
        args += ["--collector.ethtool", f"--collector.ethtool.metrics-include=^({'|'.join(ENA_ALLOWANCES)})$"]
    if rootfs:
        # In a container: the host's filesystem mounted read-only at /host (node_exporter's
        # README, "Docker"); /proc and /sys are read through it.
        args.append(f"--path.rootfs={rootfs}")
    return args


def blackbox_args(config_path: str) -> list[str]:
    return [f"--config.file={config_path}", f"--web.listen-address={LOOPBACK}:{BLACKBOX_PORT}"]
