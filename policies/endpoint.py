"""The endpoint's policies: what the stack says about how clients reach the model."""

from __future__ import annotations

from pulumi_policy import ReportViolation, Severity, StackValidationArgs

from policies.declaration import ADVISORY, Settings, stack_policy
from policies.facts import current_facts


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
