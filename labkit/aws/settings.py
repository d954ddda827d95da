"""The AWS lab's plan and settings: the namespaces and addresses of a stack's lab, the stack config's
AWS departures, and the clock and stack kept between `up` and `upgrade`."""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.aws import model
from labkit.cluster import blueprint
from labkit.cluster.blueprint import STATE_ROOT, LabPlan, Member, namespace_prefix
from labkit.engine import substitutions
from qwen_cluster.config import NAMESPACE, ClusterConfig
from qwen_cluster.ports import Vantage
from tooling import stackfile

PROJECT_ROOT = Path(__file__).resolve().parents[2]
IMDS_ADDRESS = "169.254.169.254"
VPC_MTU = 9001  # every interface in a VPC (the user data sets it on the node's)
MOTO_PORT = 5100
API_CANDIDATES = ("198.51.100.20", "100.64.0.20", "192.0.2.20", "172.31.255.20")
DEPLOYER_KEY = "AKIALABDEPLOYER00000"  # the lab itself, as `pulumi up`'s credentials


class AwsLabError(RuntimeError):
    pass


@dataclass(frozen=True)
class AwsPlan:
    plan: LabPlan  # nodes, the client vantage, the load balancer (the `lb` namespace)
    api: Member
    stack: str  # the Pulumi stack name (parameter names, tags)

    @property
    def root(self) -> Path:
        return Path(self.plan.state_dir)

    def all_members(self) -> tuple[Member, ...]:
        return (*self.plan.members, self.plan.load_balancer, self.api)


def build(cluster: ClusterConfig, label: str, stack_config: dict[str, Any], stack: str = "") -> AwsPlan:
    """Namespaces for an AWS stack: one per GPU node at its pinned address, the load balancer in
    the node subnet (an internal NLB takes an address there), the AWS endpoints, a client."""
    if cluster.aws is None:
        raise blueprint.PlanError("labkit.aws builds AWS stacks only")
    prefix = namespace_prefix(label)
    segment = cluster.network.cidr
    node_ips = {str(node.ip) for node in cluster.nodes}
    nodes = tuple(
        Member(f"{prefix}node-{node.name}", str(node.ip), segment.prefixlen, f"n{index}", node=node.name)
        for index, node in enumerate(cluster.nodes)
    )
    # AWS keeps the first four addresses of a subnet and the last; the NLB takes one of the rest.
    free = [str(h) for h in list(segment.hosts())[3:] if str(h) not in node_ips]
    lb_member = Member(f"{prefix}lb", free[0], 32, "lb")
    access = cluster.access
    networks = [
        ipaddress.ip_network(c) for c in [*access.client_cidrs, *access.monitoring_cidrs, *access.admin_cidrs]
    ]
    client_ip = blueprint._first_host(
        [ipaddress.ip_network(c) for c in access.client_cidrs],
        [segment, *(ipaddress.ip_network(c) for c in [*access.monitoring_cidrs, *access.admin_cidrs])],
        node_ips | {free[0]},
    )
    if client_ip is None:
        raise blueprint.PlanError("access.clientCidrs has no address for the lab's client")
    client = Member(f"{prefix}client", client_ip, 32, "v0", vantage=Vantage.CLIENT, roles=(Vantage.CLIENT,))
    api_ip = next(
        ip
        for ip in API_CANDIDATES
        if not any(ipaddress.ip_address(ip) in net for net in [segment, *networks])
    )
    api = Member(f"{prefix}aws", api_ip, 32, "api")
    heads = tuple(next(m for m in nodes if m.node == head.name) for head in cluster.topology.heads)
    plan = LabPlan(
        label=label,
        cluster=cluster,
        switch=f"{prefix}switch",
        nodes=nodes,
        vantages=(client,),
        load_balancer=lb_member,
        heads=heads,
        stack_config=stack_config,
    )
    return AwsPlan(plan, api, stack or label)


def load(stack: str, label: str | None = None, root: Path | None = None) -> AwsPlan:
    raw = stackfile.read(stack) if root is None else stackfile.read(stack, root)
    cluster = stackfile.load(stack) if root is None else stackfile.load(stack, root)
    return build(cluster, label or stack, raw, stack)


def is_aws(stack: str, root: Path | None = None) -> bool:
    raw = stackfile.read(stack) if root is None else stackfile.read(stack, root)
    return raw.get(f"{NAMESPACE}:target") == "aws"


# --------------------------------------------------------------------------- stack config


def lab_config(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The AWS-specific departures of the stack config (the lab's common ones are applied by
    executor.render: the clock, the endpoint's secrets)."""
    config = json.loads(json.dumps(raw))
    made = []
    target = config.get(f"{NAMESPACE}:aws")
    if isinstance(target, dict) and target.get("efa"):
        # No EFA device in a namespace: the nodes run NCCL over TCP, as with aws.efa false.
        target["efa"] = False
        made.append("aws.efa true -> false (no EFA device in a namespace)")
    return config, made


# The lab clock of the lab being worked on: `up` sets it, `upgrade` reads it back from SETTINGS_FILE.
clock = 1 / 30

SETTINGS_FILE = "aws-lab.json"


def save_settings(aws_plan: AwsPlan, clock_scale: float) -> None:
    (aws_plan.root / SETTINGS_FILE).write_text(json.dumps({"clock": clock_scale, "stack": aws_plan.stack}))


def saved_settings(label: str) -> dict[str, Any]:
    """What `up` kept: {"clock": the lab clock, "stack": the Pulumi stack name}."""
    return json.loads((Path(STATE_ROOT) / label / SETTINGS_FILE).read_text())


def pace_documents(stack: model.AwsStack, clock_scale: float) -> list[str]:
    """The documents' polls on the lab's clock, as bare metal's scripts' (substitutions.script_clock):
    the health wait's 10 s. The model-server runs' health timeout (`HealthSeconds`) stays as
    configured: it bounds a container's start and a server's load, which run at real speed
    (substitutions.CLOCK_KEYS)."""
    made = set()
    for content in stack.documents.values():
        for step in content.get("mainSteps", []):
            inputs = step.get("inputs", {})
            lines = inputs.get("runCommand")
            if isinstance(lines, list):
                paced = [substitutions.script_clock(line, clock_scale) for line in lines]
                if paced != lines:
                    inputs["runCommand"] = paced
                    made.add(substitutions.SCRIPT_CLOCK_NOTE + ", in the documents")
    return sorted(made)


def s3_uri(cluster: ClusterConfig) -> str:
    weights = cluster.model.weights
    return weights.uri or "" if weights.source == "s3" else ""


def weights_bucket(uri: str) -> tuple[str, str] | None:
    if not uri.startswith("s3://"):
        return None
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    return bucket, prefix.rstrip("/")


def api_names(region: str, bucket: str | None) -> list[str]:
    """The endpoints the nodes' AWS CLI calls (regional; S3 virtual-hosted for the bucket)."""
    names = [f"ssm.{region}.amazonaws.com", f"elasticloadbalancing.{region}.amazonaws.com",
             f"s3.{region}.amazonaws.com", f"sts.{region}.amazonaws.com"]  # fmt: skip
    if bucket:
        names.append(f"{bucket}.s3.{region}.amazonaws.com")
    return names
