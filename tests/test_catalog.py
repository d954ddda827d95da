"""The instance catalog and the EFA interface layout."""

from __future__ import annotations

import pytest

from qwen_cluster import catalog


def test_catalog_holds_every_required_type():
    required = {
        "g5.12xlarge",
        "g5.24xlarge",
        "g5.48xlarge",
        "g6e.12xlarge",
        "g6e.24xlarge",
        "g6e.48xlarge",
        "p4d.24xlarge",
        "p4de.24xlarge",
        "p5.48xlarge",
        "p5e.48xlarge",
        "p5en.48xlarge",
        "p6-b200.48xlarge",
        "g5.xlarge",
        "g4dn.xlarge",
        "g6.xlarge",
        "t3.large",
    }
    assert required <= set(catalog.INSTANCE_TYPES)


def test_up_to_types_count_at_their_baseline():
    for name in ("g5.xlarge", "g4dn.xlarge", "g6.xlarge", "t3.large"):
        kind = catalog.INSTANCE_TYPES[name]
        assert kind.bandwidth.startswith("Up to") and kind.baseline_gbps < 10 and not kind.efa


def test_p5_layout_is_one_efa_device_per_card_on_32_cards():
    layout = catalog.interface_layout(catalog.INSTANCE_TYPES["p5.48xlarge"], efa=True)
    assert len(layout) == 32
    assert len({slot.network_card_index for slot in layout}) == 32
    assert layout[0] == catalog.InterfaceSlot(0, 0, "efa")
    assert {slot.interface_type for slot in layout[1:]} == {"efa-only"}
    assert {slot.device_index for slot in layout[1:]} == {0}


def test_g6e_12xlarge_layout_is_a_single_efa_interface():
    assert catalog.interface_layout(catalog.INSTANCE_TYPES["g6e.12xlarge"], efa=True) == [
        catalog.InterfaceSlot(0, 0, "efa")
    ]


def test_p4d_extra_cards_get_full_efa_interfaces_at_device_one():
    layout = catalog.interface_layout(catalog.INSTANCE_TYPES["p4d.24xlarge"], efa=True)
    assert [(s.network_card_index, s.device_index, s.interface_type) for s in layout] == [
        (0, 0, "efa"),
        (1, 1, "efa"),
        (2, 1, "efa"),
        (3, 1, "efa"),
    ]


def test_layout_without_efa_is_one_ena_interface():
    assert catalog.interface_layout(catalog.INSTANCE_TYPES["p5.48xlarge"], efa=False) == [
        catalog.InterfaceSlot(0, 0, "interface")
    ]


def test_layout_refuses_efa_on_a_type_without_it():
    with pytest.raises(ValueError, match="g4dn.xlarge has no EFA support"):
        catalog.interface_layout(catalog.INSTANCE_TYPES["g4dn.xlarge"], efa=True)


def test_memory_rule_numbers():
    assert catalog.MODELS["Qwen/Qwen3-32B"].weights_gb == 65.6
    assert catalog.replica_memory_needed_gb(65.6) == 91.1


@pytest.mark.parametrize(
    ("name", "expected"),
    [("g5.xlarge", True), ("p5.48xlarge", True), ("t3.large", False), ("m7i.large", False), ("", False)],
)
def test_gpu_family(name, expected):
    assert catalog.is_gpu_family(name) is expected
