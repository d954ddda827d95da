"""The alert rules: the guide's requirements as Prometheus alerts (bounds from the stack
config, durations on the monitoring clock) and the recording rules they read. `doctor`
prints each alert's cause and fix. Pure: text and data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from qwen_cluster import ports as port_table
from qwen_cluster import tags
from qwen_cluster.render import router
from qwen_cluster.render.monitoring.clock import clock, duration
from qwen_cluster.render.monitoring.endpoint import ROUTER_SOURCE, XID_WINDOW_SECONDS, router_node
from qwen_cluster.render.monitoring.prometheus import JOB

KV_CACHE_FULL = 0.95
# serving.mode disaggregated: a decode node that computes more than this share of its prompt
# tokens itself is prefilling instead of pulling the KV (QwenKvRecomputed). vLLM counts each prompt
# token by where it came from (vllm:prompt_tokens_by_source, vllm/v1/metrics/stats.py
# PromptTokenStats: local_compute + local_cache_hit + external_kv_transfer = the prompt); a decode
# node that pulled computes none of it (measured on the lab: local_compute 0 of 2,162 prompt
# tokens, all external_kv_transfer). Not vllm:request_prefill_kv_computed_tokens: on a decode node
# it subtracts the prefill node's own cache hits (output_processor.py remote_prefill_cached_tokens),
# so it counts the whole prompt of every pulled request (the alert fired on a healthy lab).
KV_RECOMPUTED_SHARE = 0.5
_NOT_KV = ',port_name!~"kv-.*"'


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
    # The guide's troubleshooting step it belongs to: connectivity, latency or bandwidth.
    step: str = "connectivity"


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
            f"check the node (ping, route -n) and its container: docker logs {tags.MODEL_SERVER_CONTAINER}",
            where=("replica_head",),
        ),
        Alert(
            "QwenAllReplicasDown",
            "critical",
            "max(qwen:replica_up) == 0",
            60,
            "no replica is serving: the load balancer has no healthy upstream",
            "every model server is down or unreachable",
            f"start with the first replica's head: ping it, then docker logs {tags.MODEL_SERVER_CONTAINER}",
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
            step="latency",
        ),
        Alert(
            "QwenInterNodePortUnreachable",
            "critical",
            # NIXL's side channel has its own alert (_pd_alerts), with its own cause and fix.
            f'probe_success{{module="tcp_connect"{_NOT_KV if cluster.disaggregated else ""}}} == 0 '
            "unless on(peer) (qwen:peer_reachable == 0)",
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
            step="bandwidth",
        ),
        Alert(
            "QwenKvCacheFull",
            "warning",
            f"max by (node, replica) (vllm:kv_cache_usage_perc) > {KV_CACHE_FULL:g}",
            300,
            "KV cache on {{ $labels.node }} is {{ $value | humanizePercentage }} full",
            "more concurrent tokens than the replica holds: requests queue and get preempted",
            "add replicas (nodes), lower max_model_len, or raise tensorParallel",
            step="latency",
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
            step="latency",
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
            step="latency",
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
            # The router has its own alerts (_router_alerts), with their own cause and fix.
            f'qwen_source_up{{qwen_source!="{ROUTER_SOURCE}"}} == 0'
            if router_node(cluster)
            else "qwen_source_up == 0",
            60,
            "{{ $labels.qwen_source }} metrics on {{ $labels.node }} are missing",
            "that exporter is stopped or not answering on loopback",
            "docker ps on {{ $labels.node }}; restart the {{ $labels.qwen_source }} exporter container",
        ),
    ] + _router_alerts(cluster) + _aws_alerts(cluster, rate_window) + _pd_alerts(cluster, rate_window)


def _router_alerts(cluster) -> list[Alert]:
    """vLLM's router (loadBalancer.routing cache-aware), read through its node's endpoint. Either
    way nginx keeps serving from the replicas directly (render/nginx.py router_server): routing
    falls back to least_conn, and prefix-cache hits drop. Metric names: vllm-project/router
    src/metrics.rs (vllm_router_worker_health{worker} 1/0, vllm_router_active_workers)."""
    if router_node(cluster) is None:
        return []
    logs = f"docker logs {router.CONTAINER_NAME} on {{{{ $labels.node }}}}"
    source = f'qwen_source="{ROUTER_SOURCE}"'
    # AWS: each node's proxy falls back to its own vLLM (render/proxy.py).
    aws = cluster.aws is not None
    fallback = "each node's proxy sends to its own vLLM" if aws else "nginx sends to the replicas directly"
    where = f"{router.listen_address(cluster)}:{cluster.router_port}" if aws else "its loopback port"
    return [
        Alert(
            "QwenRouterDown",
            "warning",
            f"qwen_source_up{{{source}}} == 0",
            60,
            "vLLM's router on {{ $labels.node }} is down: " + fallback + ", without cache-aware routing",
            f"the {router.CONTAINER_NAME} container is stopped or crashed, or does not answer its "
            "metrics port on loopback",
            f"{logs}; docker start {router.CONTAINER_NAME}",
        ),
        Alert(
            "QwenRouterLostWorkers",
            "warning",
            f"(max by (node) (vllm_router_worker_health{{{source}}}) == 0) or "
            f"(max by (node) (vllm_router_active_workers{{{source}}}) == 0)",
            120,
            "vLLM's router on {{ $labels.node }} has no healthy worker: " + fallback + ", without "
            "cache-aware routing",
            "every replica failed the router's health checks, or the rollout's drains removed the "
            "workers and their gates did not add them back (a failed ready step)",
            f"{logs}; GET /list_workers on {where}; re-run the rollout (pulumi up)",
        ),
        *_kv_events_alerts(cluster, source),
    ]


# How long the kv_aware router may look up placements without one hit while the replicas count
# prefix-cache hits: long enough for a quiet cluster's few repeats.
KV_EVENTS_WINDOW = "15m"


def _kv_events_alerts(cluster, source: str) -> list[Alert]:
    """kv-aware: the router's index gets the replicas' KV-cache events (render/vllm.py
    kv_events_flags). When they stop arriving (a publisher not bound, a rule dropping the port, a
    subscriber gone) the router says nothing of it: 0.1.17 keeps no per-source metric, its
    subscriber waits silently (ZMQ), and `vllm_router_kv_placement_lookups_total{result}` just stops
    counting hits. So: lookups, none a hit, while the replicas themselves count prefix-cache hits
    (vLLM's `vllm:prefix_cache_hits_total`), all over KV_EVENTS_WINDOW. Which replica: doctor's
    kv-events check, from the router's node (render/nodecheck.py)."""
    if cluster.kv_events_port is None:
        return []
    window = KV_EVENTS_WINDOW
    lookups = f"vllm_router_kv_placement_lookups_total{{{source}}}"
    hits = f'vllm_router_kv_placement_lookups_total{{{source},result="hit"}}'
    return [
        Alert(
            "QwenRouterKvEventsSilent",
            "warning",
            f"(sum by (node) (increase({lookups}[{window}])) > 0) "
            f"unless on(node) (sum by (node) (increase({hits}[{window}])) > 0) "
            f'and on() (sum(increase(vllm:prefix_cache_hits_total{{qwen_source="vllm"}}[{window}])) > 0)',
            300,
            "vLLM's router on {{ $labels.node }} found no prompt in its KV index for " + window
            + " while the replicas served cached prefixes: kv-aware routing places by load alone",
            "the replicas' KV-cache events do not reach the router: a publisher not bound, the "
            f"kv-events port ({cluster.kv_events_port}) dropped between the router's node and a "
            "replica head, or a block size other than the router's",
            "doctor (its kv-events check names the replica); docker logs qwen-router on "
            "{{ $labels.node }} (\"kv_index subscriber\"); pulumi up",
        ),
    ]


def _pd_alerts(cluster, window: str) -> list[Alert]:
    """serving.mode disaggregated: vLLM's NIXL connector's own counters (vLLM 0.32/0.33,
    vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py NixlPromMetrics:
    vllm:nixl_num_failed_transfers, failed handshakes and notifications included, on the node that
    reads; vllm:nixl_num_kv_expired_reqs and vllm:nixl_num_notifications_after_expiry on the node
    that holds the KV, the prefill node with the pull connector), the decode pool's own prefill
    (vllm:prompt_tokens_by_source{source="local_compute"} against vllm:prompt_tokens,
    vllm/v1/metrics/loggers.py)
    and the cross-pool probe of the side channel (endpoint.probes). The targets carry `pool`
    (prometheus.scrape_targets)."""
    if not cluster.disaggregated:
        return []
    policy = cluster.serving.kv_transfer.load_failure_policy
    outcome = (
        "its clients got HTTP 500 (serving.kvTransfer.loadFailurePolicy fail)"
        if policy == "fail"
        else "the decode node prefilled those prompts again itself (loadFailurePolicy recompute): "
        "200, but slow, and seen nowhere else"
    )
    doctor = "scripts/doctor.py <stack> names the blocked port or unreachable side-channel host"
    # vLLM's own lease: the prefill node frees a request's KV blocks this long after it finished
    # unless the decode node has read them (nixl/base_worker.py, kv_connector_extra_config
    # kv_lease_duration, 30 s by default).
    return [
        Alert(
            "QwenKvTransferFailed",
            "critical" if policy == "fail" else "warning",
            f"sum by (node) (increase(vllm:nixl_num_failed_transfers_total[{window}])) > 0",
            0,
            "KV transfers over NIXL failed on {{ $labels.node }}: " + outcome,
            "the decode node could not reach a prefill node's side channel (a firewall, a side-channel host "
            "it cannot route to), or the transport failed (UCX or EFA devices missing in the container, "
            "a link down)",
            f"{doctor}; telnet the prefill node's address {port_of(cluster)} from {{{{ $labels.node }}}}; "
            f"docker logs {tags.MODEL_SERVER_CONTAINER} on it (handshake_failed, KV load failure)",
            step="connectivity",
        ),
        Alert(
            "QwenKvRecomputed",
            "warning",
            "sum by (node) (rate(vllm:prompt_tokens_by_source_total"
            f'{{pool="decode",source="local_compute"}}[{window}])) '
            f'/ sum by (node) (rate(vllm:prompt_tokens_total{{pool="decode"}}[{window}])) '
            f"> {KV_RECOMPUTED_SHARE:g}",
            300,
            "decode node {{ $labels.node }} computes {{ $value | humanizePercentage }} of its prompt tokens "
            "itself instead of pulling their KV",
            "KV loads fail and are recomputed (loadFailurePolicy recompute), or requests reach the decode "
            "pool without the router (nginx or the node proxies fall back to it while the router is down)",
            f"{doctor}; look at QwenKvTransferFailed and QwenRouterDown; docker logs "
            f"{tags.MODEL_SERVER_CONTAINER} on {{{{ $labels.node }}}} (KV load failure)",
            step="bandwidth",
        ),
        Alert(
            "QwenKvLeaseExpired",
            "warning",
            f"sum by (node) (increase(vllm:nixl_num_kv_expired_reqs_total[{window}])) > 0",
            0,
            "{{ $labels.node }} freed the KV of requests that no decode node read within its lease",
            "the decode pool took longer than the lease (vLLM's kv_lease_duration, 30 s) to read a "
            "prompt's KV: it is overloaded, its queue is long, or its reads stall on the link",
            "look at the decode pool's vllm:num_requests_waiting and the NIXL transfer time "
            "(vllm:nixl_xfer_time_seconds); add decode nodes",
            step="latency",
        ),
        Alert(
            "QwenKvReadAfterLeaseExpired",
            "critical",
            f"sum by (node) (increase(vllm:nixl_num_notifications_after_expiry_total[{window}])) > 0",
            0,
            "a decode node read KV from {{ $labels.node }} after its lease expired: those blocks may "
            "already hold another prompt",
            "the read finished after the prefill node released the blocks (vLLM logs 'Potentially "
            "invalid KV blocks'); under load another request may have reused them, and the answer is "
            "wrong without any error",
            "find the slow reads (vllm:nixl_xfer_time_seconds on the decode pool, doctor for the link "
            "floor); add decode nodes or a faster link",
            step="latency",
        ),
        Alert(
            "QwenKvSideChannelUnreachable",
            "critical",
            'probe_success{module="tcp_connect",port_name=~"kv-.*"} == 0 '
            "unless on(peer) (qwen:peer_reachable == 0)",
            60,
            "{{ $labels.node }} cannot reach NIXL's {{ $labels.port_name }} on {{ $labels.peer }} "
            "(port {{ $labels.port }})",
            "a host firewall or security group closes the port between the pools, or the model server "
            "on {{ $labels.peer }} is down: KV transfers to and from it fail (" + outcome + ")",
            "telnet {{ $labels.peer_ip }} {{ $labels.port }} from {{ $labels.node }}; ufw status / nft "
            "list ruleset on {{ $labels.peer }}; " + doctor,
            where=("node", "peer"),
        ),
    ]


def port_of(cluster) -> int:
    return port_table.port_of(cluster.ports, port_table.KV_SIDE_CHANNEL)


def _aws_alerts(cluster, window: str) -> list[Alert]:
    """AWS: the ENA allowance counters (node_exporter's ethtool collector) and, with EFA, its
    error counters (nodemetrics). A shaped link or lost RDMA traffic gives no error anywhere
    else: NCCL just gets slow or hangs."""
    if cluster.aws is None:
        return []
    found = [
        Alert(
            "QwenEnaAllowanceExceeded",
            "warning",
            'sum by (node, device) (increase({__name__=~"node_ethtool_(bw_in|bw_out|pps|conntrack|linklocal)'
            f'_allowance_exceeded"}}[{window}])) > 0',
            0,
            "ENA on {{ $labels.node }} ({{ $labels.device }}) shaped {{ $value }} packets: the "
            "instance's network allowance is exceeded",
            "the instance sends or receives more than its bandwidth, packets-per-second or connection "
            "allowance: traffic is queued or dropped by EC2, not by the host",
            "ethtool -S {{ $labels.device }} | grep allowance on {{ $labels.node }}; spread the load, "
            "or a larger instance type",
            step="bandwidth",
        )
    ]
    if cluster.aws.efa:
        found.append(
            Alert(
                "QwenEfaErrors",
                "critical",
                f"sum by (node, device, counter) (increase(qwen_efa_errors_total[{window}])) > 0",
                0,
                "EFA {{ $labels.device }} on {{ $labels.node }}: {{ $value }} more {{ $labels.counter }}",
                "EFA drops packets or fails RDMA requests: NCCL retries, slows down or hangs",
                "cat /sys/class/infiniband/{{ $labels.device }}/ports/1/hw_counters/{{ $labels.counter }} "
                "on {{ $labels.node }}; fi_info -p efa; check the node security group's self rules",
            )
        )
    return found


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
