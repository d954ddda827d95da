"""A validated stack as plain data: what `make demo` prints and the program exports."""

from __future__ import annotations

from typing import Any

from qwen_cluster import ports as port_table
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import nginx, router
from qwen_cluster.render.vllm import HEALTH_PATH


def summary(cluster: ClusterConfig) -> dict[str, Any]:
    topology = cluster.topology
    spans_nodes = topology.pipeline_parallel > 1
    bandwidth_source = (
        f"{cluster.aws.instance_type} baseline ({cluster.instance.bandwidth})"
        if cluster.aws
        else "bareMetal.nicSpeedGbps (verified on the host at deploy time)"
    )
    return {
        "target": cluster.target.value,
        "nodes": [
            {"name": node.name, "ip": str(node.ip), "role": node.role, "head": topology.is_head(node.name)}
            for node in cluster.nodes
        ],
        "network": {
            "cidr": str(cluster.network.cidr),
            "minBandwidthGbps": cluster.network.min_bandwidth_gbps,
            "maxLatencyMs": cluster.network.max_latency_ms,
        },
        "bandwidthClass": {
            "gbps": cluster.bandwidth_gbps,
            "source": bandwidth_source,
            "floor": cluster.network.min_bandwidth_gbps,
            "efa": bool(cluster.aws and cluster.aws.efa),
        },
        "ports": [entry.model_dump(by_alias=True, mode="json") for entry in cluster.ports],
        "exposure": [
            {
                "name": rule.name,
                "target": rule.target.value,
                "from": rule.peer.value if not rule.cidrs else list(rule.cidrs),
                "ports": "all" if rule.ports is None else str(rule.ports),
                "protocol": rule.protocol,
            }
            for rule in cluster.exposures()
        ],
        "topology": {
            "replicas": len(topology.replicas),
            "tensorParallel": topology.tensor_parallel,
            "pipelineParallel": topology.pipeline_parallel,
            "gpusPerReplica": topology.tensor_parallel * topology.pipeline_parallel,
            "heads": [head.name for head in topology.heads],
            "loadBalancerTargets": [f"{head.ip}:{topology.model_port}" for head in topology.heads],
            "pinnedPorts": {name: str(span) for name, span in topology.ports.named().items()},
            # What a replica that spans nodes opens at a random port, reached by members only.
            "unpinnedClusterPorts": list(port_table.UNPINNED_CLUSTER_LISTENERS) if spans_nodes else [],
            "distributedBackend": cluster.model.distributed_backend if spans_nodes else None,
        },
        "model": {"name": cluster.model.name, "image": cluster.model.image},
        # What a client reaches (docs/endpoint.md); the keys themselves are never here.
        "endpoint": {
            "apiKeys": len(cluster.access.api_keys),
            "open": cluster.access.open_endpoint,
            "tls": cluster.load_balancer.tls is not None,
            "routes": [f"{route.method} {route.path}" for route in nginx.api_routes(cluster)]
            + [f"GET {HEALTH_PATH}"],
            # loadBalancer.routing; with cache-aware, where vLLM's router listens (docs/routing.md).
            "routing": cluster.load_balancer.routing,
            "router": _router(cluster),
        },
    }


def _router(cluster) -> dict | None:
    if not router.needs_router(cluster):
        return None
    server = router.api_address(cluster)
    absolute, relative = router.balance_thresholds(len(cluster.topology.heads))
    return {
        "image": router.IMAGE,
        "node": cluster.router_node.name,
        "listen": f"{server[0]}:{server[1]}",
        "balanceThresholds": {"absolute": absolute, "relative": relative},
    }
