"""doctor on a disaggregated stack: the KV link floor from the stack alone, and NIXL's ports and
side-channel hosts named by the hosts' verify scripts, each with its fix."""

from __future__ import annotations

import subprocess

from qwen_cluster.config import validate
from qwen_cluster.render import verify
from tests.helpers.baremetal import ONPREM_DISAGGREGATED, disaggregated_stack
from tests.helpers.configs import disaggregated
from tests.helpers.standin_server import free_port
from tooling import doctor, stackfile


def with_nics(gbps: int):
    stack = disaggregated_stack()
    stack["qwen-cluster:bareMetal"] = {**stack["qwen-cluster:bareMetal"], "nicSpeedGbps": gbps}
    return stackfile.validate(stack)


def test_a_link_below_the_kv_floor_is_named_with_the_figures_it_came_from():
    (found,) = doctor.config_findings(with_nics(25))
    assert found.check == "kv-link" and found.severity == "critical" and found.step == "bandwidth"
    assert "link floor 63.2 Gbit/s per node" in found.what and "one H100" in found.what
    assert "at least 63.2 Gbit/s per node" in found.fix
    assert found.where == ["master", "worker-1", "worker-2", "worker-3"]


def test_a_link_that_carries_the_kv_slowly_is_a_warning():
    (found,) = doctor.config_findings(with_nics(400))
    assert found.severity == "warning" and "16% of the prefill time" in found.what


def test_a_link_that_carries_the_kv_says_nothing():
    assert doctor.config_findings(ONPREM_DISAGGREGATED) == []
    assert doctor.config_findings(stackfile.load("onprem")) == []


def _run(text: str) -> list[str]:
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=60)
    return [line for line in done.stdout.splitlines() if line.startswith(doctor.MARK + "finding")]


def test_a_closed_side_channel_is_named_as_nixls_port_with_its_fix():
    closed = free_port()  # nothing listens: refused, where the model server must answer
    probe = verify.Probe("worker-2", "127.0.0.1", "master", "127.0.0.1", "kv-side-channel", closed, "service")
    (line,) = _run(verify.apply_script([probe], [], max_latency_ms=1, kv_pool="decode"))
    _, _, check, node, peer, detail = line.split("|", 5)
    found = doctor._finding(check, node, peer, detail)
    assert check == "kv-port" and found.severity == "critical"
    assert "kv-side-channel and kv-data rows must admit the other pool" in found.fix
    # Asked from the decode node, the port closed on the prefill node.
    assert found.fix.startswith(
        "telnet the port from worker-2 to master; ufw status / nft list ruleset on master"
    )


def test_aggregated_scripts_name_a_closed_port_as_before():
    closed = free_port()
    probe = verify.Probe("a", "127.0.0.1", "b", "127.0.0.1", "kv-side-channel", closed, "service")
    (line,) = _run(verify.apply_script([probe], [], max_latency_ms=1))
    assert line.split("|")[2] == "port"


def test_each_node_checks_the_side_channel_hosts_the_other_pool_advertises(bare_metal_raw):
    raw = disaggregated(bare_metal_raw, kvTransfer={"sideChannelHosts": {"master": "10.9.0.1"}})
    cluster = validate(raw)
    hosts = {
        (probe.source, probe.dest_ip)
        for probe in verify.cluster_probes(cluster)
        if probe.name == "kv-side-channel-host"
    }
    assert hosts == {("worker-2", "10.9.0.1"), ("worker-3", "10.9.0.1")}
    assert "10.9.0.1|kv-side-channel-host|5600|reachable" in verify.for_cluster(cluster, "worker-3")
    assert "|kv-side-channel-host|" not in verify.for_cluster(cluster, "worker-1")
