"""Valid raw stack configs per target, which tests change one field at a time, and node lists."""

from __future__ import annotations

from tooling.stackfile import OFFLINE_TLS_CERTIFICATE, OFFLINE_TLS_PRIVATE_KEY

# A well-formed key for configs that need one; no endpoint anywhere accepts it.
TEST_API_KEY = "test-key-0123456789abcdef0123456789abcdef"
# The same for the monitoring password, which a stack with Prometheus needs, and the TLS it needs
# (the offline tools' throwaway pair: it names only `offline.invalid`, so any node list passes).
TEST_MONITORING_PASSWORD = "test-monitoring-password-0123456789"
TEST_MONITORING_TLS = {
    "certificate": OFFLINE_TLS_CERTIFICATE,
    "privateKey": OFFLINE_TLS_PRIVATE_KEY,
    "caCertificate": OFFLINE_TLS_CERTIFICATE,
}

BASE_AWS = {
    "target": "aws",
    "nodes": [
        {"name": "master", "ip": "192.168.1.100", "role": "master"},
        {"name": "worker-1", "ip": "192.168.1.101"},
        {"name": "worker-2", "ip": "192.168.1.102"},
        {"name": "worker-3", "ip": "192.168.1.103"},
    ],
    "network": {"cidr": "192.168.1.0/24", "minBandwidthGbps": 10, "maxLatencyMs": 1.0},
    "access": {
        "clientCidrs": ["10.0.0.0/8"],
        "monitoringCidrs": ["10.20.0.0/16"],
        "adminCidrs": ["203.0.113.10/32"],
        "apiKeys": [TEST_API_KEY],
    },
    "monitoring": {"password": TEST_MONITORING_PASSWORD, "tls": TEST_MONITORING_TLS},
    "aws": {"instanceType": "g6e.12xlarge", "availabilityZone": "us-west-2a", "efa": True},
}

BASE_BARE_METAL = {
    **{k: v for k, v in BASE_AWS.items() if k != "aws"},
    "target": "bare-metal",
    "bareMetal": {
        "sshUser": "ubuntu",
        "firewall": "ufw",
        "nicSpeedGbps": 25,
        "gpusPerNode": 8,
        "gpuMemoryGb": 80,
    },
}


def open_monitoring(stack_config: dict) -> dict:
    """A stack file's `config:` map that runs Prometheus without a password, as a stack says it on
    purpose (`monitoring.openToMonitoringCidrs`): the offline tools' throwaway password and TLS pair
    taken out."""
    key = "qwen-cluster:monitoring"
    monitoring = {k: v for k, v in (stack_config.get(key) or {}).items() if k not in ("password", "tls")}
    return {**stack_config, key: {**monitoring, "openToMonitoringCidrs": True}}


def nodes(count: int, prefix: str = "10.0.") -> list[dict]:
    """`count` nodes with unique names and addresses, the first the master."""
    result = []
    for index in range(count):
        ip = f"{prefix}{index // 250}.{index % 250 + 4}"
        entry = {"name": "master" if index == 0 else f"worker-{index}", "ip": ip}
        if index == 0:
            entry["role"] = "master"
        result.append(entry)
    return result


# serving.mode disaggregated over the four nodes above: master and worker-1 prefill, worker-2 and
# worker-3 decode. Bare metal needs a GPU the link floor is derived from (bareMetal.gpuModel).
PD_POOLS = {"prefill": {"nodes": ["master", "worker-1"]}, "decode": {"nodes": ["worker-2", "worker-3"]}}


def disaggregated(raw: dict, **serving) -> dict:
    """`raw` (a copy of a base config) with serving.mode disaggregated over PD_POOLS."""
    raw["serving"] = {"mode": "disaggregated", **PD_POOLS, **serving}
    if raw["target"] == "bare-metal":
        raw["bareMetal"]["gpuModel"] = "H100"
    return raw
