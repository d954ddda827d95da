"""The GPU nodes as the lab's machines: their links on the VPC switch, their /etc (the AWS endpoints,
IMDS), their disks and Docker engines, the images they pull, and the AWS CLI's waiters on the lab
clock."""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import gzip
import json
import re
import subprocess
from pathlib import Path

from labkit.aws import model, settings
from labkit.aws.machine import Machine
from labkit.aws.settings import (
    IMDS_ADDRESS,
    PROJECT_ROOT,
    VPC_MTU,
    AwsLabError,
    AwsPlan,
    api_names,
    pace_documents,
    s3_uri,
)
from labkit.cluster import endpoint, lifecycle
from labkit.cluster.blueprint import BRIDGE, MEMBER_IF, Member
from labkit.engine import substitutions
from labkit.engine.executor import StepResult
from labkit.hosts import dockerd, netns
from tooling import offline


def _link(aws_plan: AwsPlan, member: Member) -> None:
    plan = aws_plan.plan
    netns.add(member.namespace)
    have = netns.run(["ip", "-n", plan.switch, "link", "show", member.switch_port], check=False)
    if have.returncode != 0:
        netns.run(
            ["ip", "-n", plan.switch, "link", "add", member.switch_port, "mtu", str(VPC_MTU), "type", "veth"]
            + ["peer", "name", MEMBER_IF, "netns", member.namespace]
        )
    netns.run(["ip", "-n", plan.switch, "link", "set", member.switch_port, "master", BRIDGE, "up"])
    netns.run(
        ["ip", "-n", member.namespace, "addr", "replace", f"{member.ip}/{member.prefixlen}", "dev", MEMBER_IF]
    )
    netns.run(["ip", "-n", member.namespace, "link", "set", MEMBER_IF, "up"])
    for other in aws_plan.all_members():
        if other.ip != member.ip:
            netns.run(["ip", "-n", member.namespace, "route", "replace", f"{other.ip}/32", "dev", MEMBER_IF])


def access_key(node: str) -> str:
    return "ASIA" + model._hex(f"node:{node}", 16).upper()


def node_machines(
    aws_plan: AwsPlan, stack: model.AwsStack, identity: endpoint.Identity
) -> dict[str, Machine]:
    """Each GPU node as its instance: its own disk (machine.py) and its own Docker engine, which
    the real docker CLI reaches as DOCKER_HOST (a namespace is not a host: on EC2 the CLI finds
    /var/run/docker.sock)."""
    plan = aws_plan.plan
    root = aws_plan.root
    bin_dir = root / "aws-bin"
    substitutions.install_shims(bin_dir, PROJECT_ROOT)
    # `sysctl --system` applies the program's drop-in only: global keys are the machine's.
    (bin_dir / "sysctl").write_text(
        '#!/bin/sh\ncase " $* " in *" --system "*) exec /usr/sbin/sysctl -e -p '
        '/etc/sysctl.d/90-qwen-cluster.conf ;; esac\nexec /usr/sbin/sysctl "$@"\n'
    )
    (bin_dir / "sysctl").chmod(0o755)
    data_path = waiters_on_the_clock(root / "aws-data", settings.clock)
    machines = {}
    for member in plan.nodes:
        instance = stack.instances[member.node]
        env = {
            "AWS_CA_BUNDLE": identity.ca_file,
            "AWS_DATA_PATH": str(data_path),
            "DOCKER_HOST": lifecycle.daemon(plan, member).host,
        }
        machines[member.node] = Machine(
            instance, member.namespace, node_root(aws_plan, member), bin_dir, env,
            mark=lifecycle.mark(plan, member, "disk"),
        )  # fmt: skip
    return machines


# The waiters the node scripts call (`aws elbv2 wait target-deregistered|target-in-service`).
WAITER_SERVICES = ("elbv2/2015-12-01",)


def cli_data_dir() -> Path:
    """The AWS CLI's own botocore data (Debian's awscli v2 bundles its botocore)."""
    done = subprocess.run(
        ["/usr/bin/python3", "-c", "import awscli.botocore as b, os; print(os.path.dirname(b.__file__))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(done.stdout.strip()) / "data"


def waiters_on_the_clock(directory: Path, clock: float) -> Path:
    """The CLI's waiters with their poll delay on the lab clock (15 s x 1/30, at least 1 s), as the
    health check and the deregistration delay are; their attempts unchanged, so a waiter still
    gives up no sooner than the lab-clock image of its 10 minutes. Found by the CLI through
    AWS_DATA_PATH (botocore's loader reads those paths before its own data)."""
    for service in WAITER_SERVICES:
        own = json.loads((cli_data_dir() / service / "waiters-2.json").read_text())
        for waiter in own["waiters"].values():
            waiter["delay"] = max(1, round(float(waiter["delay"]) * clock))
        target = directory / service / "waiters-2.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(own, indent=1))
    return directory


def node_root(aws_plan: AwsPlan, member: Member) -> Path:
    return aws_plan.root / "nodes" / str(member.node)


def node_daemon(aws_plan: AwsPlan, member: Member):
    """The node's Docker engine (lifecycle.daemon: its sockets, data, mark and the lab's registry
    as mirror) started from the node's own disk, so a container's host paths are the node's."""
    return dataclasses.replace(
        lifecycle.daemon(aws_plan.plan, member),
        mount_pidfile=node_root(aws_plan, member) / "holder.pid",
    )


def lab_options(clock_scale: float) -> lifecycle.Options:
    """The lab's knobs the images carry (the stand-in model's load and token delays, its clock)."""
    return lifecycle.Options(clock_scale=clock_scale)


def engines(aws_plan: AwsPlan, machines: dict[str, Machine], options: lifecycle.Options) -> list[StepResult]:
    """Each node's disk (its mount namespace), then the lab's registry and each node's dockerd
    started from that disk (lifecycle.docker_engines). Idempotent; a failure is raised."""
    for machine in machines.values():
        machine.holder()
    steps = lifecycle.docker_engines(aws_plan.plan, options, lambda member: node_daemon(aws_plan, member))
    failed = [f"{step.node}: {step.detail[-600:]}" for step in steps if not step.ok]
    if failed:
        raise AwsLabError("a node's Docker engine did not start: " + "; ".join(failed))
    return steps


_PULL = re.compile(r"docker pull (?:--quiet )?('[^']+'|\S+)")


def pulled_images(stack: model.AwsStack) -> list[str]:
    """Every image the nodes pull: the associations' `Image` parameters and the `docker pull`s of
    the scripts they carry (base64, or gzip + base64, as the documents unpack them)."""
    images = set()
    for association in stack.associations.values():
        for key, value in association.parameters.items():
            if not isinstance(value, str) or not value:
                continue
            if key == "Image":
                images.add(value)
                continue
            text = _unpacked(value)
            for found in _PULL.findall(text or ""):
                if "$" not in found:
                    images.add(found.strip("'"))
    return sorted(images)


def _unpacked(value: str) -> str | None:
    try:
        raw = base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        return None
    with contextlib.suppress(OSError, EOFError):
        raw = gzip.decompress(raw)
    return raw.decode(errors="replace")


def machines_up(aws_plan: AwsPlan) -> None:
    plan = aws_plan.plan
    lifecycle.join_machine(aws_plan.root)
    netns.add(plan.switch)
    if netns.run(["ip", "-n", plan.switch, "link", "show", BRIDGE], check=False).returncode != 0:
        netns.run(["ip", "-n", plan.switch, "link", "add", BRIDGE, "mtu", str(VPC_MTU), "type", "bridge"])
    netns.run(["ip", "-n", plan.switch, "link", "set", BRIDGE, "up"])
    for member in aws_plan.all_members():
        _link(aws_plan, member)


def node_etc(aws_plan: AwsPlan, region: str, bucket: str | None) -> None:
    """Each node's /etc/hosts names the AWS endpoints at the API stand-in; IMDS on its lo. The
    `aws` namespace's too: the deployer's own AWS CLI (a `command:local:Command`) runs there."""
    hosts = Path("/etc/hosts").read_text()
    extra = "".join(f"{aws_plan.api.ip} {name}\n" for name in api_names(region, bucket))
    for member in (*aws_plan.plan.nodes, aws_plan.api):
        folder = netns.NETNS_ETC / member.namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts + "# lab: the AWS endpoints (labkit/aws/nodes.py)\n" + extra)
    for member in aws_plan.plan.nodes:
        netns.run(["ip", "-n", member.namespace, "addr", "replace", f"{IMDS_ADDRESS}/32", "dev", "lo"])


def context(aws_plan: AwsPlan, rendered: offline.Render) -> tuple[model.AwsStack, dict[str, Machine]]:
    identity = endpoint.ensure(aws_plan.root / "endpoint", aws_plan.plan.load_balancer.ip)
    region = offline.stack_region(aws_plan.plan.stack_config or {})
    stack = model.read(rendered, region, s3_uri(aws_plan.plan.cluster))
    pace_documents(stack, settings.clock)
    return stack, node_machines(aws_plan, stack, identity)


def shut_down(aws_plan: AwsPlan, member: Member) -> str:
    """An instance terminated: the machine shuts down (its Docker engine stops its containers,
    as systemd stops docker.service, each with its stop timeout), then nothing of it is left (its
    processes, its namespace)."""
    stopped = dockerd.stop(node_daemon(aws_plan, member))
    killed = netns.kill_marked(f"{aws_plan.plan.label}/{member.node}")
    netns.delete(member.namespace)
    return f"{stopped}; {killed} processes ended; namespace {member.namespace} deleted"
