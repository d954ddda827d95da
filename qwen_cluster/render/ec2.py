"""EC2 launch details of a GPU node as plain data: network interfaces and the root volume."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qwen_cluster import catalog

# The root volume holds the AMI, the model server image and the weights (Hugging Face cache).
# The DLAMI's root snapshot is below AMI_ROOT_GB (EC2 refuses a volume smaller than its
# snapshot); the vLLM image unpacks to about CONTAINER_IMAGE_GB.
AMI_ROOT_GB = 100
CONTAINER_IMAGE_GB = 30
ROOT_HEADROOM = 1.25  # logs, a second image version during an upgrade
ROOT_DEVICE_NAME = "/dev/sda1"  # the Ubuntu DLAMI's root device


def root_volume_gb(weights_gb: float) -> int:
    """Image + weights + headroom, rounded up to 10 GB."""
    need = (AMI_ROOT_GB + CONTAINER_IMAGE_GB + weights_gb) * ROOT_HEADROOM
    return int(math.ceil(need / 10) * 10)


@dataclass(frozen=True)
class InterfaceSpec:
    network_card_index: int
    device_index: int
    interface_type: str  # "efa", "efa-only", or "interface" (plain ENA)
    private_ip: str | None  # the node's static IP on the primary interface only


def network_interfaces(kind: catalog.InstanceType, efa: bool, node_ip: str) -> list[InterfaceSpec]:
    """The node's interfaces, in AWS's recommended EFA layout (`catalog.interface_layout`).

    The primary interface (card 0, device 0) carries the node's static IP; the others take
    no address of their own (`efa-only` has none; extra `efa` ones get one from the subnet).
    """
    specs = []
    for slot in catalog.interface_layout(kind, efa):
        primary = slot.network_card_index == 0 and slot.device_index == 0
        specs.append(
            InterfaceSpec(
                network_card_index=slot.network_card_index,
                device_index=slot.device_index,
                interface_type=slot.interface_type,
                private_ip=node_ip if primary else None,
            )
        )
    return specs
