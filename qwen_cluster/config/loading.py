"""Reading the stack config: from raw keys (a stack file, the policy pack) or from the running
Pulumi program, into one ClusterConfig or one ConfigError that lists every problem.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from qwen_cluster.config.cluster import KNOWN_KEYS, NAMESPACE, SECRET_KEYS, SECTIONS, ClusterConfig
from qwen_cluster.config.errors import ConfigError, format_error
from qwen_cluster.config.rules import complete_ports, cross_errors
from qwen_cluster.config.secrets import EndpointSecrets, plain_text_secrets, read_secrets
from qwen_cluster.config.sections import Target

_ADAPTERS = {key: TypeAdapter(kind) for key, (_, kind, _) in SECTIONS.items()}


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
    for key, (attr, _, required) in SECTIONS.items():
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
            errors += [format_error(key, error) for error in exc.errors()]
    completed = False
    if sections.get("ports") is not None and sections.get("monitoring") is not None:
        # The default table already holds every monitoring row; the router's comes with routing.
        before = sections["ports"]
        sections["ports"] = complete_ports(
            before,
            sections["monitoring"],
            sections.get("load_balancer"),
            sections.get("target"),
            sections.get("serving"),
        )
        completed = sections["ports"] != list(before)
    errors += cross_errors(sections, given)
    chosen = sections.get("aws") if sections.get("target") is Target.AWS else None
    if aws_region and chosen is not None and chosen.region != aws_region:
        # The provider creates everything in aws:region; a zone elsewhere fails at the subnet.
        errors.append(f"aws.availabilityZone {chosen.availability_zone} is not in aws:region {aws_region}")
    if errors:
        raise ConfigError(errors)
    chosen_raw = {key: raw[key] for key in SECTIONS if raw.get(key) is not None}
    if "ports" in chosen_raw or completed:
        chosen_raw["ports"] = [entry.model_dump(by_alias=True) for entry in sections["ports"]]
    return ClusterConfig.model_validate(chosen_raw)


def from_pulumi() -> tuple[ClusterConfig, Any, EndpointSecrets]:
    """Read and validate `qwen-cluster:*` from the running Pulumi program.

    Returns the config, the SSH private key as an Output secret (or None), and the endpoint's
    secrets (API keys, TLS), Output secrets too (qwen_cluster/config/secrets.py)."""
    import pulumi
    import pulumi.runtime

    # Every key of the stack, to refuse the unknown ones: `pulumi.Config` reads one key at a
    # time and lists none. The CLI's language host starts the program with the whole config as
    # JSON in PULUMI_CONFIG, read by the SDK's public `pulumi.runtime.get_config_env` (in
    # pulumi.runtime.__all__), as the SDK's own launcher reads it (pulumi/pulumi
    # sdk/python/cmd/pulumi-language-python-exec: `config_env = pulumi.runtime.get_config_env()`).
    keys = set(pulumi.runtime.get_config_env())
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
    plain = plain_text_secrets(raw, lambda key: pulumi.runtime.is_config_secret(f"{prefix}{key}"))
    if plain:
        raise ConfigError(plain)
    cluster = validate(raw, aws_region=pulumi.Config("aws").get("region"))
    return cluster, config.get_secret("sshPrivateKey"), read_secrets(raw)


def decode_value(value: str | None) -> Any:
    """Pulumi hands structured config values over as JSON text."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except (json.JSONDecodeError, TypeError):
        return value


def ray_auth_token(cluster: ClusterConfig) -> Any:
    """`qwen-cluster:rayAuthToken` as an Output secret when Ray runs (pipelineParallel > 1 with
    model.distributedBackend ray), else None; ConfigError when Ray runs without one (an
    unauthenticated Ray executes code for whoever reaches its ports)."""
    import pulumi

    if not cluster.runs_ray:
        return None
    token = pulumi.Config(NAMESPACE).get_secret("rayAuthToken")
    if token is None:
        raise ConfigError([ray_token_missing(cluster)])
    return token


def ray_token_missing(cluster: ClusterConfig) -> str:
    return (
        f"{NAMESPACE}:rayAuthToken is required when model.pipelineParallel is "
        f"{cluster.topology.pipeline_parallel} with model.distributedBackend ray (Ray joins a replica's "
        "nodes and authenticates with it): "
        "pulumi config set --secret rayAuthToken $(openssl rand -hex 32)"
    )
