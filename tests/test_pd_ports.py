"""NIXL's rows (kv-side-channel, kv-data) are reached from the other pool only, on bare metal: what
verify probes, what doctor names and what the lab expects all read it from one fact
(qwen_cluster.ports.member_reaches, ClusterConfig.fenced_pool). The firewall rules themselves, and
their run in a real kernel, are in tests/test_render_firewall.py."""

from __future__ import annotations

import socket
import subprocess

from labkit.cluster import blueprint
from qwen_cluster import ports as port_table
from qwen_cluster.config import validate
from qwen_cluster.render import verify
from tests.helpers.baremetal import ONPREM, ONPREM_DISAGGREGATED
from tests.helpers.configs import disaggregated
from tooling import doctor

# ONPREM_DISAGGREGATED: master and worker-1 prefill, worker-2 and worker-3 decode.
KV_ROWS = {"kv-side-channel", "kv-data"}
LOOPBACK = "127.0.0.1"


def test_only_a_fenced_pool_keeps_its_own_members_off_nixls_rows():
    assert port_table.member_reaches("kv-side-channel", "decode", "prefill")
    assert not port_table.member_reaches("kv-side-channel", "prefill", "prefill")
    assert not port_table.member_reaches("kv-data", "decode", "decode")
    assert port_table.member_reaches("inter-node", "prefill", "prefill")  # the member rule's other ports
    assert port_table.member_reaches("kv-side-channel", None, None)  # nothing fenced (aws, aggregated)


def test_bare_metal_pools_are_fenced_and_aws_pools_are_not(aws_raw):
    assert [ONPREM_DISAGGREGATED.fenced_pool(n.name) for n in ONPREM_DISAGGREGATED.nodes] == [
        "prefill",
        "prefill",
        "decode",
        "decode",
    ]
    assert ONPREM.fenced_pool("master") is None
    # A security group has allow rules only and EFA needs its all-traffic self rule.
    assert validate(disaggregated(aws_raw)).fenced_pool("master") is None


def kv_probes(cluster, source: str) -> dict[tuple[str, int], str]:
    return {
        (probe.dest, probe.port): probe.expect
        for probe in verify.cluster_probes(cluster, source)
        if probe.name in KV_ROWS
    }


def test_verify_expects_nixls_ports_reachable_from_the_other_pool_and_closed_within_one():
    # worker-3 probes worker-2, the member of its pool before it (serving.decode.nodes, a ring).
    assert kv_probes(ONPREM_DISAGGREGATED, "worker-3") == {
        **{(dest, port): "reachable" for dest in ("master", "worker-1") for port in (5600, 5601, 5680)},
        **{("worker-2", port): "closed" for port in (5600, 5601, 5680)},
    }
    # Every other row stays reachable within the pool (the member rule).
    within = [p for p in verify.cluster_probes(ONPREM_DISAGGREGATED, "worker-3") if p.dest == "worker-2"]
    assert {p.expect for p in within if p.name not in KV_ROWS} >= {"reachable", "service"}
    assert "closed" not in {p.expect for p in within if p.name not in KV_ROWS}


def test_each_host_is_probed_closed_by_one_member_of_its_pool():
    raw = disaggregated(validate_raw_of(ONPREM_DISAGGREGATED))
    raw["nodes"] += [{"name": "worker-4", "ip": "192.168.1.104"}, {"name": "worker-5", "ip": "192.168.1.105"}]
    raw["serving"]["decode"] = {"nodes": ["worker-2", "worker-3", "worker-4", "worker-5"]}
    cluster = validate(raw)
    closed = {
        (probe.source, probe.dest)
        for probe in verify.cluster_probes(cluster)
        if probe.name == "kv-side-channel" and probe.expect == "closed"
    }
    assert closed == {
        ("worker-1", "master"),
        ("master", "worker-1"),
        ("worker-5", "worker-2"),
        ("worker-2", "worker-3"),
        ("worker-3", "worker-4"),
        ("worker-4", "worker-5"),
    }
    # Not probed from the rest of the pool: a closed port waits out the connect timeout.
    assert not kv_probes(cluster, "worker-2").keys() & {("worker-4", 5600), ("worker-5", 5600)}


def validate_raw_of(cluster) -> dict:
    return cluster.model_dump(by_alias=True, mode="json", exclude_none=True)


def test_each_nodes_script_holds_its_own_probes_of_the_fence():
    """A node's script joins rows written once per destination (verify._own_rows): the same rows
    as its probes, the fence's included."""
    for node in ONPREM_DISAGGREGATED.nodes:
        text = verify.for_cluster(ONPREM_DISAGGREGATED, node.name)
        rows = text.split("<<'QWEN_PROBES_EOF'\n")[1].split("\nQWEN_PROBES_EOF")[0].splitlines()
        probes = verify.cluster_probes(ONPREM_DISAGGREGATED, node.name)
        assert rows == [f"@{node.name}|{node.ip}"] + [
            f"{p.dest}|{p.dest_ip}|{p.name}|{p.port}|{p.expect}" for p in probes
        ]
    assert "worker-2|192.168.1.102|kv-side-channel|5600|closed" in verify.for_cluster(
        ONPREM_DISAGGREGATED, "worker-3"
    )


def test_aggregated_verify_probes_no_port_closed():
    assert {probe.expect for probe in verify.cluster_probes(ONPREM)} == {"service", "reachable"}


def test_a_nixl_port_answering_within_the_pool_is_named_as_the_fence_with_its_fix():
    # A listener on loopback: the port answers where it must be closed.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        probe = verify.Probe("worker-3", LOOPBACK, "worker-2", LOOPBACK, "kv-side-channel", port, "closed")
        text = verify.apply_script([probe], [], max_latency_ms=1, kv_pool="decode")
        done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=60)
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(doctor.MARK + "finding")]
    _, _, check, node, peer, detail = line.split("|", 5)
    assert (check, node, peer) == ("kv-fence", "worker-3", "worker-2")
    assert "expected closed, got open" in detail
    found = doctor._finding(check, node, peer, detail)
    assert found.severity == "warning"
    assert found.fix.startswith(
        "ufw status numbered / nft list ruleset / firewall-cmd --list-rich-rules on worker-2"
    )
    assert "on worker-2: the kv-side-channel and kv-data drops of its own pool" in found.fix


def lab_node_expectations(cluster) -> dict[tuple[str, str, str, int], bool]:
    """(source node, target node, row, port): open, as the lab's `check` probes it."""
    plan = blueprint.build(cluster, "pdports")
    nodes = {node.name for node in cluster.nodes}
    return {
        (exp.vantage, exp.target_node, exp.name, exp.port): exp.open
        for exp in plan.expectations()
        if exp.vantage in nodes
    }


def test_the_lab_expects_what_the_firewall_does_between_the_pools():
    expected = lab_node_expectations(ONPREM_DISAGGREGATED)
    assert expected[("worker-3", "worker-2", "kv-side-channel", 5600)] is False  # the same pool
    assert expected[("worker-3", "worker-2", "kv-data", 5680)] is False
    assert expected[("worker-3", "master", "kv-side-channel", 5600)] is True  # the other pool
    assert expected[("master", "worker-3", "kv-data", 5601)] is True
    assert expected[("worker-3", "worker-2", "inter-node", 6000)] is True  # not NIXL's: the member rule
    # NIXL's rows closed for every pair within a pool, both ways, and open across; every other
    # row open between every pair.
    pool_of = ONPREM_DISAGGREGATED.serving.pool_of
    for (source, target, row, _port), is_open in expected.items():
        assert is_open is not (row in KV_ROWS and pool_of(source) == pool_of(target)), (source, target, row)
    # Aggregated: every member reaches every row of every other, as before.
    assert all(lab_node_expectations(ONPREM).values())
