"""Shared fixtures: valid raw configs per target that tests change one field at a time."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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
    },
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


@pytest.fixture
def aws_raw() -> dict:
    return copy.deepcopy(BASE_AWS)


@pytest.fixture
def bare_metal_raw() -> dict:
    return copy.deepcopy(BASE_BARE_METAL)


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
