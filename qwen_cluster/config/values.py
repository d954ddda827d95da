"""The value types the config sections are made of: IPv4 addresses and networks, CIDR blocks
(either family), and the base every section model shares.

Each type parses the spelling users write and fails with a message that names the value.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer
from pydantic.alias_generators import to_camel

# The key under a field's json_schema_extra that says what a default of None stands for
# (e.g. "the master"): the config reference prints it instead of "none".
COMPUTED_DEFAULT = "computedDefault"


def computed_default(text: str) -> dict[str, Any]:
    """`Field(json_schema_extra=computed_default("the master"))`: the program picks the value."""
    return {COMPUTED_DEFAULT: text}


def _ipv4_address(value: object) -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(str(value).strip())
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 address") from None


def _ipv4_network(value: object) -> ipaddress.IPv4Network:
    try:
        return ipaddress.IPv4Network(str(value).strip())
    except ipaddress.NetmaskValueError:
        raise ValueError(f"{value!r} has an invalid prefix length") from None
    except ValueError as exc:
        if "host bits set" in str(exc):
            fixed = ipaddress.IPv4Network(str(value).strip(), strict=False)
            raise ValueError(f"{value!r} has host bits set (did you mean {fixed}?)") from None
        raise ValueError(f"{value!r} is not an IPv4 network in CIDR notation") from None


def _any_network(value: object) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    text = str(value).strip()
    if "/" not in text:
        raise ValueError(f"{value!r} is not a CIDR block (write e.g. 10.0.0.0/8 or 203.0.113.10/32)")
    try:
        return ipaddress.ip_network(text)
    except ValueError as exc:
        if "host bits set" in str(exc):
            fixed = ipaddress.ip_network(text, strict=False)
            raise ValueError(f"{value!r} has host bits set (did you mean {fixed}?)") from None
        raise ValueError(f"{value!r} is not a CIDR block") from None


IPv4 = Annotated[ipaddress.IPv4Address, BeforeValidator(_ipv4_address), PlainSerializer(str)]
IPv4Net = Annotated[ipaddress.IPv4Network, BeforeValidator(_ipv4_network), PlainSerializer(str)]
Cidr = Annotated[
    ipaddress.IPv4Network | ipaddress.IPv6Network,
    BeforeValidator(_any_network),
    PlainSerializer(str),
]


class Section(BaseModel):
    """A config section: camelCase keys as written in the stack file, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)
