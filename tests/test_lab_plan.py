"""The lab plan: what gets built for a stack, pure (no root needed)."""

from __future__ import annotations

import ipaddress
import json
from collections import Counter

import pytest

from labkit.cluster import blueprint, check
from qwen_cluster.config import ConfigError
from qwen_cluster.ports import Vantage
from tooling import stackfile

ONPREM = stackfile.load("onprem")


@pytest.fixture(scope="module")
def onprem() -> blueprint.LabPlan:
    return blueprint.build(ONPREM, "onprem")


def _in(ip: str, cidrs) -> bool:
    return any(ipaddress.ip_address(ip) in cidr for cidr in cidrs)


def test_every_namespace_carries_the_lab_prefix(onprem):
    assert all(name.startswith("qcl-onprem-") for name in onprem.namespaces)
    assert len(set(onprem.namespaces)) == len(onprem.namespaces)


def test_nodes_get_the_stack_addresses_on_the_segment_prefix(onprem):
    assert [(m.node, m.ip, m.prefixlen) for m in onprem.nodes] == [
        (node.name, str(node.ip), 24) for node in ONPREM.nodes
    ]


def test_vantage_addresses_sit_where_their_names_say(onprem):
    access, segment = ONPREM.access, ONPREM.network.cidr
    client = onprem.vantage(Vantage.CLIENT).ip
    assert _in(client, access.client_cidrs) and not _in(client, [segment, *access.monitoring_cidrs])
    assert _in(onprem.vantage(Vantage.MONITORING).ip, access.monitoring_cidrs)
    assert _in(onprem.vantage(Vantage.ADMIN).ip, access.admin_cidrs)
    outsider = onprem.vantage(Vantage.OUTSIDER).ip
    assert not _in(outsider, [segment, *access.client_cidrs, *access.monitoring_cidrs, *access.admin_cidrs])
    intruder = onprem.vantage(Vantage.INTRUDER).ip
    assert _in(intruder, [segment]) and intruder not in {str(node.ip) for node in ONPREM.nodes}


def test_switch_ports_are_valid_interface_names_and_unique(onprem):
    ports = [member.switch_port for member in onprem.members]
    assert len(set(ports)) == len(ports) and all(len(port) <= 15 for port in ports)


def test_intruder_gets_no_more_than_a_client(onprem):
    def opened(vantage: str) -> set[tuple[str, str, int]]:
        return {
            (e.target_node, e.name, e.port) for e in onprem.expectations() if e.vantage == vantage and e.open
        }

    assert opened("intruder") <= opened("client")
    assert opened("outsider") == set()


def test_client_reaches_only_the_listener_and_nodes_reach_each_other(onprem):
    client = [e for e in onprem.expectations() if e.vantage == "client" and e.open]
    assert {(e.target_node, e.port) for e in client} == {("master", 80)}
    node_rows = [e for e in onprem.expectations() if e.vantage == "worker-1"]
    assert node_rows and all(e.open for e in node_rows)
    assert "worker-1" not in {e.target_node for e in node_rows}


def test_a_monitoring_host_inside_client_cidrs_is_expected_to_be_a_client_too(onprem):
    rows = {(e.name, e.port): e.open for e in onprem.expectations() if e.vantage == "monitoring"}
    assert rows[("monitoring", 8000)] and rows[("listener", 80)] and not rows[("model-service", 5000)]
    assert any("also inside client" in note for note in onprem.notes)


def test_the_monitoring_host_is_expected_to_reach_prometheus_and_alertmanager_on_the_master_only(onprem):
    rows = [
        e
        for e in onprem.expectations()
        if e.vantage == "monitoring" and e.name in ("prometheus", "alertmanager")
    ]
    assert {(e.target_node, e.port) for e in rows if e.open} == {("master", 9090), ("master", 9093)}
    closed = [e for e in rows if not e.open]
    assert {e.target_node for e in closed} == {"worker-1", "worker-2", "worker-3"}
    assert {e.why for e in closed} == {"runs on master only"}


def test_node_count_override_adds_workers_on_free_addresses():
    bigger = blueprint.with_node_count(ONPREM, 6)
    assert [node.name for node in bigger.nodes][-2:] == ["worker-4", "worker-5"]
    assert [str(node.ip) for node in bigger.nodes][-2:] == ["192.168.1.104", "192.168.1.105"]
    smaller = blueprint.with_node_count(ONPREM, 2)
    assert [node.name for node in smaller.nodes] == ["master", "worker-1"]


def test_node_count_override_is_validated_like_a_stack():
    with pytest.raises(ConfigError, match="at least 2"):
        blueprint.with_node_count(ONPREM, 1)


def test_aws_stacks_are_refused_with_the_reason():
    with pytest.raises(blueprint.PlanError, match="bare-metal"):
        blueprint.build(stackfile.load("dev"), "dev")


def test_firewalld_is_refused_with_the_reason():
    bare_metal = ONPREM.bare_metal.model_copy(update={"firewall": "firewalld"})
    with pytest.raises(blueprint.PlanError, match="D-Bus"):
        blueprint.build(ONPREM.model_copy(update={"bare_metal": bare_metal}), "x")


def test_probe_ports_cover_every_expected_port(onprem):
    assert onprem.probe_ports("worker-1") == [22, 5000, 6000, 6100, 8000, 9090, 9093]
    assert 80 in onprem.probe_ports("master")


def test_ss_listeners_are_parsed_with_their_address_and_owner():
    text = (
        'LISTEN 0 4096 192.168.1.100:9090 0.0.0.0:* users:(("prometheus",pid=41,fd=7))\n'
        'LISTEN 0 128 [::]:22 [::]:* users:(("sshd",pid=12,fd=4),("sshd",pid=13,fd=4))\n'
        "LISTEN 0 511 *:80 *:*\n"
        'LISTEN 0 4096 127.0.0.53%lo:53 0.0.0.0:* users:(("resolved",pid=9,fd=1))\n'
    )
    found = check.parse_ss("master", text)
    assert [(lst.address, lst.port, lst.process, lst.pid, lst.loopback) for lst in found] == [
        ("192.168.1.100", 9090, "prometheus", 41, False),
        ("::", 22, "sshd", 12, False),
        ("*", 80, "?", None, False),
        ("127.0.0.53", 53, "resolved", 9, True),
    ]


def test_an_unpinned_listener_is_the_model_servers_on_the_node_address_in_the_ephemeral_range(onprem):
    """ports.UNPINNED_CLUSTER_LISTENERS exactly: a port-0 bind of the model server's on the node's
    own address. Another process there, another address or a port outside the range is not one."""
    master = onprem.node("master")
    gloo = check.Listener("master", master.ip, 40897, "VLLM::Worker", 4242)
    assert check.unpinned(master, gloo, {4242})
    assert not check.unpinned(master, gloo, {1})  # not the model server's process
    everywhere = check.Listener("master", "0.0.0.0", 40897, "VLLM::Worker", 4242)
    pinnable = check.Listener("master", master.ip, 7000, "VLLM::Worker", 4242)
    assert not check.unpinned(master, everywhere, {4242})
    assert not check.unpinned(master, pinnable, {4242})
    assert 40897 not in check.allowed_ports(onprem, master)  # judged apart, never the whole range


def test_only_a_proxying_location_proves_a_model_server_answered():
    from qwen_cluster.render import nginx

    site = nginx.server_block(
        listen="80", upstream="replicas", idle_timeout_seconds=3600, tries=2, api_keys=True, tls=False
    )
    assert check.proxied_only(site, "= /health")
    answered_itself = site.replace("proxy_pass http://replicas/health;", "return 200;")
    assert not check.proxied_only(answered_itself, "= /health")
    assert not check.proxied_only(site, "= /no-such-location")


PD = (
    "serving.mode=disaggregated",
    'serving.prefill={"nodes":["master"]}',
    'serving.decode={"nodes":["worker-1"]}',
    "bareMetal.gpuModel=H100",
)


def test_a_lab_of_a_stack_variant_takes_the_changes_after_the_node_count():
    """`lab.py up onprem --nodes 2 --change ...`: the pools may name only the two nodes kept."""
    plan = blueprint.load("onprem", nodes=2, label="pd", changes=PD)
    assert plan.cluster.disaggregated and [member.node for member in plan.nodes] == ["master", "worker-1"]
    assert plan.stack_config["qwen-cluster:serving"]["mode"] == "disaggregated"
    assert not blueprint.load("onprem", nodes=2, label="pd").cluster.disaggregated


def test_a_change_naming_a_node_the_lab_does_not_keep_is_refused_before_anything_is_built(capsys):
    from labkit import cli as lab_cli

    changes = [*PD[:2], 'serving.decode={"nodes":["worker-3"]}', PD[3]]
    argv = ["up", "onprem", "--nodes", "2", "--label", "pdx"] + [f"--change={c}" for c in changes]
    assert lab_cli.main(argv) == 2
    out = capsys.readouterr().out
    assert "nothing built" in out and "worker-3" in out


def test_a_refused_port_that_must_be_open_passes_only_where_a_container_serves_it(monkeypatch):
    """NIXL's UCX binds five ports of its range at random and vLLM's router binds loopback on bare
    metal: refused there shows the firewall let the SYN in. Refused anywhere else (the holder's
    ports) is still a failure, and a port that must be closed is never helped by it."""
    from labkit.cluster import probes
    from labkit.hosts import netns

    plan = blueprint.load("onprem", nodes=2, label="pdp", changes=PD)
    monkeypatch.setattr(check, "container_ports", lambda _plan: {"worker-1": {5601, 5680, 5000}})
    monkeypatch.setattr(netns, "call_in", lambda _namespace, function, *args: function(*args))
    monkeypatch.setattr(
        probes, "tcp_connect", lambda _ip, _port, _timeout: probes.Connect(False, "refused", 0.0)
    )
    results = {(r.source, r.target, r.what): r for r in check.reachability(plan)}
    kv_data = results[("master", "worker-1", "kv-data 5601/tcp")]
    assert kv_data.ok and kv_data.observed.startswith("admitted"), kv_data
    assert not results[("master", "worker-1", "inter-node 6000/tcp")].ok  # the holder's: refused is a fault
    assert not results[("worker-1", "master", "kv-data 5601/tcp")].ok  # master's container not listed
    outsider = next(
        r
        for (source, target, what), r in results.items()
        if source == "outsider" and what == "kv-data 5601/tcp" and target == "worker-1"
    )
    assert outsider.ok and outsider.observed == "closed (refused)"


@pytest.mark.parametrize(
    ("prefill", "decode", "ok"),
    [
        (6, 6, True),  # every answer prefilled on the prefill node, decoded on the decode node
        (0, 6, False),  # the decode pool answered alone: nginx's backup, no KV crossed
        (6, 0, False),
    ],
)
def test_the_spread_of_a_disaggregated_stack_counts_every_answer_in_each_pool(
    monkeypatch, prefill, decode, ok
):
    """Disaggregated, an answer is finished on a prefill node and on a decode node (vLLM counts
    vllm:request_success_total on both, measured through the router in P/D mode)."""
    from labkit.cluster import lifecycle, probes, served
    from labkit.hosts import netns

    plan = blueprint.load("onprem", nodes=2, label="pds", changes=PD)
    readings = iter(
        [
            {"master": served.Served({}, 10.0, None), "worker-1": served.Served({}, 10.0, None)},
            {
                "master": served.Served({}, 10.0 + prefill, None),
                "worker-1": served.Served({}, 10.0 + decode, None),
            },
        ]
    )
    asked = {}

    def spread(_ip, _port, requests, **kwargs):
        asked.update(kwargs, requests=requests)
        return probes.Spread(counts=Counter({"?": requests}))

    monkeypatch.setattr(served, "read", lambda _plan: next(readings))
    monkeypatch.setattr(netns, "call_in", lambda _ns, function, *args, **kwargs: function(*args, **kwargs))
    monkeypatch.setattr(probes, "spread", spread)
    monkeypatch.setattr(lifecycle, "client_access", lambda _plan: probes.PLAIN)
    monkeypatch.setattr(check, "streaming", lambda _plan, _options: [])
    monkeypatch.setattr(check, "router_pools", lambda _plan: "the router's row")
    row, pools = check.load_balancer(plan, lifecycle.Options())
    assert asked["requests"] == 6 and row.ok is ok, row
    assert pools == "the router's row"
    # A disaggregated request waits as long as one takes on the lab's two cores.
    assert asked["timeout"] == check.PD_REQUEST_SECONDS


def _workers(*entries: tuple[str, str, bool]) -> bytes:
    return json.dumps(
        {
            "workers": [
                {"url": url, "worker_type": kind, "is_healthy": healthy} for url, kind, healthy in entries
            ]
        }
    ).encode()


PREFILL_URL, DECODE_URL, EXTRA_URL = "http://127.1.0.1:5000", "http://127.1.0.2:5000", "http://127.1.0.9:5000"


@pytest.mark.parametrize(
    ("body", "ok"),
    [
        (_workers((PREFILL_URL, "prefill", True), (DECODE_URL, "decode", True)), True),
        (_workers((PREFILL_URL, "prefill", True)), False),  # the decode node left the router
        (_workers((PREFILL_URL, "prefill", True), (DECODE_URL, "decode", False)), False),
        (_workers((PREFILL_URL, "decode", True), (DECODE_URL, "prefill", True)), False),  # swapped
        (
            _workers(
                (PREFILL_URL, "prefill", True), (DECODE_URL, "decode", True), ("http://x:1", "decode", True)
            ),
            False,
        ),
    ],
)
def test_the_router_row_wants_each_node_in_its_pool_and_healthy(monkeypatch, body, ok):
    """A disaggregated stack's check asks the router which node serves which pool: which node of a
    pool answers a request is the router's choice, that each is there and healthy is not."""
    from labkit.cluster import probes
    from labkit.hosts import netns

    plan = blueprint.load("onprem", nodes=2, label="pds", changes=PD)
    asked = []

    def get(ip, port, path, **_kwargs):
        asked.append((ip, port, path))
        return probes.Reply(200, None, body)

    monkeypatch.setattr(netns, "call_in", lambda _ns, function, *args, **kwargs: function(*args, **kwargs))
    monkeypatch.setattr(probes, "get", get)
    row = check.router_pools(plan)
    assert asked == [("127.0.0.1", plan.cluster.router_port, "/workers")]
    assert row.ok is ok, row
    assert row.expected == "master prefill, worker-1 decode: each healthy"
