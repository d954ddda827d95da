"""The endpoint's policies: what the stack says about how clients reach the model."""

from __future__ import annotations

from pulumi_policy import ReportViolation, Severity, StackValidationArgs

from policies.declaration import ADVISORY, Settings, stack_policy
from policies.facts import Net, current_facts
from qwen_cluster.config import x509check


@stack_policy(
    name="keys-in-clear",
    description="API keys travel over TLS: a stack with access.apiKeys and without loadBalancer.tls "
    "sends every key (and every prompt and answer) in clear between clients and the load balancer.",
    enforcement_level=ADVISORY,
    severity=Severity.HIGH,
    remediation_steps="Set loadBalancer.tls (a certificate chain and its key, each with `pulumi config "
    "set --secret --path`): docs/endpoint.md shows a stack with TLS to copy.",
)
def keys_in_clear(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    """Once per stack, from the stack's own config (without it nothing is known: no report)."""
    facts = current_facts()
    if facts.known and facts.api_keys and not facts.tls:
        report(
            "access.apiKeys are set and loadBalancer.tls is not: clients send their keys, prompts and "
            "answers in clear to the load balancer, where anyone on the path can read and reuse a key. "
            "Set loadBalancer.tls (docs/endpoint.md)"
        )


@stack_policy(
    name="certificate-expiring",
    description="The endpoint's certificate (loadBalancer.tls) and the monitoring servers' "
    "(monitoring.tls) are renewed before they expire: a certificate of either chain that expires "
    f"within {x509check.EXPIRY_ADVISORY_DAYS} days is said (an expired one is refused by the "
    "program itself).",
    enforcement_level=ADVISORY,
    severity=Severity.MEDIUM,
    remediation_steps="Renew the certificate and set the new chain and key with `pulumi config set "
    "--secret --path` (docs/endpoint.md, docs/monitoring.md); nginx reloads, Prometheus and "
    "Alertmanager read the new pair on their next connection, no model server restarts.",
)
def certificate_expiring(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    """Once per certificate close to its end, where the pack had the pair in plain text."""
    facts = current_facts()
    for warning in facts.certificate_warnings if facts.known else ():
        report(warning)


@stack_policy(
    name="monitoring-open",
    description="Prometheus and Alertmanager ask for a password (monitoring.password): a stack that runs "
    "them open on purpose (monitoring.openToMonitoringCidrs) lets anyone in access.monitoringCidrs "
    "query them and create or expire silences, hiding an incident from everyone.",
    enforcement_level=ADVISORY,
    severity=Severity.HIGH,
    remediation_steps="Set monitoring.password (`pulumi config set --secret --path "
    "'qwen-cluster:monitoring.password' \"$(openssl rand -hex 24)\"`) and remove "
    "monitoring.openToMonitoringCidrs (docs/monitoring.md).",
)
def monitoring_open(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    """Once per stack, from the stack's own config: the stack said it, the plan says it back."""
    facts = current_facts()
    if facts.known and facts.monitoring_open:
        cidrs = ", ".join(map(str, facts.monitoring_cidrs)) or "no block"
        report(
            "monitoring.openToMonitoringCidrs is true: Prometheus and Alertmanager answer without a "
            f"password to anyone in access.monitoringCidrs ({cidrs}), who can create a silence and hide "
            "an incident from everyone. Set monitoring.password (docs/monitoring.md)"
        )


def _inside(cidr: Net, blocks: tuple[Net, ...]) -> list[Net]:
    """The blocks of `blocks` that hold `cidr` whole."""
    return [block for block in blocks if block.version == cidr.version and cidr.subnet_of(block)]  # type: ignore[arg-type]


@stack_policy(
    name="monitoring-inside-clients",
    description="Monitoring hosts are not clients unless meant to be: when access.monitoringCidrs "
    "lie inside access.clientCidrs, every monitoring host may also call the model endpoint.",
    enforcement_level=ADVISORY,
    severity=Severity.LOW,
    remediation_steps="If monitoring hosts should not call the model, narrow access.clientCidrs so that "
    "it leaves out access.monitoringCidrs (the load balancer admits clientCidrs only); if they should, "
    "nothing to do: this is said so that it is a choice.",
)
def monitoring_inside_clients(args: StackValidationArgs, report: ReportViolation, settings: Settings) -> None:
    """Once per stack, naming each monitoring block and the client blocks that hold it."""
    facts = current_facts()
    if not facts.known:
        return
    for cidr in facts.monitoring_cidrs:
        holders = _inside(cidr, facts.client_cidrs)
        if holders:
            report(
                f"access.monitoringCidrs {cidr} lies inside access.clientCidrs "
                f"({', '.join(map(str, holders))}): every monitoring host there is also a client of the "
                "model endpoint (the load balancer's listener admits it). If that is not meant, narrow "
                "access.clientCidrs"
            )
