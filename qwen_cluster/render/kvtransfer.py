"""What a node of a disaggregated stack passes to vLLM for NIXL: its `--kv-transfer-config` (producer
on the prefill pool, consumer on the decode pool) and the environment of its side channel and
transport. Pure: data. Both targets' model servers and the lab's take them from here.

Signatures:
    role(pool: str) -> str                                   kv_producer | kv_consumer
    kv_transfer_config(pool, *, connector, backend, load_failure_policy, buffer_device) -> dict
    kv_transfer_flag(config: dict) -> str                     the flag's JSON value, compact and sorted
    environment(*, side_channel_host, side_channel_port, backend, ucx_port_range, tcp, tcp_device) -> dict
    over_tcp(cluster) -> bool                                 UCX over TCP: ucx without tuning.rdma
    for_node(cluster, node, *, tcp_device=None, tcp=None) -> tuple[dict, dict] | None
                                                              (kv-transfer-config, environment) or None

Checked against vLLM's source (the CPU build 0.32.0's wheel; the same files at v0.33.0):
- vllm/config/kv_transfer.py KVTransferConfig: kv_connector, kv_role (kv_producer, kv_consumer,
  kv_both), kv_buffer_device, kv_connector_extra_config, kv_load_failure_policy ("recompute" or
  "fail", default "fail");
- nixl/base_worker.py reads kv_connector_extra_config["backends"] (default ["UCX"]) into
  nixl_agent_config(backends=...);
- vllm/envs.py VLLM_NIXL_SIDE_CHANNEL_HOST (default "localhost") and VLLM_NIXL_SIDE_CHANNEL_PORT
  (default 5600); nixl/base_scheduler.py binds and advertises host:port + data-parallel index.
"""

from __future__ import annotations

import json

from qwen_cluster import ports as port_table
from qwen_cluster.config.sections import KV_BACKENDS, KV_CONNECTORS

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Where NIXL registers the KV cache: the GPU's own memory on a GPU node (GPUDirect RDMA over EFA or
# RoCE/InfiniBand reads it in place). The lab's CPU build has only host memory: it passes "cpu", the
# one departure, made in labkit/engine/substitutions.py.
GPU_BUFFER_DEVICE = "cuda"


def role(pool: str) -> str:
    if pool not in ROLES:
        raise ValueError(f"unknown pool {pool!r} (prefill or decode)")
    return ROLES[pool]


def kv_transfer_config(
    pool: str,
    *,
    connector: str,
    backend: str,
    load_failure_policy: str,
    buffer_device: str = GPU_BUFFER_DEVICE,
) -> dict:
    """vLLM's --kv-transfer-config for a node of `pool`."""
    return {
        "kv_connector": KV_CONNECTORS[connector],
        "kv_role": role(pool),
        "kv_buffer_device": buffer_device,
        "kv_load_failure_policy": load_failure_policy,
        "kv_connector_extra_config": {"backends": [KV_BACKENDS[backend]]},
    }


def kv_transfer_flag(config: dict) -> str:
    """The flag's value: compact, keys sorted, so the same config renders the same bytes."""
    return json.dumps(config, separators=(",", ":"), sort_keys=True)


def environment(
    *,
    side_channel_host: str,
    side_channel_port: int,
    backend: str,
    ucx_port_range: port_table.PortRange | None = None,
    tcp: bool = False,
    tcp_device: str | None = None,
) -> dict[str, str]:
    """The model server's environment for NIXL.

    - The side channel binds and advertises `side_channel_host` (never loopback: the config refuses it).
    - ucx: UCX_TCP_PORT_RANGE pins what UCX's TCP transport listens on into the `kv-data` row. With
      `tcp` (no RDMA: the lab, a rack without tuning.rdma) UCX is told to use TCP only (UCX_TLS=tcp),
      on `tcp_device` when it is known here (UCX_NET_DEVICES; otherwise the model server's prelude
      sets it from the one NIC finder when the container starts, collective.interface_prelude);
      without `tcp` UCX picks the RDMA devices itself.
    - libfabric: FI_PROVIDER=efa, so libfabric never falls back to its TCP or shared-memory
      providers on a node whose EFA device is missing (a silent fallback would be a slow cluster,
      not an error).
    """
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
    }
    if backend == "ucx":
        if ucx_port_range is not None:
            env["UCX_TCP_PORT_RANGE"] = f"{ucx_port_range.low}-{ucx_port_range.high}"
        if tcp or tcp_device:
            env["UCX_TLS"] = "tcp"
        if tcp_device:
            env["UCX_NET_DEVICES"] = tcp_device
    elif backend == "libfabric":
        env["FI_PROVIDER"] = "efa"
    else:
        raise ValueError(f"unknown backend {backend!r} (libfabric or ucx)")
    return env


def over_tcp(cluster) -> bool:
    """UCX moves the KV over TCP: the ucx backend on a stack without tuning.rdma (no RoCE or
    InfiniBand verbs for UCX to find)."""
    return cluster.kv_backend == "ucx" and not cluster.tuning.rdma


def for_node(
    cluster, node, *, tcp_device: str | None = None, tcp: bool | None = None
) -> tuple[dict, dict[str, str]] | None:
    """(kv-transfer-config, environment) for `node` of a validated disaggregated ClusterConfig, or
    None (aggregated). `tcp_device`: the cluster NIC, when UCX is to run over TCP; `tcp`: whether it
    does (default: `tcp_device` given, or over_tcp)."""
    pool = cluster.serving.pool_of(node.name)
    if pool is None:
        return None
    transfer = cluster.serving.kv_transfer
    backend = cluster.kv_backend
    config = kv_transfer_config(
        pool,
        connector=transfer.connector,
        backend=backend,
        load_failure_policy=transfer.load_failure_policy,
    )
    data = next((entry.port for entry in cluster.ports if entry.name == port_table.KV_DATA), None)
    env = environment(
        side_channel_host=cluster.kv_side_channel_host(node),
        side_channel_port=port_table.port_of(cluster.ports, port_table.KV_SIDE_CHANNEL),
        backend=backend,
        ucx_port_range=data,
        tcp=(over_tcp(cluster) or tcp_device is not None) if tcp is None else tcp,
        tcp_device=tcp_device,
    )
    return config, env
