"""Resource properties as the policies see them, normalized: ingress rules, GPU nodes, host firewalls.

Pure functions over plain mappings (the engine's camelCase input names). Nothing here imports
pulumi or pulumi_policy, so every awkward spelling is unit-tested on its own.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qwen_cluster import catalog, kvlink, world
from qwen_cluster import tags as contract
from qwen_cluster.ports import PortRange, parse_port_range
from qwen_cluster.render import firewall

# Resource type tokens the pack inspects.
INSTANCE = "aws:ec2/instance:Instance"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
AUTOSCALING_GROUP = "aws:autoscaling/group:Group"
NETWORK_INTERFACE = "aws:ec2/networkInterface:NetworkInterface"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
EGRESS_RULE = "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
TARGET_GROUP = "aws:lb/targetGroup:TargetGroup"
TARGET_GROUP_ATTACHMENT = "aws:lb/targetGroupAttachment:TargetGroupAttachment"
LISTENER = "aws:lb/listener:Listener"
LOAD_BALANCER = "aws:lb/loadBalancer:LoadBalancer"
REMOTE_COMMAND = "command:remote:Command"
LOCAL_COMMAND = "command:local:Command"
# What a node runs through SSM: the AWS target runs the model server from these, not from user data.
SSM_DOCUMENT = "aws:ssm/document:Document"
SSM_ASSOCIATION = "aws:ssm/association:Association"
COMPUTE_TYPES = (INSTANCE, LAUNCH_TEMPLATE, AUTOSCALING_GROUP)
RULE_TYPES = (SECURITY_GROUP, SECURITY_GROUP_RULE, INGRESS_RULE, EGRESS_RULE)

# The tag contract with the components, defined once in qwen_cluster/tags.py.
ROLE_TAG = contract.ROLE_TAG
NODE_TAG = contract.NODE_TAG  # the node's name from qwen-cluster:nodes, on AWS GPU nodes
GPU_NODE = contract.GPU_NODE
NODE_SG = contract.NODE_SG
LB_SG = contract.LB_SG
MONITORING_SG = contract.MONITORING_SG
BASTION_SG = contract.BASTION_SG


class Unknown:
    """A value the engine cannot know yet (preview of a resource not created)."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = Unknown()


def get(props: Any, *path: str | int, default: Any = None) -> Any:
    """props[path...] or `default`; UNKNOWN where the engine's proxy says the value is unknown.

    Policies receive proxies that raise on unknown values; one unknown field must not stop
    the checks that do not need it."""
    value = props
    for key in path:
        try:
            if isinstance(key, int):
                if not is_list(value) or key >= len(value):
                    return default
                value = value[key]
            else:
                if not isinstance(value, Mapping) or key not in value:
                    return default
                value = value[key]
        except Exception as exc:  # pulumi_policy's UnknownValueError, without importing it here
            if type(exc).__name__ == "UnknownValueError":
                return UNKNOWN
            raise
    return default if value is None else value


def integral(value: Any) -> int | None:
    """An integer as the engine sends it, else None. Properties travel as protobuf Structs, whose
    numbers are doubles: a port of 5000 arrives as 5000.0. Booleans are not numbers here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def number(value: Any) -> float | None:
    """A real number (int or float, not bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def items(props: Any, *path: str) -> list[Any]:
    """A list property as a list ([] when absent or unknown)."""
    value = get(props, *path)
    if not is_list(value):
        return []
    out = []
    for index in range(len(value)):
        out.append(get(value, index))
    return out


def truthy(value: Any) -> bool | None:
    """true/"true"/True -> True, false/"false" -> False; None when absent or unknown."""
    if value is None or value is UNKNOWN:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value.strip().lower() in ("true", "1", "yes"):
            return True
        if value.strip().lower() in ("false", "0", "no", ""):
            return False
    return bool(value)


def tags_of(props: Any) -> dict[str, str]:
    """Tags as a dict: `tags` maps, autoscaling `tags` lists of {key, value}, and tag specifications."""
    tags: dict[str, str] = {}
    raw = get(props, "tags")
    if isinstance(raw, Mapping):
        tags.update({str(k): str(get(raw, k)) for k in raw})
    for entry in items(props, "tags"):
        if isinstance(entry, Mapping) and get(entry, "key"):
            tags[str(get(entry, "key"))] = str(get(entry, "value", default=""))
    for spec in items(props, "tagSpecifications"):
        inner = get(spec, "tags")
        if isinstance(inner, Mapping):
            for k in inner:
                tags.setdefault(str(k), str(get(inner, k)))
    return tags


def role_of(props: Any) -> str | None:
    return tags_of(props).get(ROLE_TAG)


# --- GPU nodes --------------------------------------------------------------------------------


def instance_types_of(resource_type: str, props: Any) -> list[str]:
    """The instance types a compute resource launches (ASG overrides, an instance, a template)."""
    if resource_type == AUTOSCALING_GROUP:
        overrides = items(props, "mixedInstancesPolicy", "launchTemplate", "overrides")
        return [str(get(o, "instanceType")) for o in overrides if isinstance(get(o, "instanceType"), str)]
    kind = get(props, "instanceType")
    return [kind] if isinstance(kind, str) else []


def is_gpu_node(resource_type: str, props: Any) -> bool:
    """Tagged gpu-node, or launching a GPU family type (g*, p*) whatever its tags."""
    if resource_type not in COMPUTE_TYPES:
        return False
    if role_of(props) == GPU_NODE:
        return True
    return any(catalog.is_gpu_family(kind) for kind in instance_types_of(resource_type, props))


def node_count(resource_type: str, props: Any) -> int:
    """How many machines a compute resource stands for (a template launches none by itself)."""
    if resource_type == INSTANCE:
        return 1
    if resource_type == AUTOSCALING_GROUP:
        for key in ("desiredCapacity", "minSize"):
            value = integral(get(props, key))
            if value is not None:
                return value
    return 0


# --- protocols, ports, peers ------------------------------------------------------------------

_PROTOCOLS = {"-1": "all", "all": "all", "6": "tcp", "tcp": "tcp", "17": "udp", "udp": "udp"}
_PROTOCOLS |= {"1": "icmp", "icmp": "icmp", "58": "icmpv6", "icmpv6": "icmpv6"}


def protocol_name(value: Any) -> str:
    """-1/all/ALL -> all, tcp/TCP/6 -> tcp, udp/17 -> udp; anything else lower-cased as is."""
    text = str(value).strip().lower() if value is not None and value is not UNKNOWN else "all"
    return _PROTOCOLS.get(text, text)


def port_span(protocol: str, from_port: Any, to_port: Any) -> PortRange | None:
    """The ports a rule opens; None means every port (all traffic, or 0-65535 / -1 spellings)."""
    if protocol == "all":
        return None
    if protocol in ("icmp", "icmpv6"):
        return PortRange(0, 0)  # no ports at all; ICMP carries type/code in these fields
    numbers = []
    for value in (from_port, to_port):
        if value is None or value is UNKNOWN:
            numbers.append(None)
        elif isinstance(value, str):
            numbers.append(int(value.strip()) if re.fullmatch(r"\s*-?\d+\s*", value) else None)
        else:
            numbers.append(integral(value))
    low, high = numbers
    if low is None and high is None:
        return None
    low = high if low is None else low
    high = low if high is None else high
    if low < 0 or high < 0 or (low <= 1 and high >= 65535):
        return None
    return PortRange(max(low, 0), min(high, 65535))


def network(value: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    if not isinstance(value, str):
        return None
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        return None


def is_world(cidr: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """One block that reaches every public address of its family (qwen_cluster/world.py)."""
    return world.is_world(cidr)


@dataclass(frozen=True)
class Peer:
    """Who an ingress rule admits: a CIDR block, a security group (by resource name or raw id), self."""

    kind: str  # "cidr" | "sg" | "self" | "prefix-list" | "unknown"
    cidr: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    ref: str = ""  # security group: resource name when resolved, else the raw id; cidr: its parts

    def __str__(self) -> str:
        if self.kind == "cidr" and self.ref:  # the world split across rules: ref names the parts
            return f"{self.ref} (together every public {world.family(self.cidr)} address: the world)"
        if self.kind == "cidr":
            return str(self.cidr)
        if self.kind == "self":
            return "its own security group"
        if self.kind == "sg":
            return f"security group {self.ref}"
        return f"{self.kind} {self.ref}".strip()


@dataclass(frozen=True)
class Rule:
    """One ingress or egress permission, whatever resource spelled it."""

    resource: str  # the resource that declares it
    resource_type: str
    index: int | None  # position in an inline list / a firewall document
    direction: str  # "ingress" | "egress"
    protocol: str  # "all", "tcp", "udp", ...
    ports: PortRange | None  # None: every port
    peers: tuple[Peer, ...]
    description: str
    group: str | None = None  # the security group (resource name or raw id) it belongs to; None: unknown
    host: str | None = None  # bare metal: the host whose firewall it is

    @property
    def all_traffic(self) -> bool:
        """Every protocol and port (-1/all): what EFA and NCCL need between members."""
        return self.protocol == "all"

    def opens(self, port: int) -> bool:
        if self.protocol not in ("all", "tcp"):
            return False
        return self.ports is None or port in self.ports

    def overlaps(self, span: PortRange) -> bool:
        if self.protocol not in ("all", "tcp", "udp"):
            return False
        return self.ports is None or self.ports.overlaps(span)

    @property
    def where(self) -> str:
        spot = f"{self.resource}" + (f" {self.direction}[{self.index}]" if self.index is not None else "")
        what = "all traffic" if self.ports is None else f"{self.ports}/{self.protocol}"
        return f"{spot} ({what})"


def _cidr_peers(values: list[Any]) -> list[Peer]:
    peers = []
    for value in values:
        if value is UNKNOWN:
            peers.append(Peer("unknown", ref="cidr"))
        elif (cidr := network(value)) is not None:
            peers.append(Peer("cidr", cidr))
    return peers


def rules_of(
    resource_type: str, name: str, props: Any, resolve: Any = None, own_group: str | None = None
) -> list[Rule]:
    """Every permission a resource declares. `resolve(prop, value)` maps a security-group id
    to a resource name (the stack policy knows the stack; alone, ids stay raw)."""

    def ref(prop: str, value: Any) -> str:
        if resolve is not None:
            found = resolve(prop, value)
            if found:
                return found
        return "<unknown>" if value is UNKNOWN else str(value)

    rules: list[Rule] = []
    if resource_type == SECURITY_GROUP:
        group = own_group or name
        for direction in ("ingress", "egress"):
            for index, entry in enumerate(items(props, direction)):
                protocol = protocol_name(get(entry, "protocol"))
                peers = _cidr_peers(items(entry, "cidrBlocks") + items(entry, "ipv6CidrBlocks"))
                peers += [
                    Peer("sg", ref=ref(f"{direction}.securityGroups", sg))
                    for sg in items(entry, "securityGroups")
                ]
                peers += [Peer("prefix-list", ref=str(p)) for p in items(entry, "prefixListIds")]
                if truthy(get(entry, "self")):
                    peers.append(Peer("self"))
                rules.append(
                    Rule(
                        name,
                        resource_type,
                        index,
                        direction,
                        protocol,
                        port_span(protocol, get(entry, "fromPort"), get(entry, "toPort")),
                        tuple(peers),
                        str(get(entry, "description", default="")),
                        group,
                    )
                )
    elif resource_type == SECURITY_GROUP_RULE:
        protocol = protocol_name(get(props, "protocol"))
        group = own_group or ref("securityGroupId", get(props, "securityGroupId"))
        peers = _cidr_peers(items(props, "cidrBlocks") + items(props, "ipv6CidrBlocks"))
        source = get(props, "sourceSecurityGroupId")
        if source is not None:
            peer_ref = ref("sourceSecurityGroupId", source)
            peers.append(Peer("self") if peer_ref == group else Peer("sg", ref=peer_ref))
        peers += [Peer("prefix-list", ref=str(p)) for p in items(props, "prefixListIds")]
        if truthy(get(props, "self")):
            peers.append(Peer("self"))
        direction = "egress" if str(get(props, "type", default="ingress")).lower() == "egress" else "ingress"
        rules.append(
            Rule(
                name,
                resource_type,
                None,
                direction,
                protocol,
                port_span(protocol, get(props, "fromPort"), get(props, "toPort")),
                tuple(peers),
                str(get(props, "description", default="")),
                group,
            )
        )
    elif resource_type in (INGRESS_RULE, EGRESS_RULE):
        protocol = protocol_name(get(props, "ipProtocol"))
        group = own_group or ref("securityGroupId", get(props, "securityGroupId"))
        peers = _cidr_peers([v for v in (get(props, "cidrIpv4"), get(props, "cidrIpv6")) if v is not None])
        referenced = get(props, "referencedSecurityGroupId")
        if referenced is not None:
            peer_ref = ref("referencedSecurityGroupId", referenced)
            peers.append(Peer("self") if peer_ref == group else Peer("sg", ref=peer_ref))
        if get(props, "prefixListId") is not None:
            peers.append(Peer("prefix-list", ref=str(get(props, "prefixListId"))))
        rules.append(
            Rule(
                name,
                resource_type,
                None,
                "egress" if resource_type == EGRESS_RULE else "ingress",
                protocol,
                port_span(protocol, get(props, "fromPort"), get(props, "toPort")),
                tuple(peers),
                str(get(props, "description", default="")),
                group,
            )
        )
    elif resource_type == REMOTE_COMMAND:
        for document in firewall_documents(props):
            for index, entry in enumerate(document.rules):
                rules.append(
                    Rule(
                        name,
                        resource_type,
                        index,
                        entry.direction,
                        entry.protocol,
                        entry.ports,
                        tuple(Peer("cidr", cidr) for cidr in entry.sources),
                        entry.description,
                        host=document.host,
                    )
                )
    return rules


# --- bare-metal host firewalls ----------------------------------------------------------------

FIREWALL_SCHEMA = firewall.DOCUMENT_SCHEMA
"""The document a bare-metal firewall `command:remote:Command` carries: one element of its
`triggers` (as an object or as its JSON text), or a `<<'QWEN_FIREWALL_DOCUMENT'` heredoc in its
`create`/`update` script, which is where the bare-metal target puts it
(`qwen_cluster.render.firewall.policy_document` writes it from the rules the script installs):

    {
      "schema": "qwen-cluster/host-firewall@1",
      "host": "master",                     # node name
      "address": "192.168.1.100",           # the host's IP on the node segment
      "role": "gpu-node",                   # every cluster node
      "nicSpeedGbps": 25,                   # bareMetal.nicSpeedGbps (the declared NIC speed)
      "loadBalancer": true,                 # nginx runs here
      "listenerPort": 80,                   # the nginx listener (load-balancer host only, else null)
      "rules": [                            # what the host firewall allows (default deny)
        {"action": "allow", "direction": "in", "protocol": "tcp",   # tcp | udp | all
         "ports": "5000",                   # "5000", "6000-6100", 5000, or null for every port
         "sources": ["192.168.1.100/32"],   # CIDRs; [] or absent means anywhere
         "description": "model-service 5000/tcp from the load balancer only"}
      ]
    }

Only `allow` rules open anything; `deny` rules are ignored (the default is deny).
"""


@dataclass(frozen=True)
class FirewallRule:
    direction: str
    protocol: str
    ports: PortRange | None
    sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    description: str


@dataclass(frozen=True)
class HostFirewall:
    host: str
    address: str
    role: str
    nic_speed_gbps: float | None
    load_balancer: bool
    listener_port: int | None
    rules: tuple[FirewallRule, ...] = field(default_factory=tuple)
    problems: tuple[str, ...] = ()  # entries the policy could not read


def _document_candidates(props: Any) -> Iterator[Any]:
    # The bare-metal target writes the document into the firewall script (a heredoc the
    # script leaves on the host), not into `triggers`, which would make every change of it a
    # replacement (qwen_cluster/render/firewall.py embedded_documents).
    embedded = [text for key in ("create", "update") for text in firewall.embedded_documents(get(props, key))]
    for trigger in [*items(props, "triggers"), *embedded]:
        if isinstance(trigger, str):
            try:
                trigger = json.loads(trigger)
            except (json.JSONDecodeError, TypeError):
                continue
        if isinstance(trigger, Mapping) and get(trigger, "schema") == FIREWALL_SCHEMA:
            yield trigger


def firewall_documents(props: Any) -> list[HostFirewall]:
    """The host-firewall documents in a command's triggers (usually none or one)."""
    documents = []
    for raw in _document_candidates(props):
        rules: list[FirewallRule] = []
        problems: list[str] = []
        for index, entry in enumerate(items(raw, "rules")):
            if str(get(entry, "action", default="allow")).lower() != "allow":
                continue
            direction = "egress" if str(get(entry, "direction", default="in")).lower() == "out" else "ingress"
            protocol = protocol_name(get(entry, "protocol", default="tcp"))
            ports_value = get(entry, "ports")
            if integral(ports_value) is not None:
                ports_value = integral(ports_value)  # an object trigger's 5000 arrives as 5000.0
            try:
                ports = None if ports_value is None or protocol == "all" else parse_port_range(ports_value)
            except ValueError as exc:
                problems.append(f"rules[{index}].ports {exc}")
                continue
            if ports is not None and ports.low <= 1 and ports.high >= 65535:
                ports = None
            sources = []
            for source in items(entry, "sources") or ["0.0.0.0/0", "::/0"]:
                cidr = network(source)
                if cidr is None:
                    problems.append(f"rules[{index}].sources {source!r} is not a CIDR block")
                    continue
                sources.append(cidr)
            rules.append(
                FirewallRule(
                    direction, protocol, ports, tuple(sources), str(get(entry, "description", default=""))
                )
            )
        speed = number(get(raw, "nicSpeedGbps"))
        documents.append(
            HostFirewall(
                host=str(get(raw, "host", default="")),
                address=str(get(raw, "address", default="")),
                role=str(get(raw, "role", default=GPU_NODE)),
                nic_speed_gbps=speed,
                load_balancer=bool(truthy(get(raw, "loadBalancer"))),
                listener_port=integral(get(raw, "listenerPort")),
                rules=tuple(rules),
                problems=tuple(problems),
            )
        )
    return documents


# --- disaggregated serving -------------------------------------------------------------------

KV_LINK = kvlink.DECLARATION_TYPE
KV_LINK_SCHEMA = kvlink.SCHEMA


def plain(value: Any) -> Any:
    """A property as plain Python (dicts, lists, strings, numbers), read through the engine's proxy;
    UNKNOWN when any part of it is unknown (a preview)."""
    if isinstance(value, Mapping):
        result = {}
        for key in value:
            inner = plain(get(value, key))
            if inner is UNKNOWN:
                return UNKNOWN
            result[str(key)] = inner
        return result
    if is_list(value):
        listed = [plain(get(value, index)) for index in range(len(value))]
        return UNKNOWN if any(item is UNKNOWN for item in listed) else listed
    return value


def kv_link_declaration(resource_type: str, props: Any) -> dict[str, Any] | Unknown | None:
    """The `qwen-cluster/kv-link@1` document a disaggregated stack registers
    (qwen_cluster/kvlink.py declaration), as plain data; None on any other resource."""
    if resource_type != KV_LINK or get(props, "schema") != KV_LINK_SCHEMA:
        return None
    return plain(props)


# --- commands and user data -------------------------------------------------------------------

SELINUX_OFF = re.compile(
    r"setenforce\s+(0|permissive)\b|SELINUX\s*=\s*(disabled|permissive)\b|\bselinux\s*=\s*0\b"
    r"|selinux-activate\s+--disable|grubby\b[^\n]*selinux=0",
    re.IGNORECASE,
)


def texts_of(resource_type: str, props: Any) -> list[tuple[str, str]]:
    """(where, text) for everything a resource runs: command scripts, user data (base64 too)."""
    texts: list[tuple[str, str]] = []
    if resource_type in (REMOTE_COMMAND, LOCAL_COMMAND):
        for key in ("create", "update", "delete"):
            value = get(props, key)
            if isinstance(value, str):
                texts.append((key, value))
        stdin = get(props, "stdin")
        if isinstance(stdin, str):
            texts.append(("stdin", stdin))
    elif resource_type in (INSTANCE, LAUNCH_TEMPLATE):
        for key in ("userData", "userDataBase64"):
            value = get(props, key)
            if isinstance(value, str):
                texts.append((key, value))
                decoded = _maybe_base64(value)
                if decoded is not None:
                    texts.append((f"{key} (base64-decoded)", decoded))
    elif resource_type == SSM_DOCUMENT:
        content = get(props, "content")
        if isinstance(content, str):
            texts.append(("content", content))
            try:
                steps = json.loads(content).get("mainSteps") or []
            except (ValueError, AttributeError):
                steps = []
            for index, step in enumerate(steps if is_list(steps) else []):
                commands = (step.get("inputs") or {}).get("runCommand") if isinstance(step, dict) else None
                if isinstance(commands, list):
                    texts.append((f"mainSteps[{index}].runCommand", "\n".join(map(str, commands))))
    elif resource_type == SSM_ASSOCIATION:
        parameters = get(props, "parameters")
        for key in list(parameters) if isinstance(parameters, Mapping) else []:
            value = get(parameters, key)  # UNKNOWN in a preview when it comes from an output
            for item in items(parameters, key) if is_list(value) else [value]:
                if not isinstance(item, str):
                    continue
                texts.append((f"parameters.{key}", item))
                decoded = _maybe_base64(item)
                if decoded is not None:
                    texts.append((f"parameters.{key} (base64-decoded)", decoded))
    return texts


def _maybe_base64(value: str) -> str | None:
    compact = "".join(value.split())
    if not compact or len(compact) % 4 or not re.fullmatch(r"[A-Za-z0-9+/=]+", compact):
        return None
    try:
        return base64.b64decode(compact, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
