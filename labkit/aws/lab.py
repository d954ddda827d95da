"""`lab.py up|upgrade|down` for an AWS stack: the GPU nodes as namespaces at the addresses the
program pins, first boot and every SSM association run on them in the engine's order, the AWS
APIs in the `aws` namespace (labkit/aws/service.py) and HAProxy as the NLB in the `lb`
namespace (labkit/aws/elb.py); clients in the `client` namespace reach the model only through
the load balancer, with the lab's key, over TLS when the stack has it.

What the engine would do with each registered resource, here:
- `aws:ec2/instance:Instance` (a GPU node): the instance boots: its launch template's user data
  runs once as root (machine.py, cloud-init semantics);
- `aws:lb/targetGroupAttachment:TargetGroupAttachment`: RegisterTargets, as the deployer;
- `aws:ssm/association:Association`: its document runs on its targets within its rate controls
  (ssmrun.py); the create waits for the run when `waitForSuccessTimeoutSeconds` is set (the
  provider's waitAssociationSuccess), else the run goes on without holding anything
  (terraform-provider-aws internal/service/ssm/association.go);
- everything else (VPC, subnets, SGs, IAM, documents, parameters, the NLB): the API stand-in
  holds what the nodes read (parameters, policies, the target group); nothing to run.
Resources start when everything they depend on (`Render.dependencies()`) has finished,
independent ones in parallel; the first failure starts nothing new.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import gzip
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.aws import elb, model, ssmrun
from labkit.aws.machine import Machine
from labkit.cluster import blueprint, endpoint, lifecycle, tlsca
from labkit.cluster.blueprint import BRIDGE, MEMBER_IF, STATE_ROOT, LabPlan, Member, namespace_prefix
from labkit.engine import executor, substitutions
from labkit.engine.executor import StepResult
from labkit.hosts import netns
from qwen_cluster.config import NAMESPACE, ClusterConfig
from qwen_cluster.ports import Vantage
from tooling import offline, stackfile

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


# --------------------------------------------------------------------------- the machines


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


def api_names(region: str, bucket: str | None) -> list[str]:
    """The endpoints the nodes' AWS CLI calls (regional; S3 virtual-hosted for the bucket)."""
    names = [f"ssm.{region}.amazonaws.com", f"elasticloadbalancing.{region}.amazonaws.com",
             f"s3.{region}.amazonaws.com", f"sts.{region}.amazonaws.com"]  # fmt: skip
    if bucket:
        names.append(f"{bucket}.s3.{region}.amazonaws.com")
    return names


def api_certificate(directory: Path, ca: Path, ca_key: Path, names: list[str], ip: str) -> tuple[Path, Path]:
    """A certificate for the AWS endpoint names, from the lab's CA (labkit/cluster/tlsca.py)."""
    key, request, cert, ext = (directory / n for n in ("api-key.pem", "api.csr", "api.pem", "api.ext"))
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(request), "-subj", f"/CN={names[0]}")  # fmt: skip
    alt = ",".join([*(f"DNS:{n}" for n in names), f"IP:{ip}"])  # the IP: the deployer's own calls
    ext.write_text(f"subjectAltName={alt}\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", str(tlsca.DAYS), "-extfile", str(ext))  # fmt: skip
    return cert, key


def _access_key(node: str) -> str:
    return "ASIA" + model._hex(f"node:{node}", 16).upper()


@dataclass
class AwsUp:
    steps: list[StepResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: dict[str, ssmrun.AssociationRun] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)


def _machines(aws_plan: AwsPlan, stack: model.AwsStack, identity: endpoint.Identity) -> dict[str, Machine]:
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
    data_path = waiters_on_the_clock(root / "aws-data", _clock)
    machines = {}
    for member in plan.nodes:
        instance = stack.instances[member.node]
        env = {
            "AWS_CA_BUNDLE": identity.ca_file,
            "AWS_DATA_PATH": str(data_path),
            "DOCKER_HOST": lifecycle.daemon(plan, member).host,
        }
        machines[member.node] = Machine(
            instance, member.namespace, _node_root(aws_plan, member), bin_dir, env,
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


def _node_root(aws_plan: AwsPlan, member: Member) -> Path:
    return aws_plan.root / "nodes" / str(member.node)


def node_daemon(aws_plan: AwsPlan, member: Member):
    """The node's Docker engine (lifecycle.daemon: its sockets, data, mark and the lab's registry
    as mirror) started from the node's own disk, so a container's host paths are the node's."""
    return dataclasses.replace(
        lifecycle.daemon(aws_plan.plan, member),
        mount_pidfile=_node_root(aws_plan, member) / "holder.pid",
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


def _start_service(
    aws_plan: AwsPlan, stack: model.AwsStack, identity: endpoint.Identity, weights: Path | None
):
    root = aws_plan.root
    _write_service_config(aws_plan, stack, identity, weights)
    (root / "aws-ready").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "labkit.aws.service", str(root / "aws-service.json")]
    netns.spawn(aws_plan.api.namespace, argv, root / "aws-service.log", env={"PYTHONPATH": str(PROJECT_ROOT)},
                mark=lifecycle.mark(aws_plan.plan, None, "aws-api"))  # fmt: skip
    _wait_ready(aws_plan, "did not start")


def _wait_ready(aws_plan: AwsPlan, what: str) -> None:
    root = aws_plan.root
    deadline = time.monotonic() + 60
    while not (root / "aws-ready").exists():
        if time.monotonic() > deadline:
            raise AwsLabError(f"the AWS API stand-in {what}: {(root / 'aws-service.log').read_text()[-800:]}")
        time.sleep(0.1)


def _service_add_nodes(
    aws_plan: AwsPlan, stack: model.AwsStack, identity: endpoint.Identity, weights: Path | None
) -> None:
    """Nodes added to the stack: the running API stand-in serves their IMDS and knows their
    role (labkit/aws/service.py reads its config again on SIGHUP)."""
    ready = aws_plan.root / "aws-ready"
    pid = int(ready.read_text())
    _write_service_config(aws_plan, stack, identity, weights)
    ready.unlink()
    os.kill(pid, signal.SIGHUP)
    _wait_ready(aws_plan, "did not take the new nodes")


def _write_service_config(
    aws_plan: AwsPlan, stack: model.AwsStack, identity: endpoint.Identity, weights: Path | None
) -> None:
    root = aws_plan.root
    tls_dir = Path(identity.ca_file).parent
    bucket = weights_bucket(stack.weights_uri)
    cert, key = api_certificate(
        root,
        Path(identity.ca_file),
        tls_dir / "ca-key.pem",
        api_names(stack.region, bucket and bucket[0]),
        aws_plan.api.ip,
    )
    principals = {
        DEPLOYER_KEY: {
            "arn": f"arn:aws:iam::{model.ACCOUNT}:user/lab-deployer",
            "documents": [{"Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}],
        },  # fmt: skip
    }
    nodes = []
    for member in aws_plan.plan.nodes:
        instance = stack.instances[member.node]
        role = stack.role_of_instance(instance)
        documents = iam_documents(stack, role)
        principals[_access_key(member.node)] = {
            "arn": f"arn:aws:sts::{model.ACCOUNT}:assumed-role/{role}/{instance.instance_id}",
            "documents": documents,
        }
        nodes.append(
            {
                "namespace": member.namespace,
                "node": member.node,
                "ip": member.ip,
                "instanceId": instance.instance_id,
                "role": role,
                "accessKey": _access_key(member.node),
                "zone": aws_plan.plan.cluster.aws.availability_zone,
                "userData": instance.user_data,
            }
        )
    group = stack.target_group
    config = {
        "region": stack.region,
        "motoPort": MOTO_PORT,
        "apiAddress": aws_plan.api.ip,
        "certificate": str(cert),
        "privateKey": str(key),
        "principals": principals,
        "nodes": nodes,
        "parameters": list(stack.parameters.values()),
        "targetGroup": group.__dict__ if group else None,
        "haproxySocket": str(root / "haproxy.sock"),
        "deregistrationDelay": (group.deregistration_delay if group else 0) * _clock,
        "callsLog": str(root / "aws-calls.jsonl"),
        "readyFile": str(root / "aws-ready"),
        "bucket": {"name": bucket[0], "objects": weight_objects(bucket[1], weights)}
        if bucket and weights
        else None,
    }
    (root / "aws-service.json").write_text(json.dumps(config, indent=1))


_clock = 1 / 30


def iam_documents(stack: model.AwsStack, role: str) -> list[dict[str, Any]]:
    from labkit.aws import iam

    return iam.documents_of_role(
        role, stack.role_policies.get(role, []), stack.role_attachments.get(role, [])
    )


def s3_uri(cluster: ClusterConfig) -> str:
    weights = cluster.model.weights
    return weights.uri or "" if weights.source == "s3" else ""


def weights_bucket(uri: str) -> tuple[str, str] | None:
    if not uri.startswith("s3://"):
        return None
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    return bucket, prefix.rstrip("/")


def weight_objects(prefix: str, folder: Path | None) -> dict[str, str]:
    """The lab bucket's objects: every file of `folder` under the prefix."""
    if folder is None:
        return {}
    return {
        f"{prefix}/{path.relative_to(folder)}": str(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def lab_weights(root: Path) -> Path:
    """Small files standing for the model in the lab bucket (the tiny real model later)."""
    folder = root / "lab-model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "lab": True}))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def _start_haproxy(aws_plan: AwsPlan, stack: model.AwsStack) -> None:
    root = aws_plan.root
    group = stack.target_group
    if group is None:
        raise AwsLabError("the stack registers no target group")
    servers = {instance.instance_id: instance.ip for instance in stack.instances.values()}
    text = elb.haproxy_config(
        group, servers, listen=aws_plan.plan.load_balancer.ip, port=stack.listener_port,
        client_cidrs=stack.client_cidrs, idle_timeout=stack.idle_timeout_seconds, clock=_clock,
        socket_path=str(root / "haproxy.sock"), pid_file=str(root / "haproxy.pid"),
    )  # fmt: skip
    conf = root / "haproxy.cfg"
    conf.write_text(text)
    check = subprocess.run(["haproxy", "-c", "-f", str(conf)], capture_output=True, text=True)
    if check.returncode != 0:
        raise AwsLabError(f"haproxy -c: {check.stderr or check.stdout}")
    netns.spawn(
        aws_plan.plan.load_balancer.namespace, ["haproxy", "-db", "-f", str(conf)], root / "haproxy.log",
        mark=lifecycle.mark(aws_plan.plan, None, "haproxy"),
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not (root / "haproxy.sock").exists():
        if time.monotonic() > deadline:
            raise AwsLabError(f"haproxy did not start: {(root / 'haproxy.log').read_text()[-500:]}")
        time.sleep(0.05)


def machines_up(aws_plan: AwsPlan) -> None:
    plan = aws_plan.plan
    lifecycle.join_machine(aws_plan.root)
    netns.add(plan.switch)
    if netns.run(["ip", "-n", plan.switch, "link", "show", BRIDGE], check=False).returncode != 0:
        netns.run(["ip", "-n", plan.switch, "link", "add", BRIDGE, "mtu", str(VPC_MTU), "type", "bridge"])
    netns.run(["ip", "-n", plan.switch, "link", "set", BRIDGE, "up"])
    for member in aws_plan.all_members():
        _link(aws_plan, member)


def _node_etc(aws_plan: AwsPlan, region: str, bucket: str | None) -> None:
    """Each node's /etc/hosts names the AWS endpoints at the API stand-in; IMDS on its lo."""
    hosts = Path("/etc/hosts").read_text()
    extra = "".join(f"{aws_plan.api.ip} {name}\n" for name in api_names(region, bucket))
    for member in aws_plan.plan.nodes:
        folder = netns.NETNS_ETC / member.namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts + "# lab: the AWS endpoints (labkit/aws/lab.py)\n" + extra)
        netns.run(["ip", "-n", member.namespace, "addr", "replace", f"{IMDS_ADDRESS}/32", "dev", "lo"])


# --------------------------------------------------------------------------- the engine's order


def _deployer_call(aws_plan: AwsPlan, action: str, target_group: str, target: str, port: int) -> str:
    """An ELBv2 call as `pulumi up` makes it (the deployer's credentials), from the admin side."""
    import boto3

    def call() -> str:
        session = boto3.session.Session(aws_access_key_id=DEPLOYER_KEY, aws_secret_access_key="lab",
                                        region_name=aws_plan.plan.cluster.aws.region)  # fmt: skip
        client = session.client(
            "elbv2",
            endpoint_url=f"https://{aws_plan.api.ip}",
            verify=str(aws_plan.root / "endpoint" / "tls" / "ca.pem"),
        )
        getattr(client, action)(TargetGroupArn=target_group, Targets=[{"Id": target, "Port": port}])
        return f"{action} {target}"

    return netns.call_in(aws_plan.api.namespace, call)


def apply(aws_plan: AwsPlan, rendered: offline.Render, stack: model.AwsStack, machines: dict[str, Machine],
          only: set[str] | None = None) -> AwsUp:  # fmt: skip
    """Run the render's resources in the engine's order; `only`: the resources that changed."""
    report = AwsUp()
    graph = rendered.dependencies()
    names = [r.name for r in rendered.custom_resources if only is None or r.name in only]
    by_name = {r.name: r for r in rendered.custom_resources}
    instance_of = {instance.resource: instance for instance in stack.instances.values()}
    pending = {name: {d for d in graph.get(name, set()) if d in names} for name in names}
    done: set[str] = set()
    failed = False
    t0 = time.monotonic()

    def step(name: str) -> StepResult:
        resource = by_name[name]
        started = time.monotonic() - t0
        if name in instance_of:
            instance = instance_of[name]
            status, code, output = machines[instance.node].first_boot()
            ok = status == ssmrun.SUCCESS
            detail = f"user data: {status} (exit {code})\n{output[-400:]}"
            result = StepResult(instance.node, "boot", ok, detail, resource=name, op="create")
        elif name in stack.associations:
            association = stack.associations[name]
            run = ssmrun.run(association, stack.documents[association.document], stack.instances,
                             lambda inst, planned: machines[inst.node].run_steps(inst, planned))  # fmt: skip
            report.runs[name] = run
            waited = association.wait_seconds is not None
            nodes = ",".join(i.instance for i in run.invocations) or "-"
            tail = "\n".join(
                f"{i.instance}: {i.status} exit {i.exit_code}\n{i.output[-600:]}" for i in run.invocations
            )
            detail = f"{run.status} {run.detail}\n{tail}"
            # Not waited for: the create returns before the run; a failed run does not stop `up`.
            result = StepResult(nodes, "association", run.status == ssmrun.SUCCESS or not waited, detail,
                                resource=name, op="create")  # fmt: skip
        elif resource.type == model.TG_ATTACHMENT:
            target, port = stack.registrations[name]
            detail = _deployer_call(aws_plan, "register_targets", stack.target_group.arn, target, port)
            result = StepResult("-", "register", True, detail, resource=name, op="create")
        else:
            result = StepResult("-", "api", True, "held by the API stand-in", resource=name, op="same")
        result.started, result.seconds = round(started, 3), round(time.monotonic() - t0 - started, 3)
        return result

    with ThreadPoolExecutor(max_workers=8) as pool:
        running: dict[Future, str] = {}
        while pending or running:
            if not failed:
                for name in [n for n, deps in pending.items() if deps <= done]:
                    del pending[name]
                    running[pool.submit(step, name)] = name
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                try:
                    result = future.result()
                except Exception as error:  # the lab's own failure, named
                    result = StepResult(
                        "-", "lab", False, f"{type(error).__name__}: {error}", resource=name, op="create"
                    )
                report.steps.append(result)
                done.add(name)
                if not result.ok:
                    failed = True
    return report


def up(
    aws_plan: AwsPlan, *, clock_scale: float = lifecycle.DEFAULT_CLOCK_SCALE
) -> tuple[AwsUp, offline.Render]:
    """Day 0: machines (each with its disk and Docker engine), the images in the lab's registry,
    the API and load balancer stand-ins, then every resource in order."""
    global _clock
    _clock = clock_scale
    plan = aws_plan.plan
    raw, made = lab_config(plan.stack_config or {})
    machines_up(aws_plan)
    identity = endpoint.ensure(aws_plan.root / "endpoint", plan.load_balancer.ip)
    rendered, more = executor.render(raw, aws_plan.stack, clock_scale, None, identity)
    region = offline.stack_region(raw)
    stack = model.read(rendered, region, s3_uri(plan.cluster))
    made += pace_documents(stack, clock_scale)
    bucket = weights_bucket(stack.weights_uri)
    _node_etc(aws_plan, region, bucket[0] if bucket else None)
    machines = _machines(aws_plan, stack, identity)
    options = lab_options(clock_scale)
    fixtures = engines(aws_plan, machines, options)
    published = lifecycle.publish_images(plan, options, rendered, pulled_images(stack))
    fixtures.append(StepResult("-", "images", True, "; ".join(published), op="fixture"))
    _start_haproxy(aws_plan, stack)
    _start_service(aws_plan, stack, identity, lab_weights(aws_plan.root) if bucket else None)
    report = apply(aws_plan, rendered, stack, machines)
    report.steps[:0] = fixtures
    report.notes = made + more + [f"docker: {what} ({why})" for what, why in substitutions.DOCKER.items()]
    record_runs(aws_plan, report, stack)
    _save_settings(aws_plan, clock_scale)
    executor.save_state(lifecycle.state_file(plan), plan.stack_config or {}, rendered, {})
    return report, rendered


def down(label: str) -> list[str]:
    """Everything of the lab `label`: namespaces (and their processes), /etc/netns, state."""
    removed = lifecycle.down(label)
    shutil.rmtree(Path(STATE_ROOT) / label, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------- day 2


SETTINGS_FILE = "aws-lab.json"


def _save_settings(aws_plan: AwsPlan, clock_scale: float) -> None:
    (aws_plan.root / SETTINGS_FILE).write_text(json.dumps({"clock": clock_scale, "stack": aws_plan.stack}))


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


def _context(aws_plan: AwsPlan, rendered: offline.Render) -> tuple[model.AwsStack, dict[str, Machine]]:
    identity = endpoint.ensure(aws_plan.root / "endpoint", aws_plan.plan.load_balancer.ip)
    region = offline.stack_region(aws_plan.plan.stack_config or {})
    stack = model.read(rendered, region, s3_uri(aws_plan.plan.cluster))
    pace_documents(stack, _clock)
    return stack, _machines(aws_plan, stack, identity)


def record_runs(aws_plan: AwsPlan, report: AwsUp, stack: model.AwsStack) -> dict[str, dict[str, str]]:
    """Document -> node -> the status of its last run there, kept across `up` and `upgrade`."""
    path = aws_plan.root / "ssm-runs.json"
    table: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    for name, run in report.runs.items():
        document = _document_role(stack, stack.associations[name].document)
        for invocation in run.invocations:
            table.setdefault(document, {})[invocation.instance] = invocation.status
    path.write_text(json.dumps(table, indent=1, sort_keys=True))
    return table


def _not_succeeded(report: AwsUp, stack: model.AwsStack) -> list[dict[str, str]]:
    return [
        {
            "document": _document_role(stack, stack.associations[name].document),
            "node": invocation.instance,
            "status": invocation.status,
            "output": invocation.output[-1500:],
        }
        for name, run in report.runs.items()
        for invocation in run.invocations
        if invocation.status != ssmrun.SUCCESS
    ]


def _document_role(stack: model.AwsStack, name: str) -> str:
    """A document by what it does (its step's name): modelStage, modelServer, nodeProxy, monitoring."""
    steps = stack.documents.get(name, {}).get("mainSteps") or [{}]
    return str(steps[0].get("name") or name)


class TargetWatch:
    """The replica heads out of the load balancer (HAProxy not sending them connections), sampled
    every `interval` seconds: the most out at one moment."""

    def __init__(self, socket_path: str, heads: dict[str, str], interval: float = 0.1):
        self.socket_path, self.heads, self.interval = socket_path, heads, interval  # id -> node
        self.max_out, self.out_at_max, self.samples = 0, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                status = elb.haproxy_status(self.socket_path)
                out = [
                    node for target, node in self.heads.items() if not status.get(target, "").startswith("UP")
                ]
                self.samples += 1
                if len(out) > self.max_out:
                    self.max_out, self.out_at_max = len(out), out
            self.stop.wait(self.interval)

    def __enter__(self) -> TargetWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _parameter_updates(aws_plan: AwsPlan, stack: model.AwsStack, names: set[str]) -> list[str]:
    """PutParameter (Overwrite) for the changed parameters, as the provider updates `value`."""
    import boto3

    def call() -> list[str]:
        session = boto3.session.Session(aws_access_key_id=DEPLOYER_KEY, aws_secret_access_key="lab",
                                        region_name=stack.region)  # fmt: skip
        client = session.client("ssm", endpoint_url=f"https://{aws_plan.api.ip}",
                                verify=str(aws_plan.root / "endpoint" / "tls" / "ca.pem"))  # fmt: skip
        done = []
        for name in sorted(names):
            parameter = stack.parameters[name]
            client.put_parameter(Name=parameter["name"], Value=parameter["value"] or "-",
                                 Type=parameter["type"], Overwrite=True)  # fmt: skip
            done.append(parameter["name"])
        return done

    return netns.call_in(aws_plan.api.namespace, call)


def upgrade(label: str, changes: list[str], *, max_requests: int = 300) -> dict[str, Any]:
    """Apply `changes` to the running AWS lab under client load; the figures of labkit/cluster/upgrade.py
    plus the SSM runs (every document on every node)."""
    from labkit.cluster import upgrade as bare_upgrade
    from tooling import changes as change_syntax

    global _clock
    state = executor.load_state(lifecycle.state_file_for(label))
    if state is None:
        raise AwsLabError(f"lab {label} is not up (no applied state): run `lab.py up` first")
    settings = json.loads((Path(STATE_ROOT) / label / SETTINGS_FILE).read_text())
    _clock = settings["clock"]
    new_config = change_syntax.apply_changes(state.config, changes)
    cluster = stackfile.validate(new_config)
    aws_plan = build(cluster, label, new_config, settings["stack"])
    identity = endpoint.ensure(aws_plan.root / "endpoint", aws_plan.plan.load_balancer.ip)
    raw, _ = lab_config(new_config)
    rendered, _ = executor.render(raw, aws_plan.stack, _clock, None, identity)
    stack, machines = _context(aws_plan, rendered)
    diff = executor.changes_between(state.render, rendered)
    acting = {name for name, change in diff.items() if change.action in ("create", "replace", "update")}
    parameters = {name for name in acting if name in stack.parameters}
    # A new value raises the parameter's version, which the associations reading it carry
    # (components/aws/proxy.py: SecretsVersion; replaced on change): the mocks compute no
    # version, so the lab follows the ARN to them.
    changed_arns = {stack.parameters[name]["arn"] for name in parameters}
    acting |= {
        name
        for name, association in stack.associations.items()
        if changed_arns & set(association.parameters.values())
    }
    before = {m.node for m in build(stackfile.validate(state.config), label, state.config).plan.nodes}
    added = [m for m in aws_plan.plan.nodes if m.node not in before]
    prepared = _prepare(aws_plan, rendered, stack, machines, identity, added)
    # The replicas of the stack before the change: a node being added is not "out"; one still
    # loading after `up` is (clients have it no more than a drained one).
    heads = {stack.instances[m.node].instance_id: m.node for m in aws_plan.plan.heads if m.node in before}
    key = _client_key(identity, state.config, new_config)
    load = bare_upgrade.LoadSettings(
        max_requests=max_requests, access=lifecycle.client_access(aws_plan.plan, key)
    )
    started = time.monotonic()
    with (
        TargetWatch(str(aws_plan.root / "haproxy.sock"), heads) as watch,
        bare_upgrade.ClientLoad(aws_plan.plan, load) as clients,
    ):
        time.sleep(0.3)  # the load is flowing before anything changes
        if parameters:
            _parameter_updates(aws_plan, stack, parameters)
        report = apply(aws_plan, rendered, stack, machines, only=acting - parameters)
        time.sleep(0.3)
    seconds = time.monotonic() - started
    runs = record_runs(aws_plan, report, stack)
    executor.save_state(lifecycle.state_file(aws_plan.plan), new_config, rendered, {})
    outcomes = clients.outcomes
    ran = [step for step in report.steps if step.op != "same"]
    nodes = [m.node for m in aws_plan.plan.nodes]
    return {
        "requests": len(outcomes),
        "failed": sum(1 for o in outcomes if not o.ok and not o.cut),
        "streamsCut": sum(1 for o in outcomes if o.cut),
        "maxReplicasDown": watch.max_out,
        "seconds": round(seconds, 2),
        "steps": [
            {
                "resource": s.resource,
                "op": s.op,
                "node": s.node,
                "ok": s.ok,
                "at": s.started,
                "seconds": s.seconds,
                **({} if s.ok else {"detail": s.detail[-500:]}),
            }  # fmt: skip
            for s in ran
        ],
        "ok": report.ok,
        "lanes": [[replica.head.name for replica in lane] for lane in cluster.rollout_lanes],
        "ssm": {
            "documents": runs,
            "everyDocumentOnEveryNode": all(
                all(table.get(node) == ssmrun.SUCCESS for node in nodes)
                for document, table in runs.items()
                if document != "nodeProxy"
            )
            and all(runs.get("nodeProxy", {}).get(m.node) == ssmrun.SUCCESS for m in aws_plan.plan.heads),
            # This change's runs that did not succeed, with the end of their output (what
            # `get-command-invocation` shows): why a document is not Success above.
            "notSucceeded": _not_succeeded(report, stack),
        },
        "parametersUpdated": sorted(stack.parameters[name]["name"] for name in parameters),
        "nodesAdded": [m.node for m in added],
        "clientKey": key,  # the lab key the client load used: one the stack accepts after the change
        "prepared": prepared,
        # Where a failed rollout stopped, and the replicas whose model-server run never started
        # (they serve what they served before).
        "stoppedAt": [f"{s.resource}: {_last_line(s.detail)}" for s in ran if not s.ok],
        "replicasNotReached": [
            m.node
            for m in aws_plan.plan.heads
            if f"gpu-nodes-{m.node}-server" in acting
            and f"gpu-nodes-{m.node}-server" not in {s.resource for s in ran}
        ],
        "failures": [
            f"{'stream' if o.streamed else 'chat'} at {o.started:.2f} s: {o.error or o.status}"
            for o in outcomes
            if not o.ok
        ][:20],  # fmt: skip
    }


def _client_key(identity: endpoint.Identity, before: dict[str, Any], after: dict[str, Any]) -> int:
    """The lab key the clients use during a change: one the stack accepts before and after it
    (a rotation that keeps none: the new one)."""

    def accepted(config: dict[str, Any]) -> list[str]:
        copy = json.loads(json.dumps(config))
        substitutions.endpoint_secrets(copy, identity)
        keys = (copy.get(f"{NAMESPACE}:access") or {}).get("apiKeys") or []
        return [key.get("secure") if isinstance(key, dict) else key for key in keys]

    old, new = accepted(before), accepted(after)
    indexes = range(len(identity.api_keys))
    both = [i for i in indexes if identity.api_keys[i] in old and identity.api_keys[i] in new]
    return (both or [i for i in indexes if identity.api_keys[i] in new] or [0])[0]


def _prepare(
    aws_plan: AwsPlan,
    rendered: offline.Render,
    stack: model.AwsStack,
    machines: dict[str, Machine],
    identity: endpoint.Identity,
    added: list[Member],
) -> dict[str, Any]:
    """Before the change is applied: every image it pulls in the lab's registry (a new tag), and
    for nodes added to the stack the machines EC2 would launch: namespace, disk, Docker engine,
    IMDS and role in the API stand-in, a server in HAProxy (in maintenance until registered).
    What they run then (first boot, associations, registration) is the apply's."""
    started = time.monotonic()
    options = lab_options(_clock)
    if added:
        machines_up(aws_plan)  # new links; every member's routes to the new addresses
        bucket = weights_bucket(stack.weights_uri)
        _node_etc(aws_plan, stack.region, bucket[0] if bucket else None)
    engines(aws_plan, machines, options)
    published = lifecycle.publish_images(aws_plan.plan, options, rendered, pulled_images(stack))
    if added:
        bucket = weights_bucket(stack.weights_uri)
        _service_add_nodes(aws_plan, stack, identity, lab_weights(aws_plan.root) if bucket else None)
        for member in added:
            instance = stack.instances[member.node]
            elb.add_server(str(aws_plan.root / "haproxy.sock"), stack.target_group, instance.instance_id,
                           member.ip, _clock)  # fmt: skip
    return {"seconds": round(time.monotonic() - started, 2), "images": published}


def _last_line(detail: str) -> str:
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
