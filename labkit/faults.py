"""The failures of issue 26's table that the lab can produce, injected on one node and removed
again (tests/test_lab_doctor.py rehearses `doctor` against each).

Each fault is a pair of functions (inject, remove) on a lab node; all are undone by `lab down`
too (the namespace and its /etc/netns directory go with it).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

from labkit import netns
from labkit.blueprint import MEMBER_IF, LabPlan, Member

FAULT_TABLE = "qcl_fault"
# The kernel's default ephemeral range (net.ipv4.ip_local_port_range), where NCCL, Gloo and vLLM's
# cross-node queues bind: a firewall that lets only the table's 6000-6100 through drops them.
EPHEMERAL = "32768-60999"
LOWERED_MTU = 1400


def _hosts(member: Member, text: str) -> None:
    # In place: the file is bind-mounted into the node's processes (ip netns exec).
    (netns.NETNS_ETC / member.namespace / "hosts").write_text(text)


def hostname_to_loopback(plan: LabPlan, member: Member) -> None:
    """Cause 1: the node's name on 127.0.1.1, as Debian's installer writes it."""
    _hosts(member, f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()} {member.node}\n")


def hostname_restored(plan: LabPlan, member: Member) -> None:
    _hosts(member, f"127.0.0.1 localhost\n{member.ip} {socket.gethostname()} {member.node}\n")


def lower_mtu(plan: LabPlan, member: Member) -> None:
    """Cause 7: one member's link at a smaller MTU than the others'."""
    netns.run(["ip", "-n", member.namespace, "link", "set", MEMBER_IF, "mtu", str(LOWERED_MTU)])


def restore_mtu(plan: LabPlan, member: Member) -> None:
    netns.run(["ip", "-n", member.namespace, "link", "set", MEMBER_IF, "mtu", "1500"])


def drop_dynamic_ports(plan: LabPlan, member: Member) -> None:
    """Cause 8: new connections to the ephemeral ports dropped on the node's cluster link (replies
    to its own connections pass: a stateful firewall, as ufw and firewalld are)."""
    rules = (
        f"add table inet {FAULT_TABLE}; "
        f"add chain inet {FAULT_TABLE} input {{ type filter hook input priority -10; policy accept; }}; "
        f'add rule inet {FAULT_TABLE} input iifname "{MEMBER_IF}" ct state new tcp dport {EPHEMERAL} drop'
    )
    netns.exec_in(member.namespace, ["nft", rules])


def allow_dynamic_ports(plan: LabPlan, member: Member) -> None:
    netns.exec_in(member.namespace, ["nft", f"delete table inet {FAULT_TABLE}"], check=False)


@dataclass(frozen=True)
class Fault:
    name: str
    check: str  # the doctor check that must name it (tooling/doctor.py CHECKS)
    inject: Callable[[LabPlan, Member], None]
    remove: Callable[[LabPlan, Member], None]


FAULTS = (
    Fault("hostname on loopback", "hostname", hostname_to_loopback, hostname_restored),
    Fault("a lowered MTU on one link", "mtu", lower_mtu, restore_mtu),
    Fault("a firewall dropping the dynamic ports", "dynamic-port", drop_dynamic_ports, allow_dynamic_ports),
)
