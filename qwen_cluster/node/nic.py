"""The cluster interface: the one rule, in one text, that every part of the program uses to
name the NIC holding a node's address (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, the host
firewall, the preflight, the MTU, the monitoring endpoint's qwen_node_nic_info).

The rule: the first interface, in the kernel's address dump order (RTM_GETADDR over
rtnetlink, what `ip -o -4 addr show` prints), holding the IPv4 address, primary or secondary;
nothing when none does. Read over netlink, stdlib only, so it runs wherever Python does: the
hosts (python3 is in every supported OS's base: ufw, firewalld, cloud-init and the SSM agent's
DLAMI are Python), the vLLM image (no iproute2 there) and the monitoring endpoint's image.
SIOCGIFADDR, used before, reads only an interface's primary address.

Run: python3 nic.py ADDRESS (prints the interface or nothing), or `python3 -c "$FINDER" ADDRESS`.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from pathlib import Path

RTM_NEWADDR, RTM_GETADDR = 20, 22
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
IFA_ADDRESS, IFA_LOCAL = 1, 2


def _align(length: int) -> int:
    return (length + 3) & ~3


def ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4 address, in the kernel's dump order."""
    found: list[tuple[str, str]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        # nlmsghdr (len, type, flags, seq, pid) + ifaddrmsg (family, prefixlen, flags, scope, index)
        request = struct.pack("=IHHII", 24, RTM_GETADDR, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        sock.send(request + struct.pack("=BBBBI", socket.AF_INET, 0, 0, 0, 0))
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if length < 16 or kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    raise OSError("rtnetlink refused the address dump")
                if kind == RTM_NEWADDR:
                    family, _, _, _, index = struct.unpack_from("=BBBBI", data, offset + 16)
                    attrs, local, address = offset + 24, None, None
                    while attrs + 4 <= offset + length:
                        size, attr = struct.unpack_from("=HH", data, attrs)
                        if size < 4:
                            break
                        value = data[attrs + 4 : attrs + size]
                        if attr == IFA_LOCAL:
                            local = socket.inet_ntoa(value)
                        elif attr == IFA_ADDRESS:
                            address = socket.inet_ntoa(value)
                        attrs += _align(size)
                    if family == socket.AF_INET and (local or address):
                        found.append((socket.if_indextoname(index), local or address))
                offset += _align(length)


def interface_of(address: str) -> str | None:
    """The interface holding IPv4 `address` (the first listed), or None."""
    return next((name for name, held in ipv4_addresses() if held == address), None)


# This file's text: what the model server's container runs (`python3 -c "$FINDER" ADDRESS`),
# what the monitoring endpoint is shipped next to nodemetrics.py, what the host scripts run.
FINDER = Path(__file__).read_text() if "__file__" in globals() and os.path.exists(__file__) else ""

if __name__ == "__main__":
    found = interface_of(sys.argv[1])
    if found:
        print(found)
