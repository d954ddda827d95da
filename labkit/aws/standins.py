"""The AWS API stand-in (labkit/aws/service.py, in the `aws` namespace) and HAProxy as the NLB (in
the `lb` namespace) started for a lab: their config, certificate, principals and bucket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from labkit.aws import elb, model, settings
from labkit.aws.nodes import access_key
from labkit.aws.settings import (
    DEPLOYER_KEY,
    MOTO_PORT,
    PROJECT_ROOT,
    AwsLabError,
    AwsPlan,
    api_names,
    weights_bucket,
)
from labkit.cluster import endpoint, lifecycle, tlsca
from labkit.hosts import netns


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


def start_api(aws_plan: AwsPlan, stack: model.AwsStack, identity: endpoint.Identity, weights: Path | None):
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


def api_add_nodes(
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
        principals[access_key(member.node)] = {
            "arn": f"arn:aws:sts::{model.ACCOUNT}:assumed-role/{role}/{instance.instance_id}",
            "documents": documents,
            # Role credentials delivered to an instance carry its ARN (ec2:SourceInstanceARN).
            "context": {"ec2:SourceInstanceARN": model.instance_arn(stack.region, instance.instance_id)},
        }
        nodes.append(
            {
                "namespace": member.namespace,
                "node": member.node,
                "ip": member.ip,
                "instanceId": instance.instance_id,
                "role": role,
                "accessKey": access_key(member.node),
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
        "deregistrationDelay": (group.deregistration_delay if group else 0) * settings.clock,
        "callsLog": str(root / "aws-calls.jsonl"),
        "readyFile": str(root / "aws-ready"),
        "bucket": {"name": bucket[0], "objects": weight_objects(bucket[1], weights)}
        if bucket and weights
        else None,
    }
    (root / "aws-service.json").write_text(json.dumps(config, indent=1))


def iam_documents(stack: model.AwsStack, role: str) -> list[dict[str, Any]]:
    from labkit.aws import iam

    return iam.documents_of_role(
        role, stack.role_policies.get(role, []), stack.role_attachments.get(role, [])
    )


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


def start_haproxy(aws_plan: AwsPlan, stack: model.AwsStack) -> None:
    root = aws_plan.root
    group = stack.target_group
    if group is None:
        raise AwsLabError("the stack registers no target group")
    servers = {instance.instance_id: instance.ip for instance in stack.instances.values()}
    text = elb.haproxy_config(
        group, servers, listen=aws_plan.plan.load_balancer.ip, port=stack.listener_port,
        client_cidrs=stack.client_cidrs, idle_timeout=stack.idle_timeout_seconds, clock=settings.clock,
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
