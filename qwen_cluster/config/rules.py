"""The rules between sections of the stack config (a node IP inside network.cidr, the
instance type's bandwidth against the floor, the memory rule, ...), and the rows of the port
table the monitoring pieces need.

Each rule reads sections that passed their own validation; a section that failed is None and
its rules are skipped, so one typo does not hide the other mistakes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from qwen_cluster import catalog, topology, world
from qwen_cluster import ports as port_table
from qwen_cluster.config import secrets
from qwen_cluster.config.limits import (
    AWS_RESERVED_HEAD,
    AWS_SUBNET_PREFIX,
    IDLE_TIMEOUT_LIMITS,
    MIN_NODES,
    RECOMMENDED_NODES,
)
from qwen_cluster.config.sections import (
    Access,
    AwsTarget,
    BareMetalTarget,
    LoadBalancer,
    Model,
    Monitoring,
    Network,
    Node,
    Serving,
    Target,
)

# The reserved-address message spells the count out; a new count fails here, not silently.
_RESERVED_HEAD_IN_WORDS = {4: "four"}[AWS_RESERVED_HEAD]


def _world_errors(access: Access) -> list[str]:
    """monitoringCidrs and adminCidrs are never the world, however it is spelled (qwen_cluster/world.py):
    one block that is the world by itself is named by its index, a list that is the world only
    together is named as a whole. clientCidrs may be the world (an internet-facing endpoint)."""
    errors = []
    for key, cidrs in (("monitoringCidrs", access.monitoring_cidrs), ("adminCidrs", access.admin_cidrs)):
        alone = [(index, cidr) for index, cidr in enumerate(cidrs) if world.is_world(cidr)]
        errors += [
            f"access.{key}[{index}] {cidr} opens to the whole internet; name the networks that need it"
            for index, cidr in alone
        ]
        for every in world.worlds(cidrs):
            if not any(cidr.version == every.version for _, cidr in alone):
                parts = ", ".join(str(cidr) for cidr in cidrs if cidr.version == every.version)
                errors.append(
                    f"access.{key} [{parts}] together cover every public {world.family(every)} address: "
                    "that opens to the whole internet; name the networks that need it"
                )
    return errors


def cross_errors(sections: Mapping[str, Any], given: set[str]) -> list[str]:
    """Rules between keys. `sections` maps attribute names to validated sections (None: failed
    its own validation, its rules are skipped); `given` names the config keys the user wrote."""
    errors: list[str] = []
    target: Target | None = sections.get("target")
    nodes: list[Node] | None = sections.get("nodes")
    network: Network | None = sections.get("network")
    table: list[port_table.PortEntry] | None = sections.get("ports")
    access: Access | None = sections.get("access")
    load_balancer: LoadBalancer | None = sections.get("load_balancer")
    model: Model | None = sections.get("model")
    aws: AwsTarget | None = sections.get("aws")
    bare_metal: BareMetalTarget | None = sections.get("bare_metal")
    monitoring: Monitoring | None = sections.get("monitoring")

    if nodes is not None:
        errors += _node_errors(nodes, network, target)
    if table is not None:
        errors += port_table.table_errors(table)
    if access is not None:
        errors += _endpoint_errors(access)
        errors += _world_errors(access)

    for chosen, own, other in ((Target.AWS, "aws", "bareMetal"), (Target.BARE_METAL, "bareMetal", "aws")):
        if target is chosen:
            if own not in given:
                errors.append(f"{own} is required when target is {chosen.value}")
            if other in given:
                errors.append(f"{other} is refused when target is {chosen.value} (remove the section)")

    if target is not None and load_balancer is not None:
        low, high = IDLE_TIMEOUT_LIMITS[target.value]
        if not low <= load_balancer.idle_timeout_seconds <= high:
            errors.append(
                f"loadBalancer.idleTimeoutSeconds {load_balancer.idle_timeout_seconds} "
                f"is outside {low}-{high}, what target {target.value} allows"
            )
    if target is Target.BARE_METAL and load_balancer is not None:
        if load_balancer.scheme != "internal":
            errors.append(
                f"loadBalancer.scheme {load_balancer.scheme} applies to target aws only; "
                "on bare metal clients reach nginx through access.clientCidrs"
            )
        if table is not None:
            for index, entry in enumerate(table):
                if load_balancer.port in entry.port:
                    errors.append(
                        f"loadBalancer.port {load_balancer.port} collides with "
                        f"ports[{index}] {entry.name} {entry.port} on the load-balancer node"
                    )
        if load_balancer.port == port_table.SSH_PORT:
            errors.append(f"loadBalancer.port {load_balancer.port} is the SSH port")

    if target is Target.BARE_METAL and model is not None and model.weights.source == "s3":
        errors.append(
            f"model.weights.source s3 ({model.weights.uri}) applies to target aws only: there the node "
            "role reads the prefix through the VPC's S3 endpoint. On bare metal use source mirror "
            "(an HF-compatible endpoint in reach) or hub; bareMetal.weightsCache keeps what was fetched"
        )
    if target is Target.AWS and aws is not None:
        errors += _aws_errors(aws, network, access)
    if target is Target.BARE_METAL and bare_metal is not None:
        errors += _bare_metal_errors(bare_metal, network, nodes)
    if target is Target.BARE_METAL and bare_metal is not None and nodes is not None:
        names = {node.name for node in nodes}
        errors += [
            f"bareMetal.hostKeys.{name} is not one of the nodes"
            for name in bare_metal.host_keys
            if name not in names
        ]
    if target is Target.BARE_METAL and access is not None and not access.admin_cidrs:
        errors.append(
            "access.adminCidrs is empty: the host firewall denies by default and would lock out "
            "SSH, pulumi's own connection included"
        )

    if monitoring is not None:
        errors += _monitoring_errors(monitoring, nodes, table)
        errors += _monitoring_password_errors(monitoring)
    serving: Serving | None = sections.get("serving")
    if load_balancer is not None:
        errors += _routing_errors(load_balancer, table, target, serving)
    if load_balancer is not None and model is not None and load_balancer.routing == "kv-aware":
        errors += _kv_block_size_errors(model)
    kv_aware = load_balancer is not None and load_balancer.routing == "kv-aware"
    if kv_aware and serving is not None and serving.mode == "disaggregated":
        # The kv_aware sources are keyed by the aggregated workers' URLs (render/router.py
        # kv_event_sources); the P/D router names its workers by the pools' listeners.
        errors.append(
            "loadBalancer.routing kv-aware with serving.mode disaggregated is not supported: the "
            "router's P/D mode routes each pool with cache-aware (set loadBalancer.routing "
            "cache-aware or least-conn)"
        )

    gpus, gpu_memory = None, None
    if target is Target.AWS and aws is not None and (kind := catalog.instance_type(aws.instance_type)):
        gpus, gpu_memory, where = kind.gpus, kind.gpu_memory_gb, f"aws.instanceType {kind.name}"
    elif target is Target.BARE_METAL and bare_metal is not None:
        gpus, gpu_memory, where = bare_metal.gpus_per_node, bare_metal.gpu_memory_gb, "bareMetal"
    if model is not None:
        errors += _model_errors(model, nodes, gpus, gpu_memory, where if gpus else "")
    if serving is not None and serving.mode == "disaggregated":
        errors += _serving_errors(serving, nodes, model, target, aws, bare_metal, table)
        if model is not None and nodes is not None:
            for pool in ("prefill", "decode"):
                tensor_parallel = serving.pool_tensor_parallel(pool, model.tensor_parallel)
                if getattr(serving, pool) is not None and tensor_parallel != model.tensor_parallel:
                    pooled = model.model_copy(update={"tensor_parallel": tensor_parallel})
                    errors += [
                        error.replace("model.tensorParallel", f"serving.{pool}.tensorParallel")
                        for error in _model_errors(pooled, nodes, gpus, gpu_memory, where if gpus else "")
                        if "tensorParallel" in error
                    ]
    elif serving is not None:
        errors += [
            f"serving.{key} is set but serving.mode is aggregated (set mode: disaggregated, or remove it)"
            for key in ("prefill", "decode")
            if getattr(serving, key) is not None
        ]
    if table is not None and not port_table.table_errors(table):
        try:
            topology.pin_ports(port_table.cluster_range(table))
        except topology.TopologyError as exc:
            errors.append(str(exc))
    return errors


def _endpoint_errors(access: Access) -> list[str]:
    """Keys, or an endpoint explicitly open: a stack never serves without keys by omission."""
    if access.open_endpoint and access.api_keys:
        return [
            f"access.openEndpoint is true but access.apiKeys holds {len(access.api_keys)} keys: "
            "remove one or the other"
        ]
    if not access.open_endpoint and not access.api_keys:
        return [
            "access.apiKeys is empty: clients would reach the model without a key. Set one with "
            f'`{secrets.set_command(secrets.API_KEYS_PATH)} "$(openssl rand -hex 32)"`, or say the '
            "endpoint is open with access.openEndpoint: true"
        ]
    return []


def _monitoring_password_errors(monitoring: Monitoring) -> list[str]:
    """A password, or a monitoring surface explicitly open: as the API keys, never open by omission
    (whoever reaches Alertmanager unauthenticated can silence every alert)."""
    if monitoring.open_to_monitoring_cidrs and monitoring.password is not None:
        return [
            "monitoring.openToMonitoringCidrs is true but monitoring.password is set: remove one or the other"
        ]
    if monitoring.prometheus and monitoring.password is None and not monitoring.open_to_monitoring_cidrs:
        return [
            "monitoring.password is not set: Prometheus and Alertmanager would answer anyone in "
            "access.monitoringCidrs, who could silence any alert. Set it with "
            f'`{secrets.set_command(secrets.MONITORING_PASSWORD_PATH)} "$(openssl rand -hex 24)"`, or say '
            "the monitoring surface is open with monitoring.openToMonitoringCidrs: true"
        ]
    return []


def _node_errors(nodes: list[Node], network: Network | None, target: Target | None) -> list[str]:
    errors: list[str] = []
    if len(nodes) < MIN_NODES:
        errors.append(
            f"nodes has {len(nodes)} entries; the cluster needs at least {MIN_NODES} "
            f"({RECOMMENDED_NODES} or more recommended)"
        )
    masters = [f"nodes[{i}]" for i, node in enumerate(nodes) if node.role == "master"]
    if len(masters) != 1:
        errors.append(f"nodes has {len(masters)} masters {masters}; exactly one node needs role: master")
    names: dict[str, int] = {}
    ips: dict[ipaddress.IPv4Address, int] = {}
    for index, node in enumerate(nodes):
        if node.name in names:
            errors.append(f"nodes[{index}].name {node.name} is used already by nodes[{names[node.name]}]")
        names.setdefault(node.name, index)
        if node.ip in ips:
            errors.append(f"nodes[{index}].ip {node.ip} is used already by nodes[{ips[node.ip]}]")
        ips.setdefault(node.ip, index)
        if network is None:
            continue
        cidr = network.cidr
        if node.ip not in cidr:
            errors.append(f"nodes[{index}].ip {node.ip} is outside network.cidr {cidr}")
        elif node.ip in (cidr.network_address, cidr.broadcast_address):
            what = "network" if node.ip == cidr.network_address else "broadcast"
            errors.append(f"nodes[{index}].ip {node.ip} is the {what} address of network.cidr {cidr}")
        elif target is Target.AWS and (int(node.ip) - int(cidr.network_address) < AWS_RESERVED_HEAD):
            errors.append(
                f"nodes[{index}].ip {node.ip} is one of the first {_RESERVED_HEAD_IN_WORDS} addresses of "
                f"{cidr}, which AWS reserves"
            )
    return errors


def _aws_errors(aws: AwsTarget, network: Network | None, access: Access | None) -> list[str]:
    errors: list[str] = []
    kind = catalog.instance_type(aws.instance_type)
    if kind is None:
        known = ", ".join(catalog.INSTANCE_TYPES)
        errors.append(
            f"aws.instanceType {aws.instance_type} is not in the catalog "
            f"(qwen_cluster/catalog.py; known: {known})"
        )
    else:
        if kind.gpus == 0:
            errors.append(f"aws.instanceType {kind.name} has no GPU")
        if network is not None and kind.baseline_gbps < network.min_bandwidth_gbps:
            errors.append(
                f"aws.instanceType {kind.name} has a baseline of {kind.baseline_gbps:g} "
                f"Gbit/s ({kind.bandwidth}), below network.minBandwidthGbps "
                f"{network.min_bandwidth_gbps:g}"
            )
        if aws.efa and not kind.efa:
            errors.append(f"aws.efa is true but aws.instanceType {kind.name} has no EFA support")
    if network is not None:
        low, high = AWS_SUBNET_PREFIX
        if not low <= network.cidr.prefixlen <= high:
            errors.append(
                f"network.cidr {network.cidr} is a /{network.cidr.prefixlen}; an AWS "
                f"subnet is /{low} to /{high}"
            )
        elif network.cidr.prefixlen <= AWS_SUBNET_PREFIX[0]:
            # The public subnets (NAT, bastion, internet-facing LB) are carved next to
            # network.cidr inside a larger block, and a VPC is at most a /16.
            errors.append(
                f"network.cidr {network.cidr} is a /{network.cidr.prefixlen}, as large as a VPC "
                f"can be; use a /{AWS_SUBNET_PREFIX[0] + 1} or smaller so the VPC has room for "
                "the public subnets beside it"
            )
    if aws.bastion and access is not None and not access.admin_cidrs:
        errors.append("aws.bastion is true but access.adminCidrs is empty: nobody could reach it")
    return errors


def _bare_metal_errors(
    bare_metal: BareMetalTarget, network: Network | None, nodes: list[Node] | None
) -> list[str]:
    errors: list[str] = []
    if network is not None and bare_metal.nic_speed_gbps < network.min_bandwidth_gbps:
        errors.append(
            f"bareMetal.nicSpeedGbps {bare_metal.nic_speed_gbps:g} is below "
            f"network.minBandwidthGbps {network.min_bandwidth_gbps:g}"
        )
    lb_node = bare_metal.load_balancer_node
    if nodes is not None and lb_node is not None and lb_node not in {node.name for node in nodes}:
        errors.append(f"bareMetal.loadBalancerNode {bare_metal.load_balancer_node} is not one of the nodes")
    return errors


def monitoring_rows(monitoring: Monitoring) -> list[tuple[str, str]]:
    """(monitoring key, ports row name) of every table row the monitoring pieces need."""
    rows = []
    if monitoring.exporters:
        rows.append(("exporters", port_table.MONITORING_ENDPOINT))
    if monitoring.prometheus:
        rows += [("prometheus", port_table.PROMETHEUS), ("prometheus", port_table.ALERTMANAGER)]
    return rows


def _has_row(table: list[port_table.PortEntry], name: str) -> bool:
    return any(entry.name == name for entry in table)


def _default_row(name: str) -> port_table.PortEntry:
    return next(entry for entry in port_table.DEFAULT_PORTS if entry.name == name)


def _runs_router(load_balancer: LoadBalancer | None, serving: Serving | None) -> bool:
    """vLLM's router runs: cache-aware routing, or disaggregated serving (the router in P/D mode)."""
    routed = load_balancer is not None and load_balancer.routed
    return routed or (serving is not None and serving.mode == "disaggregated")


def kv_rows(serving: Serving | None, target: Target | None) -> list[port_table.PortEntry]:
    """The rows disaggregated serving needs: the NIXL side channel, and UCX's data range where the
    backend is ucx (bare metal by default)."""
    if serving is None or serving.mode != "disaggregated":
        return []
    rows = [port_table.KV_SIDE_CHANNEL_ROW]
    if serving.kv_transfer.backend_on(aws=target is Target.AWS) == "ucx":
        rows.append(port_table.KV_DATA_ROW)
    return rows


def complete_ports(
    table: list[port_table.PortEntry],
    monitoring: Monitoring,
    load_balancer: LoadBalancer | None = None,
    target: Target | None = None,
    serving: Serving | None = None,
) -> list[port_table.PortEntry]:
    """A written table that lacks a row monitoring needs gets it with the default port, unless
    that port is taken (then _monitoring_errors says which row to write). The guide's table has
    8000 only; Prometheus and Alertmanager are this project's, so a stack that copied the guide
    keeps working. To move one, write its row; to have none, turn the piece off. Likewise the
    router's row (ports.ROUTER_ROW) with loadBalancer.routing cache-aware or kv-aware, the table
    given or not, on aws the row of the node proxies' listener for the router
    (ports.ROUTER_WORKER_ROW), and with kv-aware the replicas' KV-event publishers'
    (ports.KV_EVENTS_ROW)."""
    result = list(table)
    wanted = [_default_row(name) for _, name in monitoring_rows(monitoring)]
    wanted += _routing_rows(load_balancer, target, serving)
    wanted += kv_rows(serving, target)
    for default in wanted:
        if not _has_row(result, default.name) and not any(e.port.overlaps(default.port) for e in result):
            result.append(default)
    return result


def _routing_rows(
    load_balancer: LoadBalancer | None, target: Target | None, serving: Serving | None = None
) -> list[port_table.PortEntry]:
    """The rows vLLM's router needs (each a single port with scope cluster): a routed
    loadBalancer.routing, or serving.mode disaggregated (the router in P/D mode)."""
    if not _runs_router(load_balancer, serving):
        return []
    rows = [port_table.ROUTER_ROW]
    if target is Target.AWS:
        rows.append(port_table.ROUTER_WORKER_ROW)
    if load_balancer is not None and load_balancer.routing == "kv-aware":
        rows.append(port_table.KV_EVENTS_ROW)
    return rows


# Why each routing row must be a single port with scope cluster.
_ROUTING_ROW_WHY = {
    port_table.ROUTER: "the router's admin routes share its listener",
    port_table.ROUTER_WORKER: "the proxies check no key there",
    port_table.KV_EVENTS: "the replicas' KV-cache events carry every prompt's token ids",
}


def _routing_errors(
    load_balancer: LoadBalancer,
    table: list[port_table.PortEntry] | None,
    target: Target | None,
    serving: Serving | None = None,
) -> list[str]:
    """A routed loadBalancer.routing needs the router's row (single port, scope cluster: its
    listener also serves the admin routes) and its loopback metrics port clear of the table; on
    aws also the row where each node's proxy listens for the router (single port, scope cluster:
    no key is checked there); kv-aware also the replicas' KV-event row (single port, scope
    cluster: the events carry the prompts' token ids), docs/routing.md. The same rows for
    serving.mode disaggregated, whose router runs in P/D mode."""
    if not _runs_router(load_balancer, serving) or table is None:
        return []
    errors: list[str] = []
    routed = load_balancer.routed
    routing = f"loadBalancer.routing {load_balancer.routing}" if routed else "serving.mode disaggregated"
    for default in _routing_rows(load_balancer, target, serving):
        name = default.name
        found = next((entry for entry in table if entry.name == name), None)
        if found is None:
            errors.append(_missing_row(f"{routing} needs", default, table))
        elif found.scope is not port_table.Scope.CLUSTER or found.port.size != 1:
            errors.append(
                f"ports entry {name} ({found.port}, scope {found.scope.value}) must be a single port "
                f"with scope cluster for {routing}: {_ROUTING_ROW_WHY[name]}, so no client may "
                "reach it"
            )
    for index, entry in enumerate(table):
        if port_table.ROUTER_METRICS_PORT in entry.port:
            errors.append(
                f"ports[{index}].port {entry.port} ({entry.name}) includes "
                f"{port_table.ROUTER_METRICS_PORT}, where the router's metrics listen on loopback "
                f"({routing})"
            )
    return errors


def _kv_block_size_errors(model: Model) -> list[str]:
    """kv-aware routing renders model.vllmFlags `--block-size` on the router as well
    (`--kv-event-block-size`), so it must be a whole number of tokens the router can take."""
    given = model.vllm_flags.get("--block-size")
    if given is None or (isinstance(given, int) and not isinstance(given, bool) and given > 0):
        return []
    if isinstance(given, str) and given.isdigit() and int(given) > 0:
        return []
    return [
        f"model.vllmFlags --block-size {given!r} must be a positive whole number of tokens for "
        "loadBalancer.routing kv-aware (the router's --kv-event-block-size takes the same number)"
    ]


def _missing_row(who: str, default: port_table.PortEntry, table: list[port_table.PortEntry]) -> str:
    """A feature's row is absent from a custom table because another row took its default port
    (an absent row is otherwise filled in with its default): name both, and the row to add."""
    clash = next((entry for entry in table if entry.port.overlaps(default.port)), None)
    taken = f"{clash.name} ({clash.port})" if clash else "?"
    return (
        f"{who} a ports entry named {default.name}, and its default port {default.port} is taken by "
        f"{taken}; add {{name: {default.name}, port: <free port>, scope: {default.scope.value}, "
        "required: false}"
    )


def _monitoring_errors(
    monitoring: Monitoring, nodes: list[Node] | None, table: list[port_table.PortEntry] | None
) -> list[str]:
    errors: list[str] = []
    if nodes is not None and monitoring.node is not None and monitoring.node not in {n.name for n in nodes}:
        errors.append(f"monitoring.node {monitoring.node} is not one of the nodes")
    where = monitoring.node or next((n.name for n in nodes or () if n.role == "master"), None)
    address = next((str(n.ip) for n in nodes or () if n.name == where), None)
    names = monitoring.tls.names if monitoring.tls is not None else None
    # A certificate naming only RFC 2606's reserved `.invalid` names stands for no server: the
    # offline tools' placeholder (tooling/stackfile.py), never served.
    placeholder = bool(names) and all(name.endswith(".invalid") for name in names or ())
    if names is not None and address and address not in names and not placeholder:
        errors.append(
            f"monitoring.tls.certificate does not name {address}, the address of monitoring.node {where} "
            f"(its subjectAltName holds {', '.join(names) or 'nothing'}): Prometheus, doctor and "
            f"operators connect there and would refuse it; issue it with subjectAltName IP:{address}"
        )
    if monitoring.prometheus and monitoring.password is not None and monitoring.tls is None:
        # Basic auth over plain HTTP hands the password to anyone on the path (docs/security.md).
        errors.append(
            "monitoring.password is set without monitoring.tls: the password would cross the network in "
            "clear; set monitoring.tls (`pulumi config set --secret --path "
            "'qwen-cluster:monitoring.tls.certificate' < chain.pem`, the same for `privateKey` < key.pem, "
            "and `pulumi config set --path 'qwen-cluster:monitoring.tls.caCertificate' < ca.pem`)"
        )
    if table is None:
        return errors
    for key, name in monitoring_rows(monitoring):
        found = next(entry for entry in table if entry.name == name) if _has_row(table, name) else None
        if found is None:
            errors.append(_missing_row(f"monitoring.{key} is true but needs", _default_row(name), table))
        elif found.scope is not port_table.Scope.MONITORING or found.port.size != 1:
            errors.append(
                f"ports entry {name} ({found.port}, scope {found.scope.value}) must be a single "
                f"port with scope monitoring for monitoring.{key}"
            )
    # The exporters behind the endpoint listen on loopback; a table port there would collide.
    for index, entry in enumerate(table):
        for what, port in port_table.MONITORING_LOOPBACK_PORTS.items():
            if (monitoring.exporters or monitoring.prometheus) and port in entry.port:
                errors.append(
                    f"ports[{index}].port {entry.port} ({entry.name}) includes {port}, where the "
                    f"{what} listens on each node's loopback"
                )
    return errors


def _model_errors(
    model: Model, nodes: list[Node] | None, gpus: int | None, gpu_memory: float | None, where: str
) -> list[str]:
    errors: list[str] = []
    weights = catalog.MODELS.get(model.name)
    if weights is None:
        errors.append(f"model.name {model.name} is not in the catalog (known: {', '.join(catalog.MODELS)})")
    elif weights.attention_heads % model.tensor_parallel:
        errors.append(
            f"model.tensorParallel {model.tensor_parallel} does not divide "
            f"{model.name}'s {weights.attention_heads} attention heads"
        )
    if nodes is not None and len(nodes) % model.pipeline_parallel:
        errors.append(
            f"model.pipelineParallel {model.pipeline_parallel} does not divide the "
            f"{len(nodes)} nodes into whole replicas"
        )
    if gpus is not None and model.tensor_parallel > gpus:
        errors.append(
            f"model.tensorParallel {model.tensor_parallel} is more than the {gpus} GPUs per node of {where}"
        )
    if weights is not None and gpu_memory is not None:
        have = model.tensor_parallel * model.pipeline_parallel * gpu_memory
        need = catalog.replica_memory_needed_gb(weights.weights_gb)
        if have < need:
            errors.append(
                f"model.tensorParallel {model.tensor_parallel} x pipelineParallel "
                f"{model.pipeline_parallel} x {gpu_memory:g} GB ({where}) = {have:g} GB per "
                f"replica; {model.name} needs {need:g} GB ({weights.weights_gb:g} GB of weights "
                f"at most {catalog.WEIGHTS_SHARE:.0%} of {catalog.GPU_MEMORY_UTILIZATION:.0%} of "
                "GPU memory, the rest for the KV cache)"
            )
    return errors


def _serving_errors(
    serving: Serving,
    nodes: list[Node] | None,
    model: Model | None,
    target: Target | None,
    aws: AwsTarget | None,
    bare_metal: BareMetalTarget | None,
    table: list[port_table.PortEntry] | None,
) -> list[str]:
    """serving.mode disaggregated: two pools that split the nodes, a backend the target's network
    carries, and the rows NIXL listens on (docs/disaggregation.md)."""
    errors: list[str] = []
    names = [node.name for node in nodes] if nodes is not None else None
    pools = {pool: getattr(serving, pool) for pool in ("prefill", "decode")}
    for pool, section in pools.items():
        if section is None:
            errors.append(f"serving.{pool} is required when serving.mode is disaggregated (give its nodes)")
        elif not section.nodes:
            errors.append(f"serving.{pool}.nodes is empty: each pool needs at least one node")
        elif names is not None:
            errors += [
                f"serving.{pool}.nodes[{index}] {name} is not one of the nodes"
                for index, name in enumerate(section.nodes)
                if name not in names
            ]
            errors += [
                f"serving.{pool}.nodes lists {name} more than once"
                for name in sorted({name for name in section.nodes if section.nodes.count(name) > 1})
            ]
    if pools["decode"] is not None and pools["decode"].tokens_per_second_per_gpu is not None:
        errors.append(
            "serving.decode.tokensPerSecondPerGpu applies to the prefill pool only (the rate the KV is "
            "made at)"
        )
    if pools["prefill"] is not None and pools["decode"] is not None:
        both = sorted(set(pools["prefill"].nodes) & set(pools["decode"].nodes))
        errors += [f"node {name} is in both serving.prefill and serving.decode" for name in both]
        if names is not None:
            pooled = set(pools["prefill"].nodes) | set(pools["decode"].nodes)
            idle = [name for name in names if name not in pooled]
            if idle:
                errors.append(
                    f"nodes {', '.join(idle)} are in neither serving.prefill nor serving.decode: every node "
                    "serves in one pool"
                )
    if model is not None and model.pipeline_parallel != 1:
        errors.append(
            f"serving.mode disaggregated needs model.pipelineParallel 1 (it is {model.pipeline_parallel}): "
            "each pool's replica is one node, and NIXL hands the KV from one node's ranks to another's"
        )
    if names is not None:
        errors += [
            f"serving.kvTransfer.sideChannelHosts.{name} is not one of the nodes"
            for name in serving.kv_transfer.side_channel_hosts
            if name not in names
        ]
    backend = serving.kv_transfer.backend_on(aws=target is Target.AWS)
    if target is Target.AWS and aws is not None:
        if not aws.efa:
            errors.append(
                "serving.mode disaggregated on aws needs aws.efa true: without EFA NIXL moves the KV over "
                "TCP, which the field reports as effectively unusable (~98 s to the first token on "
                "p5.48xlarge, NVIDIA Dynamo's communication guide)"
            )
        if backend == "ucx":
            errors.append(
                "serving.kvTransfer.backend ucx on aws: NIXL's UCX backend does not connect across nodes on "
                "EFA; use libfabric (NIXL's EFA backend)"
            )
    if target is Target.BARE_METAL and backend == "libfabric":
        errors.append(
            "serving.kvTransfer.backend libfabric on bare metal: the program drives LIBFABRIC only on EFA "
            "(aws); racks use ucx (RoCE or InfiniBand, TCP without tuning.rdma)"
        )
    if (
        target is Target.BARE_METAL
        and bare_metal is not None
        and bare_metal.gpu_model is None
        and pools["prefill"] is not None
        and pools["prefill"].tokens_per_second_per_gpu is None
    ):
        errors.append(
            "serving.mode disaggregated on bare metal needs bareMetal.gpuModel (one of "
            f"{', '.join(catalog.GPUS)}) or serving.prefill.tokensPerSecondPerGpu: the link floor is "
            "derived from the prefill rate"
        )
    if table is not None:
        errors += _kv_row_errors(serving, target, table, model)
    return errors


def _kv_row_errors(
    serving: Serving, target: Target | None, table: list[port_table.PortEntry], model: Model | None
) -> list[str]:
    """The side channel is one port and the UCX range holds five ports per tensor-parallel rank,
    both member-only (scope cluster)."""
    errors: list[str] = []
    for default in kv_rows(serving, target):
        found = next((entry for entry in table if entry.name == default.name), None)
        if found is None:
            errors.append(_missing_row("serving.mode disaggregated needs", default, table))
            continue
        if found.scope is not port_table.Scope.CLUSTER:
            errors.append(
                f"ports entry {found.name} ({found.port}, scope {found.scope.value}) must have scope "
                "cluster: only the other pool's nodes may reach NIXL"
            )
        if default.name == port_table.KV_SIDE_CHANNEL and found.port.size != 1:
            errors.append(
                f"ports entry {found.name} ({found.port}) must be a single port: vLLM's side channel is "
                "VLLM_NIXL_SIDE_CHANNEL_PORT"
            )
        if default.name == port_table.KV_DATA and model is not None:
            ranks = max(
                serving.pool_tensor_parallel(pool, model.tensor_parallel) for pool in ("prefill", "decode")
            )
            needed = ranks * port_table.UCX_PORTS_PER_PROCESS
            if found.port.size < needed:
                errors.append(
                    f"ports entry {found.name} ({found.port}) holds {found.port.size} ports; UCX takes "
                    f"{port_table.UCX_PORTS_PER_PROCESS} per process and a node runs {ranks} (its tensor "
                    f"parallel): give it at least {needed}"
                )
    return errors
