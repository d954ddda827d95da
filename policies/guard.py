"""The qwen-cluster-guard pack: the registry of its policies, in the order the engine lists them.

Each policy is declared once, in the module of its group, with its name, description,
enforcement level, config schema and validation function together (`policies.declaration`).
Importing this module has no side effects: `POLICIES` is a list the thin `__main__.py` hands to
`PolicyPack`, and the offline harness (tooling/policy_harness.py) runs it directly, setting the
stack it judges in `STACK`.

The facts the policies judge against come from one place each: instance figures from
`qwen_cluster.catalog`, ports and scopes from `qwen_cluster.ports` (the stack's own table when the
stack config is readable, the project default otherwise), thresholds from the policy config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import ResourceValidationPolicy, StackValidationPolicy

from policies import bandwidth, baseline, containers, efa, endpoint, exposure, facts, nodes, paths
from policies.declaration import Declared, Schema

__all__ = ["DECLARED", "PACK_NAME", "POLICIES", "SCHEMAS", "STACK", "settings"]

PACK_NAME = "qwen-cluster-guard"

DECLARED: tuple[Declared, ...] = (
    bandwidth.bandwidth_class,
    bandwidth.bandwidth_recommended,
    exposure.port_exposure,
    paths.required_paths,
    efa.efa_placement,
    nodes.node_count,
    baseline.imdsv2,
    baseline.ebs_encryption,
    baseline.no_public_ip,
    baseline.rule_descriptions,
    baseline.health_check,
    baseline.idle_timeout,
    baseline.selinux,
    baseline.tls_policy,
    containers.container_host_network,
    endpoint.keys_in_clear,
    endpoint.certificate_expiring,
    endpoint.monitoring_open,
    endpoint.monitoring_inside_clients,
    facts.stack_config,
)
BY_NAME: dict[str, Declared] = {declared.name: declared for declared in DECLARED}

POLICIES: list[ResourceValidationPolicy | StackValidationPolicy] = [declared.policy for declared in DECLARED]
# Each policy's config schema, as GetAnalyzerInfo reports it.
SCHEMAS: dict[str, Schema] = {declared.name: declared.config_schema for declared in DECLARED}
# The stack the offline harness analyzes (None: no stack config); under the CLI, PULUMI_CONFIG.
STACK = facts.STACK


def settings(name: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """Policy `name`'s config with the schema defaults filled in (see `Declared.settings`)."""
    return BY_NAME[name].settings(given)
