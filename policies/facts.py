"""What the stack intends, as the policies judge it: its port table, CIDRs, listener, EFA choice and
KV path, read from the stack config the engine hands the pack (or set by the offline harness), and
the advisory policy that says which checks were relaxed when there is no stack config.
"""

from __future__ import annotations

import contextvars
import functools
import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pulumi_policy import ReportViolation, Severity, StackValidationArgs

from policies.declaration import ADVISORY, Settings, stack_policy
from qwen_cluster import config, kvlink
from qwen_cluster.ports import DEFAULT_PORTS, MONITORING_NODE_ROWS, PortEntry, PortRange, Scope

Net = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Facts:
    """What the stack intends: its port table, CIDRs and listener. Without a readable stack
    config (`known` false, `unknown_because` says why): the project's default table and listener,
    no CIDRs; the checks that need the real ones are relaxed (see RELAXED_WITHOUT_CONFIG)."""

    ports: tuple[PortEntry, ...]
    listener_ports: tuple[int, ...]
    node_cidrs: tuple[Net, ...] = ()
    monitoring_cidrs: tuple[Net, ...] = ()
    client_cidrs: tuple[Net, ...] = ()
    admin_cidrs: tuple[Net, ...] = ()
    stack_floor_gbps: float = 0.0
    efa: bool | None = None
    heads: tuple[str, ...] | None = None  # load-balancer targets by node name
    monitoring_node: str | None = None  # where Prometheus and Alertmanager run (monitoring.node)
    api_keys: bool = False  # access.apiKeys set (the endpoint checks keys)
    tls: bool = False  # loadBalancer.tls set (clients speak TLS to the endpoint)
    # What the parse of loadBalancer.tls and monitoring.tls warrants saying (an expiry close at
    # hand), each prefixed with its key, where the pair was at hand in plain text
    # (qwen_cluster/config/x509check.py).
    certificate_warnings: tuple[str, ...] = ()
    # Prometheus and Alertmanager run without a password, as monitoring.openToMonitoringCidrs says.
    monitoring_open: bool = False
    # serving.mode disaggregated: what the stack declares about its KV path
    # (qwen_cluster.kvlink.declaration); None when aggregated or without the stack config.
    kv_link: Mapping[str, Any] | None = field(default=None, compare=False)
    known: bool = False  # read from the stack config
    unknown_because: str = ""

    @property
    def model_port(self) -> int:
        return next(e.port.low for e in self.ports if e.scope is Scope.CLIENTS)

    def spans(self, scope: Scope) -> list[PortRange]:
        return [entry.port for entry in self.ports if entry.scope is scope]

    def single_node_rows(self) -> list[PortEntry]:
        """The rows whose service runs on `monitoring.node` only (Prometheus, Alertmanager)."""
        return [entry for entry in self.ports if entry.name in MONITORING_NODE_ROWS]

    def entry_at(self, span: PortRange) -> list[PortEntry]:
        return [entry for entry in self.ports if entry.port.overlaps(span)]


# Why the pack can be without the stack config. The CLI hands a Python pack the stack config as
# PULUMI_CONFIG, which the language host sets from the ConfigureStack call it awaits before starting
# the pack (pulumi/pulumi sdk/python/cmd/pulumi-language-python/main.go RunPlugin, sdk/policy_proxy.go).
# The engine sends ConfigureStack only when it has stack options
# (pkg/resource/plugin/analyzer_plugin.go NewPolicyAnalyzer: `if opts != nil`); `pulumi policy
# analyze` loads packs with none (pkg/cmd/pulumi/policy/policy_analyze.go).
NO_CONFIG = "PULUMI_CONFIG is not set (the engine sent no stack config, as `pulumi policy analyze` does)"
# What is relaxed without the stack config: these checks judge against facts only the config holds.
RELAXED_WITHOUT_CONFIG = (
    "port-exposure: everything but world exposure and all traffic from non-members (the port table, "
    "the node, monitoring and admin CIDRs are unknown)",
    "required-paths: the model port from the load balancer and the host firewall paths of the port "
    "table (the table is unknown)",
    "efa-placement: EFA devices are expected only where the stack declares EFA interfaces "
    "(aws.efa is unknown)",
    "bandwidth-class: only the policy's minBandwidthGbps applies (network.minBandwidthGbps is unknown)",
)


def facts_for(cluster: config.ClusterConfig | None, unknown_because: str = NO_CONFIG) -> Facts:
    if cluster is None:
        return Facts(
            ports=DEFAULT_PORTS,
            listener_ports=(config.LoadBalancer().port,),
            unknown_because=unknown_because,
        )
    return Facts(
        ports=tuple(cluster.ports),
        listener_ports=(cluster.load_balancer.port,),
        node_cidrs=(cluster.network.cidr,),
        monitoring_cidrs=tuple(cluster.access.monitoring_cidrs),
        client_cidrs=tuple(cluster.access.client_cidrs),
        admin_cidrs=tuple(cluster.access.admin_cidrs),
        stack_floor_gbps=cluster.network.min_bandwidth_gbps,
        efa=bool(cluster.aws.efa) if cluster.aws else None,
        heads=tuple(head.name for head in cluster.topology.heads),
        monitoring_node=cluster.monitoring_node.name if cluster.monitoring_node else None,
        api_keys=bool(cluster.access.api_keys),
        tls=cluster.load_balancer.tls is not None,
        certificate_warnings=_certificate_warnings(cluster),
        monitoring_open=cluster.monitoring.prometheus and cluster.monitoring.open_to_monitoring_cidrs,
        kv_link=kvlink.declaration(cluster),
        known=True,
    )


def _certificate_warnings(cluster: config.ClusterConfig) -> tuple[str, ...]:
    """Each TLS pair's warnings, named by its key: the endpoint's and the monitoring servers'."""
    sections = (("loadBalancer.tls", cluster.load_balancer.tls), ("monitoring.tls", cluster.monitoring.tls))
    return tuple(f"{key} {warning}" for key, tls in sections if tls for warning in tls.warnings)


_MISSING = object()
# The offline harness sets the stack it analyzes here (None: no stack config); under the CLI the
# stack config is read from PULUMI_CONFIG.
STACK: contextvars.ContextVar[Any] = contextvars.ContextVar("qwen_cluster_stack", default=_MISSING)


def current_facts() -> Facts:
    cluster = STACK.get()
    if cluster is not _MISSING:
        return facts_for(cluster)
    import pulumi.runtime

    values = dict(pulumi.runtime.config.CONFIG.get() or {})
    values.update(pulumi.runtime.get_config_env())
    present = "PULUMI_CONFIG" in os.environ or bool(values)
    return _facts_from_engine(json.dumps(values, sort_keys=True), present)


# The provider's region, which the program checks the availability zone against
# (qwen_cluster/config/loading.py from_pulumi: `pulumi.Config("aws").get("region")`).
AWS_REGION_KEY = "aws:region"


@functools.lru_cache(maxsize=8)
def _facts_from_engine(values_json: str, present: bool) -> Facts:
    """The stack config the engine handed over, validated once per distinct config (every
    Analyze call asks for it) as the program validates it: the same keys, the same region."""
    if not present:
        return facts_for(None)
    values = json.loads(values_json)
    prefix = f"{config.NAMESPACE}:"
    raw = {
        key[len(prefix) :]: config.decode_value(value)
        for key, value in values.items()
        if key.startswith(prefix) and key[len(prefix) :] not in config.SECRET_KEYS
    }
    if not raw:
        return facts_for(None, f"PULUMI_CONFIG holds no {prefix} keys")
    region = values.get(AWS_REGION_KEY)
    try:
        return facts_for(config.validate(raw, aws_region=region if isinstance(region, str) else None))
    except ValueError as exc:  # ConfigError lists every problem
        return facts_for(None, f"the stack config in PULUMI_CONFIG is not valid: {exc}")


@stack_policy(
    name="stack-config",
    description="The pack judges against the stack's own config; without it (PULUMI_CONFIG unset) "
    "the checks that need it are relaxed, and this says which.",
    enforcement_level=ADVISORY,
    severity=Severity.LOW,
    remediation_steps="Run the pack with the stack: `pulumi preview --policy-pack policies` (the "
    "engine then hands the pack the stack config), not `pulumi policy analyze` alone.",
)
def stack_config(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    """Once per stack: without the stack config, which checks were relaxed (an advisory, so a
    pack started without PULUMI_CONFIG never fails a stack on facts it cannot know)."""
    facts = current_facts()
    if facts.known:
        return
    report(
        f"No stack config: {facts.unknown_because}. Relaxed, so they cannot fail the stack: "
        + "; ".join(RELAXED_WITHOUT_CONFIG)
        + ". World exposure, the EFA self rules and the baseline are enforced as always."
    )
