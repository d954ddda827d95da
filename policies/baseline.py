"""The security baseline, one resource at a time: IMDSv2, encrypted EBS, no public IP on GPU
nodes, described rules, health checks, idle timeouts long enough to stream, SELinux enforcing,
TLS listeners with a current security policy.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

from pulumi_policy import ReportViolation, ResourceValidationArgs, Severity

from policies import normalized as net
from policies.declaration import ADVISORY, MANDATORY, Settings, resource_policy
from policies.normalized import UNKNOWN, get, items

# A streamed, thinking-mode answer can stay silent for minutes; AWS's NLB default (350 s)
# and nginx's (60 s) cut it. Ten minutes is the least we accept without a warning.
STREAMING_IDLE_FLOOR_SECONDS = 600
NLB_DEFAULT_IDLE_SECONDS = 350  # tcp.idle_timeout.seconds default
ALB_DEFAULT_IDLE_SECONDS = 60


def _launched_from_template(props: Any) -> bool:
    return isinstance(get(props, "launchTemplate"), Mapping)


@resource_policy(
    name="baseline-imdsv2",
    description="Instances and launch templates require IMDSv2 (metadataOptions.httpTokens = required).",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Set metadata_options={'http_tokens': 'required'} (hop limit 2 for containers).",
)
def imdsv2(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    if args.resource_type not in (net.INSTANCE, net.LAUNCH_TEMPLATE):
        return
    tokens = get(args.props, "metadataOptions", "httpTokens")
    if tokens is None and args.resource_type == net.INSTANCE and _launched_from_template(args.props):
        return  # the launch template's own options apply (and are checked there)
    if tokens is UNKNOWN:
        return
    if tokens != "required":
        report(
            f"metadataOptions.httpTokens is {tokens or 'unset (IMDSv1 allowed)'}; set it to required (IMDSv2)"
        )


@resource_policy(
    name="baseline-ebs-encryption",
    description="EBS volumes of instances and launch templates are encrypted.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Declare root_block_device / block_device_mappings with encrypted=True.",
)
def ebs_encryption(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    if args.resource_type == net.INSTANCE:
        root = get(args.props, "rootBlockDevice")
        if root is None and not _launched_from_template(args.props):
            report(
                "rootBlockDevice is not declared, so the root volume is not encrypted; set encrypted: true"
            )
        elif root is not None and net.truthy(get(root, "encrypted")) is not True:
            report("rootBlockDevice.encrypted is not true")
        for index, device in enumerate(items(args.props, "ebsBlockDevices")):
            if net.truthy(get(device, "encrypted")) is not True:
                report(
                    f"ebsBlockDevices[{index}] ({get(device, 'deviceName', default='?')}) is not encrypted"
                )
    elif args.resource_type == net.LAUNCH_TEMPLATE:
        mappings = [m for m in items(args.props, "blockDeviceMappings") if get(m, "ebs") is not None]
        if not mappings:
            report("blockDeviceMappings declares no EBS volume, so the root volume is not encrypted")
        for index, mapping in enumerate(mappings):
            if net.truthy(get(mapping, "ebs", "encrypted")) is not True:
                report(
                    f"blockDeviceMappings[{index}] ({get(mapping, 'deviceName', default='?')}) "
                    "is not encrypted"
                )
    elif (
        args.resource_type == "aws:ebs/volume:Volume" and net.truthy(get(args.props, "encrypted")) is not True
    ):
        report("the volume is not encrypted")


@resource_policy(
    name="baseline-no-public-ip",
    description="GPU nodes have no public IP address.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Set associate_public_ip_address=False; clients reach the model through the load "
    "balancer, admins through the bastion.",
)
def no_public_ip(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    if not net.is_gpu_node(args.resource_type, args.props):
        return
    if net.truthy(get(args.props, "associatePublicIpAddress")):
        report("associatePublicIpAddress is true on a GPU node; nodes are reached through the load balancer")
    for index, entry in enumerate(items(args.props, "networkInterfaces")):
        if net.truthy(get(entry, "associatePublicIpAddress")):
            report(f"networkInterfaces[{index}].associatePublicIpAddress is true on a GPU node")


@resource_policy(
    name="baseline-rule-descriptions",
    description="Every security-group and host-firewall rule has a description.",
    enforcement_level=MANDATORY,
    severity=Severity.LOW,
    remediation_steps="Give the rule a description naming its port-table entry and its peer.",
)
def rule_descriptions(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    for rule in net.rules_of(args.resource_type, args.name, args.props):
        if not rule.description.strip():
            report(f"{rule.where} has no description; say who needs it and why")
    if args.resource_type == net.REMOTE_COMMAND:
        for doc in net.firewall_documents(args.props):
            for problem in doc.problems:
                report(f"host {doc.host} firewall {problem}")


@resource_policy(
    name="baseline-health-check",
    description="Load balancer target groups declare an enabled health check.",
    enforcement_level=MANDATORY,
    severity=Severity.MEDIUM,
    remediation_steps="Set health_check={'enabled': True, 'protocol': 'HTTP', 'path': '/health', 'port': "
    "'traffic-port'} on the target group.",
)
def health_check(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    if args.resource_type != net.TARGET_GROUP:
        return
    check = get(args.props, "healthCheck")
    if check is None:
        report("the target group declares no healthCheck; a dead model server would keep receiving requests")
    elif net.truthy(get(check, "enabled")) is False:
        report("healthCheck.enabled is false; a dead model server would keep receiving requests")


_NGINX_TIMEOUT = re.compile(r"\b(proxy_read_timeout|proxy_send_timeout)\s+(\d+)\s*(ms|s|m|h|d)?\s*;")
_UNIT_SECONDS = {None: 1, "s": 1, "ms": 0.001, "m": 60, "h": 3600, "d": 86400}


@resource_policy(
    name="baseline-idle-timeout",
    description="The load balancer's idle timeout is long enough for streamed, thinking-mode answers.",
    enforcement_level=ADVISORY,
    severity=Severity.LOW,
    remediation_steps="Raise loadBalancer.idleTimeoutSeconds (NLB tcp_idle_timeout_seconds up to 6000; "
    "nginx proxy_read_timeout / proxy_send_timeout).",
    config_schema={
        "minIdleTimeoutSeconds": {
            "type": "integer",
            "minimum": 1,
            "default": STREAMING_IDLE_FLOOR_SECONDS,
            "description": "Least idle timeout on the load balancer for streamed responses",
        }
    },
)
def idle_timeout(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    floor = settings["minIdleTimeoutSeconds"]
    if args.resource_type == net.LISTENER:
        protocol = str(get(args.props, "protocol", default="")).upper()
        if protocol in ("TCP", "TLS", "TCP_UDP"):
            value = net.number(get(args.props, "tcpIdleTimeoutSeconds", default=NLB_DEFAULT_IDLE_SECONDS))
            if value is not None and value < floor:
                report(
                    f"tcpIdleTimeoutSeconds {value:g} is below {floor} s: "
                    "a silent, thinking answer is cut off"
                )
    elif args.resource_type == net.LOAD_BALANCER:
        if str(get(args.props, "loadBalancerType", default="application")) == "application":
            value = net.number(get(args.props, "idleTimeout", default=ALB_DEFAULT_IDLE_SECONDS))
            if value is not None and value < floor:
                report(f"idleTimeout {value:g} is below {floor} s: a silent, thinking answer is cut off")
    else:
        for where, text in net.texts_of(args.resource_type, args.props):
            # Per directive, the longest value in the text: the one on the model's streams. A
            # short one on another location (a health check) cuts no answer. The bare-metal
            # load balancer's config travels in a command script (its install step).
            longest: dict[str, tuple[float, re.Match[str]]] = {}
            for match in _NGINX_TIMEOUT.finditer(text):
                seconds = int(match.group(2)) * _UNIT_SECONDS[match.group(3)]
                if seconds >= longest.get(match.group(1), (-1.0, match))[0]:
                    longest[match.group(1)] = (seconds, match)
            for seconds, match in longest.values():
                if seconds < floor:
                    report(
                        f"{where}: nginx {match.group(1)} {match.group(2)}{match.group(3) or ''} "
                        f"is below {floor} s"
                    )


@resource_policy(
    name="baseline-selinux",
    description="No command or user data disables SELinux.",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Keep SELinux enforcing; label what needs access (semanage, a policy module) "
    "instead of setenforce 0.",
)
def selinux(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    for where, text in net.texts_of(args.resource_type, args.props):
        match = net.SELINUX_OFF.search(text)
        if match:
            report(
                f"{where} runs {match.group(0)!r}: SELinux stays enforcing (write a policy module instead)"
            )


# Elastic Load Balancing's TLS 1.3 policies that negotiate TLS 1.2 or 1.3 only (2021-06 and newer,
# the PQ and FIPS variants included); ELBSecurityPolicy-TLS13-1-0-* and -1-1-* still allow TLS
# 1.0/1.1, and the API's default when sslPolicy is absent is ELBSecurityPolicy-2016-08, TLS 1.0
# (docs.aws.amazon.com/elasticloadbalancing/latest/network/describe-ssl-policies.html).
CURRENT_SSL_POLICIES = ("ELBSecurityPolicy-TLS13-1-2-*", "ELBSecurityPolicy-TLS13-1-3-*")
API_DEFAULT_SSL_POLICY = "ELBSecurityPolicy-2016-08"


@resource_policy(
    name="baseline-tls-policy",
    description="TLS and HTTPS listeners name a current security policy (TLS 1.2 and 1.3 only).",
    enforcement_level=MANDATORY,
    severity=Severity.HIGH,
    remediation_steps="Set ssl_policy to a current policy such as "
    f"ELBSecurityPolicy-TLS13-1-2-Res-PQ-2025-09; without one the API applies {API_DEFAULT_SSL_POLICY}, "
    "which allows TLS 1.0.",
    config_schema={
        "currentSslPolicies": {
            "type": "array",
            "items": {"type": "string"},
            "default": list(CURRENT_SSL_POLICIES),
            "description": "Security policies (shell patterns) a TLS/HTTPS listener may use",
        }
    },
)
def tls_policy(args: ResourceValidationArgs, report: ReportViolation, settings: Settings) -> None:
    if args.resource_type != net.LISTENER:
        return
    protocol = get(args.props, "protocol")
    if not isinstance(protocol, str) or protocol.upper() not in ("TLS", "HTTPS"):
        return
    policy = get(args.props, "sslPolicy")
    if policy is UNKNOWN:
        return
    if not policy:
        report(
            f"a {protocol.upper()} listener without sslPolicy gets the API default {API_DEFAULT_SSL_POLICY}, "
            "which allows TLS 1.0 and 1.1; name a current policy"
        )
    elif not any(fnmatch.fnmatchcase(str(policy), pattern) for pattern in settings["currentSslPolicies"]):
        report(
            f"sslPolicy {policy} is not a current policy ({', '.join(settings['currentSslPolicies'])}): "
            "it may allow TLS 1.0/1.1 or weak ciphers"
        )
