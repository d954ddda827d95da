"""What "the world" is, in any spelling: a set of CIDR blocks whose union covers every public
address of IPv4 or of IPv6. `0.0.0.0/0` is the world, and so are `0.0.0.0/1 + 128.0.0.0/1`,
`::/1 + 8000::/1`, `2000::/3` (all of IPv6's global unicast) and a list that leaves out only
private or reserved space. The config (access CIDRs) and the policy pack (rules, split or not)
both ask this module, so the two cannot disagree.

Why public addresses rather than the whole family: a list that opens everything except 10/8 is
the internet all the same. The addresses that are not public are those IANA's special-purpose
registries mark not globally reachable (RFC 6890 and its updates):
https://www.iana.org/assignments/iana-ipv4-special-registry and
https://www.iana.org/assignments/iana-ipv6-special-registry; plus, for IPv4, multicast
(224.0.0.0/4, never a TCP source), and for IPv6 everything outside global unicast 2000::/3
(RFC 4291 section 2.4).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

EVERY_IPV4 = ipaddress.IPv4Network("0.0.0.0/0")
EVERY_IPV6 = ipaddress.IPv6Network("::/0")

NOT_PUBLIC_IPV4 = tuple(
    ipaddress.IPv4Network(block)
    for block in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # private (RFC 1918)
        "100.64.0.0/10",  # shared address space (RFC 6598)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link local
        "172.16.0.0/12",  # private (RFC 1918)
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation (TEST-NET-1)
        "192.168.0.0/16",  # private (RFC 1918)
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation (TEST-NET-2)
        "203.0.113.0/24",  # documentation (TEST-NET-3)
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the limited broadcast address
    )
)
NOT_PUBLIC_IPV6 = tuple(
    ipaddress.IPv6Network(block)
    for block in (
        "::/3",  # outside global unicast (loopback, IPv4-mapped, discard, ...)
        "4000::/2",
        "8000::/1",  # ... and unique local fc00::/7, link local fe80::/10, multicast ff00::/8
        "2001::/23",  # IETF protocol assignments
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
    )
)


def worlds(cidrs: Iterable[Network]) -> list[Network]:
    """The families (0.0.0.0/0, ::/0) whose every public address the union of `cidrs` covers."""
    blocks = list(cidrs)
    found: list[Network] = []
    for every, not_public in ((EVERY_IPV4, NOT_PUBLIC_IPV4), (EVERY_IPV6, NOT_PUBLIC_IPV6)):
        same = [block for block in blocks if block.version == every.version]
        if same and list(ipaddress.collapse_addresses([*same, *not_public])) == [every]:  # type: ignore[list-item]
            found.append(every)
    return found


def is_world(cidr: Network) -> bool:
    """Does this one block reach every public address of its family (0.0.0.0/0, ::/0, 2000::/3)?"""
    return bool(worlds([cidr]))


def family(cidr: Network) -> str:
    return f"IPv{cidr.version}"
