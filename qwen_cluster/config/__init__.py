"""The stack config (`qwen-cluster:*` keys), validated into one ClusterConfig.

Every mistake in a config is reported at once, each naming its key path and value; a bad
config raises ConfigError before the program registers any resource. The package, by seam:
values (address and CIDR types, the section base), limits (bounds other modules share),
sections (one model per section), rules (between sections), cluster (ClusterConfig and the
top-level keys), errors, loading (validate, from_pulumi). Callers import from here.
"""

from qwen_cluster.config.cluster import KNOWN_KEYS, NAMESPACE, SECRET_KEYS, SECTIONS, ClusterConfig
from qwen_cluster.config.errors import ConfigError
from qwen_cluster.config.limits import (
    AWS_RESERVED_HEAD,
    AWS_SUBNET_PREFIX,
    IDLE_TIMEOUT_LIMITS,
    MIN_BANDWIDTH_GBPS,
    MIN_NODES,
    NGINX_IDLE_TIMEOUT_SECONDS,
    NLB_IDLE_TIMEOUT_SECONDS,
    RECOMMENDED_BANDWIDTH_GBPS,
    RECOMMENDED_NODES,
)
from qwen_cluster.config.loading import decode_value, from_pulumi, ray_auth_token, validate
from qwen_cluster.config.rules import complete_ports, cross_errors, monitoring_rows
from qwen_cluster.config.secrets import REDACTED, EndpointSecrets
from qwen_cluster.config.sections import (
    DEFAULT_IMAGE,
    DEFAULT_MODEL,
    DEFAULT_SCRAPE_INTERVAL_SECONDS,
    DEFAULT_SYSCTL,
    DEFAULT_VLLM_FLAGS,
    DEFAULT_WEIGHTS_CACHE,
    OWNED_VLLM_FLAGS,
    Access,
    AwsTarget,
    BareMetalTarget,
    Bastion,
    LoadBalancer,
    Model,
    Monitoring,
    Network,
    Node,
    Rollout,
    Target,
    Tls,
    Tuning,
    VllmFlagValue,
    Weights,
)
from qwen_cluster.config.values import Cidr, IPv4, IPv4Net

__all__ = [
    "AWS_RESERVED_HEAD",
    "AWS_SUBNET_PREFIX",
    "DEFAULT_IMAGE",
    "DEFAULT_MODEL",
    "DEFAULT_SCRAPE_INTERVAL_SECONDS",
    "DEFAULT_SYSCTL",
    "DEFAULT_VLLM_FLAGS",
    "DEFAULT_WEIGHTS_CACHE",
    "IDLE_TIMEOUT_LIMITS",
    "KNOWN_KEYS",
    "MIN_BANDWIDTH_GBPS",
    "MIN_NODES",
    "NAMESPACE",
    "NGINX_IDLE_TIMEOUT_SECONDS",
    "NLB_IDLE_TIMEOUT_SECONDS",
    "OWNED_VLLM_FLAGS",
    "RECOMMENDED_BANDWIDTH_GBPS",
    "RECOMMENDED_NODES",
    "REDACTED",
    "SECRET_KEYS",
    "SECTIONS",
    "Access",
    "AwsTarget",
    "BareMetalTarget",
    "Bastion",
    "Cidr",
    "ClusterConfig",
    "ConfigError",
    "EndpointSecrets",
    "IPv4",
    "IPv4Net",
    "LoadBalancer",
    "Model",
    "Monitoring",
    "Network",
    "Node",
    "Rollout",
    "Target",
    "Tls",
    "Tuning",
    "VllmFlagValue",
    "Weights",
    "complete_ports",
    "cross_errors",
    "decode_value",
    "from_pulumi",
    "ray_auth_token",
    "monitoring_rows",
    "validate",
]
