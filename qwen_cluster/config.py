"""The stack config (`qwen-cluster:*` keys), validated into one ClusterConfig.

Every mistake in a config is reported at once, each naming its key path and value; a bad
config raises ConfigError before the program registers any resource.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from qwen_cluster import catalog
from qwen_cluster import ports as port_table

NAMESPACE = "qwen-cluster"
DEFAULT_SYSCTL: dict[str, int | str] = {
    "net.core.rmem_max": 16777216,
    "net.core.wmem_max": 16777216,
    "net.ipv4.tcp_fastopen": 3,
}
DEFAULT_MODEL = "Qwen/Qwen3-32B"
# Pinned: a moving tag would change every node on the next `pulumi up`.
DEFAULT_IMAGE = "vllm/vllm-openai:v0.11.0"
MIN_BANDWIDTH_GBPS = 10
# Extra `vllm serve` flags a Qwen3 deployment wants, per vLLM's docs for the pinned v0.11:
# - `--reasoning-parser qwen3`: thinking text comes back in `reasoning_content`, apart from the
#   answer (docs.vllm.ai/en/v0.11.0 features/reasoning_outputs, "Qwen3 series: qwen3";
#   vllm/reasoning/qwen3_reasoning_parser.py registers the name "qwen3").
# - `--max-model-len 32768`: Qwen3's pre-training context (QwenLM/Qwen3 docs, "The maximum
#   context length in pre-training for Qwen3 models is 32,768 tokens"); longer needs YaRN.
# `--served-model-name` defaults to model.name (qwen_cluster/render/vllm.py), so clients ask for
# the model by the name in the stack file whatever path vLLM loads it from.
DEFAULT_VLLM_FLAGS: dict[str, str | int] = {
    "--reasoning-parser": "qwen3",
    "--max-model-len": 32768,
}
# Flags the program sets from the config itself; a second value would contradict the port
# table, the topology or the memory plan (value: where the program takes it from).
OWNED_VLLM_FLAGS: dict[str, str] = {
    "--model": "model.name",
    "--host": "the program (all interfaces; the firewall and security groups decide who reaches it)",
    "--port": "ports (the clients entry)",
    "--tensor-parallel-size": "model.tensorParallel",
    "--pipeline-parallel-size": "model.pipelineParallel",
    "--data-parallel-size": "nodes / model.pipelineParallel (one replica per head node)",
    "--gpu-memory-utilization": "qwen_cluster/catalog.py GPU_MEMORY_UTILIZATION (the memory plan)",
    "--distributed-executor-backend": "model.pipelineParallel (ray across nodes, else multiprocessing)",
}
_VLLM_FLAG = re.compile(r"^--[a-z0-9]+(-[a-z0-9]+)*$")
# AWS: NLB TCP idle timeout (tcp.idle_timeout.seconds) is 60-6000 s. Bare metal: nginx
# proxy_read_timeout / proxy_send_timeout, bounded here at one day.
IDLE_TIMEOUT_LIMITS = {"aws": (60, 6000), "bare-metal": (1, 86400)}
# AWS: a subnet is /16 to /28; the first four and the last address are reserved
# (https://docs.aws.amazon.com/vpc/latest/userguide/subnet-sizing.html).
AWS_SUBNET_PREFIX = (16, 28)
AWS_RESERVED_HEAD = 4


class ConfigError(ValueError):
    """A stack config that cannot be deployed; `errors` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {error}" for error in self.errors)
        super().__init__(f"invalid stack config ({len(self.errors)} problems):\n{lines}")


class Target(StrEnum):
    AWS = "aws"
    BARE_METAL = "bare-metal"


def _ipv4_address(value: object) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(str(value).strip())
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 address") from None


def _ipv4_network(value: object) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(str(value).strip())
    except ipaddress.NetmaskValueError:
        raise ValueError(f"{value!r} has an invalid prefix length") from None
    except ValueError as exc:
        if "host bits set" in str(exc):
            fixed = ipaddress.IPv4Network(str(value).strip(), strict=False)
            raise ValueError(f"{value!r} has host bits set (did you mean {fixed}?)") from None
        raise ValueError(f"{value!r} is not an IPv4 network in CIDR notation") from None


def _any_network(value: object) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    text = str(value).strip()
    if "/" not in text:
        raise ValueError(f"{value!r} is not a CIDR block (write e.g. 10.0.0.0/8 or 203.0.113.10/32)")
    try:
        return ipaddress.ip_network(text)
    except ValueError as exc:
        if "host bits set" in str(exc):
            fixed = ipaddress.ip_network(text, strict=False)
            raise ValueError(f"{value!r} has host bits set (did you mean {fixed}?)") from None
        raise ValueError(f"{value!r} is not a CIDR block") from None


IPv4 = Annotated[ipaddress.IPv4Address, BeforeValidator(_ipv4_address), PlainSerializer(str)]
IPv4Net = Annotated[ipaddress.IPv4Network, BeforeValidator(_ipv4_network), PlainSerializer(str)]
Cidr = Annotated[
    ipaddress.IPv4Network | ipaddress.IPv6Network,
    BeforeValidator(_any_network),
    PlainSerializer(str),
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class Node(_Section):
    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    ip: IPv4
    role: Literal["master", "worker"] = "worker"


class Network(_Section):
    cidr: IPv4Net
    min_bandwidth_gbps: float = Field(default=MIN_BANDWIDTH_GBPS, ge=MIN_BANDWIDTH_GBPS)
    max_latency_ms: float = Field(default=1.0, gt=0)


class Access(_Section):
    client_cidrs: list[Cidr] = Field(min_length=1)
    monitoring_cidrs: list[Cidr] = []
    admin_cidrs: list[Cidr] = []


class LoadBalancer(_Section):
    port: int = Field(default=80, ge=1, le=65535)
    scheme: Literal["internal", "internet-facing"] = "internal"
    idle_timeout_seconds: int = Field(default=3600, ge=1)


def _pinned_image(value: object) -> object:
    if isinstance(value, str):
        name = value.rsplit("/", 1)[-1]
        if "@sha256:" not in value and (":" not in name or name.endswith(":latest")):
            raise ValueError(f"{value!r} is not pinned: give a version tag or an @sha256 digest")
    return value


VllmFlagValue = str | int | float | bool | None


def _vllm_flags(value: object) -> object:
    """Keys are long flags as vLLM spells them; the program's own flags are refused."""
    if not isinstance(value, Mapping):
        return value
    errors = []
    for key, val in value.items():
        key_text = str(key)
        if not _VLLM_FLAG.match(key_text):
            hint = key_text.replace("_", "-")
            hint = hint if hint.startswith("--") else f"--{hint.lstrip('-')}"
            errors.append(f"{key_text!r} is not a long vLLM flag (write it as {hint!r})")
        elif key_text in OWNED_VLLM_FLAGS:
            errors.append(
                f"{key_text} {val!r} is set by the program from {OWNED_VLLM_FLAGS[key_text]}; remove it"
            )
        elif isinstance(val, list | dict):
            errors.append(f"{key_text} {val!r}: give one value (JSON arguments as a string)")
    if errors:
        raise ValueError("; ".join(errors))
    return value


class Model(_Section):
    name: str = DEFAULT_MODEL
    image: Annotated[str, BeforeValidator(_pinned_image)] = DEFAULT_IMAGE
    tensor_parallel: int = Field(default=4, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    # Extra `vllm serve` flags, merged over DEFAULT_VLLM_FLAGS: a value replaces the default,
    # `true` is a bare switch, `false` or null drops the flag (a default too).
    vllm_flags: Annotated[dict[str, VllmFlagValue], BeforeValidator(_vllm_flags)] = {}


class Rollout(_Section):
    """How a Day-2 change rolls over the replicas (both targets): each replica is drained for
    at most drainTimeoutSeconds, then must answer vLLM's /health within healthTimeoutSeconds
    (weights load from the local cache; a cold download of 64 GB takes longer) before the
    next one starts."""

    drain_timeout_seconds: int = Field(default=300, ge=0, le=3600)
    health_timeout_seconds: int = Field(default=1800, ge=60, le=7200)


_SYSCTL_KEY = re.compile(r"^[a-z0-9_]+(\.[a-zA-Z0-9_-]+)+$")
_SYSCTL_VALUE = re.compile(r"^[A-Za-z0-9_ .:,-]+$")


def _sysctl_map(value: object) -> object:
    if isinstance(value, Mapping):
        bad = [f"{key!r}" for key in value if not _SYSCTL_KEY.match(str(key))]
        if bad:
            raise ValueError(f"{', '.join(bad)} not a sysctl key (dotted, e.g. net.core.rmem_max)")
        bad = [
            f"{key}={val!r}"
            for key, val in value.items()
            if isinstance(val, bool) or not _SYSCTL_VALUE.match(str(val))
        ]
        if bad:
            raise ValueError(f"{', '.join(bad)}: values are numbers or plain words")
    return value


class Monitoring(_Section):
    """Port 8000 on every node, and the cluster's own Prometheus + Alertmanager."""

    # The per-node endpoint (ports entry `monitoring`): host, GPU, vLLM and peer-probe metrics.
    exporters: bool = True
    # Prometheus + Alertmanager (ports entries `prometheus`, `alertmanager`) on `node`.
    prometheus: bool = True
    node: str | None = None  # default: the master
    scrape_interval_seconds: float = Field(default=15, ge=1, le=300)
    # Alert bounds (per replica): requests queued in vLLM, and the 99th percentile of the
    # time to first token over five minutes.
    max_requests_waiting: int = Field(default=50, ge=1)
    max_ttft_p99_seconds: float = Field(default=10.0, gt=0)
    # Optional: where Alertmanager posts alerts (a webhook receiver); without it alerts are
    # visible in Alertmanager's UI and to `scripts/doctor.py` only.
    webhook_url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")


class Tuning(_Section):
    sysctl: Annotated[dict[str, int | str], BeforeValidator(_sysctl_map)] = Field(
        default_factory=lambda: dict(DEFAULT_SYSCTL)
    )
    rdma: bool = True


class AwsTarget(_Section):
    instance_type: str
    availability_zone: str = Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
    efa: bool = True
    vpc_id: str | None = Field(default=None, pattern=r"^vpc-[0-9a-f]{8,17}$")
    ami_id: str | None = Field(default=None, pattern=r"^ami-[0-9a-f]{8,17}$")
    bastion: bool = False
    capacity_reservation_id: str | None = Field(default=None, pattern=r"^cr-[0-9a-f]{8,17}$")

    @property
    def region(self) -> str:
        return self.availability_zone[:-1]


_HOST_KEY = r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/=]+$"


class Bastion(_Section):
    """An SSH jump host between pulumi and the nodes (its address must be in adminCidrs)."""

    host: str = Field(pattern=r"^[A-Za-z0-9.:-]{1,253}$")
    user: str | None = Field(default=None, pattern=r"^[a-z_][a-z0-9_-]{0,31}$")  # default: sshUser
    port: int = Field(default=22, ge=1, le=65535)
    host_key: str | None = Field(default=None, pattern=_HOST_KEY)


class BareMetalTarget(_Section):
    ssh_user: str = Field(default="ubuntu", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")
    firewall: Literal["ufw", "firewalld", "nftables"] = "ufw"
    nic_speed_gbps: float = Field(gt=0)
    gpus_per_node: int = Field(ge=1)
    gpu_memory_gb: float = Field(gt=0)
    load_balancer_node: str | None = None  # default: the master
    # Optional: pin each node's SSH host key ("ssh-ed25519 AAAA..."), by node name.
    host_keys: dict[str, Annotated[str, Field(pattern=_HOST_KEY)]] = {}
    bastion: Bastion | None = None
    # Optional: the NIC for NCCL/Gloo; default: the one holding the node IP, found on the host.
    interface: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,15}$")


# Top-level keys: config key -> (attribute, type, required).
_SECTIONS: dict[str, tuple[str, Any, bool]] = {
    "target": ("target", Target, True),
    "nodes": ("nodes", list[Node], True),
    "network": ("network", Network, True),
    "ports": ("ports", list[port_table.PortEntry], False),
    "access": ("access", Access, True),
    "loadBalancer": ("load_balancer", LoadBalancer, False),
    "model": ("model", Model, False),
    "tuning": ("tuning", Tuning, False),
    "monitoring": ("monitoring", Monitoring, False),
    "rollout": ("rollout", Rollout, False),
    "aws": ("aws", AwsTarget, False),
    "bareMetal": ("bare_metal", BareMetalTarget, False),
}
SECRET_KEYS = ("sshPrivateKey",)
KNOWN_KEYS = (*_SECTIONS, *SECRET_KEYS)
_ADAPTERS = {key: TypeAdapter(kind) for key, (_, kind, _) in _SECTIONS.items()}


class ClusterConfig(_Section):
    target: Target
    nodes: list[Node]
    network: Network
    ports: list[port_table.PortEntry] = Field(default_factory=lambda: list(port_table.DEFAULT_PORTS))
    access: Access
    load_balancer: LoadBalancer = LoadBalancer()
    model: Model = Model()
    tuning: Tuning = Tuning()
    monitoring: Monitoring = Monitoring()
    rollout: Rollout = Rollout()
    aws: AwsTarget | None = None
    bare_metal: BareMetalTarget | None = None

    @model_validator(mode="after")
    def _cross_rules(self) -> ClusterConfig:
        errors = cross_errors({attr: getattr(self, attr) for attr, _, _ in _SECTIONS.values()})
        if errors:
            raise ValueError("; ".join(errors))
        return self

    # Derived facts the renderers share.
    @property
    def master(self) -> Node:
        return next(node for node in self.nodes if node.role == "master")

    @functools.cached_property
    def topology(self):
        """Computed once: the config is frozen, and renderers ask for it per node."""
        from qwen_cluster import topology

        return topology.for_config(self)

    @property
    def model_port(self) -> int:
        return port_table.model_port(self.ports)

    @property
    def load_balancer_node(self) -> Node | None:
        """The node nginx runs on (bare metal); None on AWS, where the NLB is managed."""
        if self.bare_metal is None:
            return None
        wanted = self.bare_metal.load_balancer_node or self.master.name
        return next(node for node in self.nodes if node.name == wanted)

    @property
    def instance(self) -> catalog.InstanceType | None:
        return catalog.instance_type(self.aws.instance_type) if self.aws else None

    @property
    def gpus_per_node(self) -> int:
        if self.aws:
            return self.instance.gpus
        return self.bare_metal.gpus_per_node

    @property
    def gpu_memory_gb(self) -> float:
        if self.aws:
            return self.instance.gpu_memory_gb
        return self.bare_metal.gpu_memory_gb

    @property
    def bandwidth_gbps(self) -> float:
        """The bandwidth class: the catalog's baseline on AWS, the declared NIC speed on bare metal."""
        if self.aws:
            return self.instance.baseline_gbps
        return self.bare_metal.nic_speed_gbps

    @property
    def monitoring_node(self) -> Node | None:
        """Where Prometheus and Alertmanager run; None when monitoring.prometheus is off."""
        if not self.monitoring.prometheus:
            return None
        wanted = self.monitoring.node or self.master.name
        return next(node for node in self.nodes if node.name == wanted)

    @property
    def ssh_to_nodes(self) -> bool:
        """SSH reaches the nodes only over an admin path: always on bare metal, a bastion on AWS."""
        return self.target is Target.BARE_METAL or bool(self.aws and self.aws.bastion)

    def exposures(self) -> list[port_table.Exposure]:
        return port_table.exposures(
            self.ports,
            listener_port=self.load_balancer.port,
            client_cidrs=tuple(str(c) for c in self.access.client_cidrs),
            monitoring_cidrs=tuple(str(c) for c in self.access.monitoring_cidrs),
            admin_cidrs=tuple(str(c) for c in self.access.admin_cidrs),
            ssh_to_nodes=self.ssh_to_nodes,
            ssh_via_bastion=bool(self.aws and self.aws.bastion),
        )


_WORLD = {ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")}


def cross_errors(sections: Mapping[str, Any], given: set[str] | None = None) -> list[str]:
    """Rules between keys. `sections` maps attribute names to validated sections; a section
    that failed its own validation is None and its rules are skipped, so that one typo does
    not hide the other mistakes. `given` names the config keys the user wrote."""
    if given is None:
        given = {key for key, (attr, _, _) in _SECTIONS.items() if sections.get(attr) is not None}
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
        for key, cidrs in (("monitoringCidrs", access.monitoring_cidrs), ("adminCidrs", access.admin_cidrs)):
            for index, cidr in enumerate(cidrs):
                if cidr in _WORLD:
                    errors.append(
                        f"access.{key}[{index}] {cidr} opens to the whole internet; "
                        "name the networks that need it"
                    )

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

    gpus, gpu_memory = None, None
    if target is Target.AWS and aws is not None and (kind := catalog.instance_type(aws.instance_type)):
        gpus, gpu_memory, where = kind.gpus, kind.gpu_memory_gb, f"aws.instanceType {kind.name}"
    elif target is Target.BARE_METAL and bare_metal is not None:
        gpus, gpu_memory, where = bare_metal.gpus_per_node, bare_metal.gpu_memory_gb, "bareMetal"
    if model is not None:
        errors += _model_errors(model, nodes, gpus, gpu_memory, where if gpus else "")
    if table is not None and not port_table.table_errors(table):
        # Imported here: topology builds on this module's types.
        from qwen_cluster import topology

        try:
            topology.pin_ports(port_table.cluster_range(table))
        except topology.TopologyError as exc:
            errors.append(str(exc))
    return errors


def _node_errors(nodes: list[Node], network: Network | None, target: Target | None) -> list[str]:
    errors: list[str] = []
    if len(nodes) < 2:
        errors.append(f"nodes has {len(nodes)} entries; the cluster needs at least 2 (4 or more recommended)")
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
                f"nodes[{index}].ip {node.ip} is one of the first four addresses of "
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


def complete_ports(table: list[port_table.PortEntry], monitoring: Monitoring) -> list[port_table.PortEntry]:
    """A written table that lacks a row monitoring needs gets it with the default port, unless
    that port is taken (then _monitoring_errors says which row to write). The guide's table has
    8000 only; Prometheus and Alertmanager are this project's, so a stack that copied the guide
    keeps working. To move one, write its row; to have none, turn the piece off."""
    result = list(table)
    for _, name in monitoring_rows(monitoring):
        default = _default_row(name)
        if not _has_row(result, name) and not any(entry.port.overlaps(default.port) for entry in result):
            result.append(default)
    return result


def _monitoring_errors(
    monitoring: Monitoring, nodes: list[Node] | None, table: list[port_table.PortEntry] | None
) -> list[str]:
    errors: list[str] = []
    if nodes is not None and monitoring.node is not None and monitoring.node not in {n.name for n in nodes}:
        errors.append(f"monitoring.node {monitoring.node} is not one of the nodes")
    if table is None:
        return errors
    for key, name in monitoring_rows(monitoring):
        found = next(entry for entry in table if entry.name == name) if _has_row(table, name) else None
        if found is None:
            default = _default_row(name)
            clash = next((entry for entry in table if entry.port.overlaps(default.port)), None)
            errors.append(
                f"monitoring.{key} is true but ports has no entry named {name} and its default port "
                f"{default.port} is taken by {clash.name if clash else '?'} ({clash.port if clash else ''}); "
                f"add {{name: {name}, port: <free port>, scope: monitoring, required: false}}"
            )
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


def _format_error(prefix: str, error: Mapping[str, Any]) -> str:
    path = prefix
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after", "function-before", "int", "str"):
            continue
        else:
            path += f".{part}" if path else str(part)
    kind = error["type"]
    message = str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    if kind == "extra_forbidden":
        return f"{path} is not a known key"
    if kind == "missing":
        return f"{path} is required"
    if kind == "value_error":
        return f"{path} {message}"
    return f"{path} {value!r}: {message}"


def validate(raw: Mapping[str, Any], *, aws_region: str | None = None) -> ClusterConfig:
    """Validate the raw config (keys without the namespace) or raise ConfigError with all
    problems. Each section is checked on its own, then the rules between sections run on
    the sections that passed, so one report lists every mistake."""
    errors: list[str] = []
    for key in raw:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            errors.append(f"{NAMESPACE}:{key} is not a known key{hint}")
    sections: dict[str, Any] = {}
    given: set[str] = set()
    for key, (attr, _, required) in _SECTIONS.items():
        if raw.get(key) is None:
            if required:
                errors.append(f"{key} is required")
            field = ClusterConfig.model_fields[attr]
            sections[attr] = None if required else field.get_default(call_default_factory=True)
            continue
        given.add(key)
        try:
            sections[attr] = _ADAPTERS[key].validate_python(raw[key])
        except ValidationError as exc:
            sections[attr] = None
            errors += [_format_error(key, error) for error in exc.errors()]
    if "ports" in given and sections.get("ports") is not None and sections.get("monitoring") is not None:
        sections["ports"] = complete_ports(sections["ports"], sections["monitoring"])
    errors += cross_errors(sections, given)
    chosen = sections.get("aws") if sections.get("target") is Target.AWS else None
    if aws_region and chosen is not None and chosen.region != aws_region:
        # The provider creates everything in aws:region; a zone elsewhere fails at the subnet.
        errors.append(f"aws.availabilityZone {chosen.availability_zone} is not in aws:region {aws_region}")
    if errors:
        raise ConfigError(errors)
    chosen_raw = {key: raw[key] for key in _SECTIONS if raw.get(key) is not None}
    if "ports" in chosen_raw:
        chosen_raw["ports"] = [entry.model_dump(by_alias=True) for entry in sections["ports"]]
    return ClusterConfig.model_validate(chosen_raw)


def from_pulumi() -> tuple[ClusterConfig, Any]:
    """Read and validate `qwen-cluster:*` from the running Pulumi program.

    Returns the config and the SSH private key as an Output secret (or None)."""
    import pulumi
    import pulumi.runtime

    keys = set(pulumi.runtime.config.CONFIG.get()) | set(pulumi.runtime.get_config_env())
    prefix = f"{NAMESPACE}:"
    config = pulumi.Config(NAMESPACE)
    raw: dict[str, Any] = {}
    for full_key in sorted(keys):
        if not full_key.startswith(prefix):
            continue
        key = full_key[len(prefix) :]
        if key in SECRET_KEYS:
            continue
        raw[key] = decode_value(config.get(key))
    cluster = validate(raw, aws_region=pulumi.Config("aws").get("region"))
    return cluster, config.get_secret("sshPrivateKey")


def decode_value(value: str | None) -> Any:
    """Pulumi hands structured config values over as JSON text."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except (json.JSONDecodeError, TypeError):
        return value
