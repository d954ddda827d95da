"""Topology: replicas, heads, and Ray/vLLM ports pinned inside the cluster range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qwen_cluster import topology
from qwen_cluster.config import validate
from qwen_cluster.ports import PortEntry, Scope


def cluster_entry(low: int, high: int) -> PortEntry:
    return PortEntry(name="inter-node", port=f"{low}-{high}", scope=Scope.CLUSTER)


@st.composite
def valid_ranges(draw):
    low = draw(st.integers(min_value=1024, max_value=65535 - topology.MIN_CLUSTER_PORTS + 1))
    high = draw(st.integers(min_value=low + topology.MIN_CLUSTER_PORTS - 1, max_value=65535))
    return low, high


@given(valid_ranges())
def test_pinned_ports_never_collide_and_stay_inside_the_range(bounds):
    low, high = bounds
    pinned = topology.pin_ports(cluster_entry(low, high))
    spans = sorted(pinned.named().values())
    for span in spans:
        assert low <= span.low <= span.high <= high
    for first, second in zip(spans, spans[1:], strict=False):
        assert not first.overlaps(second)
    assert pinned.workers.size >= topology.MIN_WORKER_PORTS
    assert low <= pinned.vllm_master <= high


@given(st.integers(min_value=1, max_value=topology.MIN_CLUSTER_PORTS - 1))
def test_a_range_too_small_is_refused_with_the_numbers(size):
    with pytest.raises(
        topology.TopologyError, match=f"holds {size} ports; pinning Ray and vLLM needs at least"
    ):
        topology.pin_ports(cluster_entry(7000, 7000 + size - 1))


def test_guide_range_pins_ray_then_vllms_master_port_from_the_bottom():
    pinned = topology.pin_ports(cluster_entry(6000, 6100))
    assert pinned.gcs == 6000
    assert (pinned.autoscaler_metrics, pinned.dashboard_metrics) == (6008, 6009)
    assert pinned.vllm_master == 6010
    assert str(pinned.workers) == "6011-6100"


def test_rays_two_metrics_servers_are_pinned_by_the_variables_ray_reads():
    pinned = topology.pin_ports(cluster_entry(6000, 6100))
    environment = pinned.ray_metrics_environment()
    assert environment == {"AUTOSCALER_METRIC_PORT": "6008", "DASHBOARD_METRIC_PORT": "6009"}


def test_no_ray_client_server_whose_flag_needs_grpcio():
    pinned = topology.pin_ports(cluster_entry(6000, 6100))
    assert not [flag for flag in pinned.ray_start_args(head=True) if "ray-client-server" in flag]
    assert "ray_client_server" not in pinned.named()


def test_ray_head_and_worker_flags_carry_every_pinned_port():
    pinned = topology.pin_ports(cluster_entry(6000, 6100))
    head = pinned.ray_start_args(head=True)
    worker = pinned.ray_start_args(head=False, head_ip="192.168.1.100")
    assert "--head" in head and "--port=6000" in head and "--dashboard-port=6003" in head
    assert worker[0] == "--address=192.168.1.100:6000"
    for flags in (head, worker):
        assert "--min-worker-port=6011" in flags and "--max-worker-port=6100" in flags
        assert "--node-manager-port=6001" in flags and "--object-manager-port=6002" in flags


def test_a_worker_needs_the_head_address():
    pinned = topology.pin_ports(cluster_entry(6000, 6100))
    with pytest.raises(topology.TopologyError):
        pinned.ray_start_args(head=False)


def test_one_replica_per_node_when_pipeline_parallel_is_one(bare_metal_raw):
    topo = validate(bare_metal_raw).topology
    assert len(topo.replicas) == 4
    assert [head.ip for head in topo.heads] == [
        "192.168.1.100",
        "192.168.1.101",
        "192.168.1.102",
        "192.168.1.103",
    ]


def test_pipeline_stages_group_consecutive_nodes_with_the_master_heading_replica_zero(bare_metal_raw):
    bare_metal_raw["nodes"] = [
        {"name": "worker-1", "ip": "192.168.1.101"},
        {"name": "master", "ip": "192.168.1.100", "role": "master"},
        {"name": "worker-2", "ip": "192.168.1.102"},
        {"name": "worker-3", "ip": "192.168.1.103"},
    ]
    bare_metal_raw["model"] = {"tensorParallel": 4, "pipelineParallel": 2}
    topo = validate(bare_metal_raw).topology
    assert [[m.name for m in r.members] for r in topo.replicas] == [
        ["master", "worker-1"],
        ["worker-2", "worker-3"],
    ]
    assert [h.name for h in topo.heads] == ["master", "worker-2"]
    assert topo.is_head("worker-2") and not topo.is_head("worker-1")
    assert topo.replica_of("worker-3").index == 1


def test_build_refuses_nodes_that_do_not_split():
    with pytest.raises(topology.TopologyError, match="3 nodes do not split into replicas of 2 nodes"):
        topology.build(
            [("a", "10.0.0.4", "master"), ("b", "10.0.0.5", "worker"), ("c", "10.0.0.6", "worker")],
            tensor_parallel=1,
            pipeline_parallel=2,
            model_port=5000,
            cluster_entry=cluster_entry(6000, 6100),
        )
