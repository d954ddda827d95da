"""The AWS APIs the GPU nodes call, in one process of the lab's `aws` namespace:

- the API endpoints (HTTPS on 443, names resolved by each node's /etc/hosts, a certificate of
  the lab's CA): every call is checked against the caller's IAM policies (tooling/iampolicy.py)
  and refused as AWS refuses it (AccessDenied) when they do not allow it; then
  S3 and SSM Parameter Store are answered by moto's server (pinned in requirements.txt), and
  ELBv2 by the target group stand-in in front of HAProxy (labkit/aws/elb.py);
- IMDSv2 (169.254.169.254:80 in every node's namespace): a token by PUT, then the instance id,
  the region and the instance profile role's temporary credentials, only with the token
  (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-v2-how-it-works.html).

Signatures are not verified (moto does not either): the access key names the caller, which is
what IAM decides on, with the request context its credentials carry: a node's role credentials
name the instance they were delivered to (`ec2:SourceInstanceARN`, which the monitoring
credentials' read policy conditions on, components/aws/monitoring.py).
Run as `python -m labkit.aws.service CONFIG.json` (labkit/aws/standins.py). On
SIGHUP it reads CONFIG.json again for nodes added since (a node added to the stack: its IMDS and
its role's credentials), then writes its ready file again.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import ssl
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from labkit.aws import elb
from labkit.aws.model import ACCOUNT, TargetGroup
from tooling import iampolicy

ELB_NS = "http://elasticloadbalancing.amazonaws.com/doc/2015-12-01/"
IMDS_ADDRESS = "169.254.169.254"


def principals_of(config: dict[str, Any]) -> dict[str, iampolicy.Principal]:
    """Access key -> (principal name, its policy documents)."""
    principals = config["principals"].items()
    return {key: iampolicy.Principal(entry["arn"], entry["documents"]) for key, entry in principals}


def contexts_of(config: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Access key -> the condition keys its credentials carry into every request."""
    return {key: dict(entry.get("context") or {}) for key, entry in config["principals"].items()}


class Gateway:
    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.region = config["region"]
        self.moto = config["moto"]  # http://127.0.0.1:PORT
        # access key -> (principal name, its policy documents)
        self.principals = principals_of(config)
        self.contexts = contexts_of(config)
        self.calls: list[dict[str, Any]] = []
        self.calls_lock = threading.Lock()
        group = config.get("targetGroup")
        self.group = (
            elb.TargetGroupStandIn(
                TargetGroup(**group), config["haproxySocket"], float(config["deregistrationDelay"])
            )
            if group
            else None
        )

    def add_nodes(self, config: dict[str, Any]) -> None:
        """The principals of nodes added since (every access key of `config`)."""
        self.principals.update(principals_of(config))
        self.contexts.update(contexts_of(config))

    def record(self, **entry: Any) -> None:
        with self.calls_lock:
            self.calls.append({"time": time.time(), **entry})
            with Path(self.config["callsLog"]).open("a") as log:
                log.write(json.dumps({"time": time.time(), **entry}) + "\n")


# --------------------------------------------------------------------------- the API endpoints


def _access_key(headers) -> str:
    auth = headers.get("Authorization", "")
    marker = "Credential="
    if marker in auth:
        return auth.split(marker, 1)[1].split("/", 1)[0]
    return ""


def s3_request(host: str, method: str, path: str, query: dict[str, list[str]]) -> iampolicy.Request:
    bucket, key = "", ""
    first = host.split(".s3.", 1)
    if len(first) == 2 and first[0]:
        bucket, key = first[0], path.lstrip("/")
    else:
        parts = path.lstrip("/").split("/", 1)
        bucket, key = parts[0], parts[1] if len(parts) > 1 else ""
    key = urllib.parse.unquote(key)
    if not key:
        bucket_arn = (f"arn:aws:s3:::{bucket}",)
        if method == "HEAD":
            # S3 API Reference, HeadBucket: "you must have permissions to perform the s3:ListBucket
            # action"; the request lists nothing, so it carries no s3:prefix.
            return iampolicy.Request("s3:ListBucket", bucket_arn)
        if method == "GET" and "location" in query:
            # S3 API Reference, GetBucketLocation (`GET /?location`): its own action.
            return iampolicy.Request("s3:GetBucketLocation", bucket_arn)
        if method == "GET" and ("list-type" in query or not query or "prefix" in query):
            context = {"s3:prefix": query.get("prefix", [""])[0]}
            return iampolicy.Request("s3:ListBucket", bucket_arn, context)
        return iampolicy.Request(f"s3:{method.title()}Bucket", bucket_arn)
    action = {
        "GET": "s3:GetObject",
        "HEAD": "s3:GetObject",
        "PUT": "s3:PutObject",
        "DELETE": "s3:DeleteObject",
    }
    return iampolicy.Request(action.get(method, f"s3:{method}"), (f"arn:aws:s3:::{bucket}/{key}",))


def _ssm_parameter_arn(region: str, name: str) -> str:
    if name.startswith("arn:"):
        return name
    return f"arn:aws:ssm:{region}:{ACCOUNT}:parameter{name if name.startswith('/') else '/' + name}"


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gateway: Gateway

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        gateway = self.gateway
        host = (self.headers.get("Host") or "").split(":")[0]
        parsed = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        body = self._body()
        # The service signs its name into the credential scope (AKID/date/region/service/...).
        scope = (self.headers.get("Authorization") or "").split("Credential=", 1)[-1].split(",")[0].split("/")
        service = scope[3] if len(scope) > 3 else host.split(".")[0]
        key = _access_key(self.headers)
        principal = gateway.principals.get(key)
        form: dict[str, list[str]] = {}
        if service == "elasticloadbalancing":
            form = urllib.parse.parse_qs(body.decode(), keep_blank_values=True)
            action = form.get("Action", [""])[0]
            arn = form.get("TargetGroupArn", ["*"])[0]
            request = iampolicy.Request(f"elasticloadbalancing:{action}", (arn,))
        elif service == "ssm":
            action = (self.headers.get("X-Amz-Target") or ".").split(".", 1)[1]
            payload = json.loads(body or b"{}")
            names = payload.get("Names") or [payload.get("Name", "*")]
            request = iampolicy.Request(
                f"ssm:{action}", tuple(_ssm_parameter_arn(gateway.region, n) for n in names)
            )
        elif service == "s3":
            request = s3_request(host, self.command, parsed.path, query)
        else:
            self._send(400, b"lab: no such service here", "text/plain")
            return
        if principal is None:
            gateway.record(
                caller=key, action=request.action, resources=list(request.resources), allowed=False
            )
            self._deny(
                service, "InvalidClientTokenId", "The security token included in the request is invalid."
            )
            return
        context = gateway.contexts.get(key) or {}
        if context:
            request = iampolicy.Request(request.action, request.resources, {**context, **request.context})
        decision = principal.evaluate(request)
        gateway.record(caller=principal.name, action=request.action, resources=list(request.resources),
                       allowed=decision.allowed, context=request.context)  # fmt: skip
        if not decision.allowed:
            self._deny(service, "AccessDenied", decision.reason)
            return
        if service == "elasticloadbalancing":
            self._elb(form)
            return
        if service == "ssm" and action in ("GetParameter",):
            payload = json.loads(body or b"{}")
            name = payload.get("Name", "")
            if name.startswith("arn:"):  # AWS takes the ARN; moto's backend looks names up
                payload["Name"] = name.split(":parameter", 1)[1]
                body = json.dumps(payload).encode()
        self._forward(body)

    def _deny(self, service: str, code: str, message: str) -> None:
        if service == "ssm":
            kind = "AccessDeniedException" if code == "AccessDenied" else "UnrecognizedClientException"
            self._send(
                400, json.dumps({"__type": kind, "message": message}).encode(), "application/x-amz-json-1.1"
            )
        elif service == "s3":
            text = f"<Error><Code>{code}</Code><Message>Access Denied</Message><RequestId>lab</RequestId>"
            text += "</Error>"
            self._send(403, text.encode(), "application/xml")
        else:
            text = (
                f'<ErrorResponse xmlns="{ELB_NS}"><Error><Type>Sender</Type><Code>{code}</Code>'
                f"<Message>{escape(message)}</Message></Error><RequestId>lab</RequestId></ErrorResponse>"
            )
            self._send(403, text.encode(), "text/xml")

    def _forward(self, body: bytes) -> None:
        url = self.gateway.moto + self.path
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("content-length", "connection")}
        request = urllib.request.Request(url, data=body if body or self.command in ("PUT", "POST") else None,
                                         headers=headers, method=self.command)  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                status, data, answer_headers = answer.status, answer.read(), answer.headers
        except urllib.error.HTTPError as error:
            status, data, answer_headers = error.code, error.read(), error.headers
        kept = ("etag", "last-modified", "x-amz-request-id", "accept-ranges", "content-range")
        extra = {k: v for k, v in answer_headers.items() if k.lower() in kept}
        self._send(status, data, answer_headers.get("Content-Type", "application/xml"), extra)

    def _elb(self, form: dict[str, list[str]]) -> None:
        group = self.gateway.group
        action = form.get("Action", [""])[0]
        arn = form.get("TargetGroupArn", [""])[0]
        if group is None or arn != group.group.arn:
            text = (
                f'<ErrorResponse xmlns="{ELB_NS}"><Error><Type>Sender</Type><Code>TargetGroupNotFound</Code>'
                f"<Message>Target groups '{escape(arn)}' not found</Message></Error></ErrorResponse>"
            )
            self._send(400, text.encode(), "text/xml")
            return
        ids = [
            value[0]
            for name, value in sorted(form.items())
            if name.startswith("Targets.member.") and name.endswith(".Id")
        ]
        if action == "RegisterTargets":
            for target in ids:
                group.register(target)
            self._elb_answer(action, "")
        elif action == "DeregisterTargets":
            for target in ids:
                group.deregister(target)
            self._elb_answer(action, "")
        elif action == "DescribeTargetHealth":
            group.tick()
            members = []
            for target, state in group.describe(ids or None):
                reason = elb.REASONS.get(state)
                detail = (
                    f"<Reason>{reason[0]}</Reason><Description>{reason[1]}</Description>" if reason else ""
                )
                members.append(
                    f"<member><Target><Id>{target}</Id><Port>{group.group.port}</Port></Target>"
                    f"<HealthCheckPort>{group.group.port}</HealthCheckPort>"
                    f"<TargetHealth><State>{state}</State>{detail}</TargetHealth></member>"
                )
            self._elb_answer(
                action, f"<TargetHealthDescriptions>{''.join(members)}</TargetHealthDescriptions>"
            )
        else:
            self._deny("elasticloadbalancing", "UnsupportedOperation", f"lab: {action} is not modelled")

    def _elb_answer(self, action: str, result: str) -> None:
        text = (
            f'<{action}Response xmlns="{ELB_NS}"><{action}Result>{result}</{action}Result>'
            f"<ResponseMetadata><RequestId>{uuid.uuid4()}</RequestId></ResponseMetadata></{action}Response>"
        )
        self._send(200, text.encode(), "text/xml")

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's names
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def do_PUT(self) -> None:  # noqa: N802
        self._handle()

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle()

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle()


# --------------------------------------------------------------------------- IMDSv2


class Imds:
    """One node's instance metadata: IMDSv2 only (httpTokens required, as the template sets)."""

    def __init__(self, node: dict[str, Any], region: str):
        self.node, self.region = node, region
        self.tokens: dict[str, float] = {}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        imds = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def _send(self, status: int, text: str, extra: dict[str, str] | None = None) -> None:
                body = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if (
                    self.path != "/latest/api/token"
                    or not ttl
                    or not ttl.isdigit()
                    or not 1 <= int(ttl) <= 21600
                ):
                    self._send(400, "Bad Request")
                    return
                token = secrets.token_urlsafe(32)
                imds.tokens[token] = time.time() + int(ttl)
                self._send(200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

            def do_GET(self) -> None:  # noqa: N802
                token = self.headers.get("X-aws-ec2-metadata-token", "")
                if imds.tokens.get(token, 0) < time.time():
                    self._send(401, "Unauthorized")  # IMDSv2 required: no token, no answer
                    return
                answer = imds.answer(self.path)
                self._send(200 if answer is not None else 404, answer if answer is not None else "Not Found")

        return Handler

    def answer(self, path: str) -> str | None:
        node = self.node
        role = node["role"]
        expires = (datetime.now(UTC) + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
        table = {
            "/latest/meta-data/instance-id": node["instanceId"],
            "/latest/meta-data/local-ipv4": node["ip"],
            "/latest/meta-data/placement/region": self.region,
            "/latest/meta-data/placement/availability-zone": node["zone"],
            "/latest/meta-data/iam/security-credentials/": role,
            "/latest/meta-data/iam/security-credentials": role,
            f"/latest/meta-data/iam/security-credentials/{role}": json.dumps(
                {
                    "Code": "Success",
                    "LastUpdated": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "Type": "AWS-HMAC",
                    "AccessKeyId": node["accessKey"],
                    "SecretAccessKey": "lab-secret-" + node["accessKey"],
                    "Token": "lab-session-token",
                    "Expiration": expires,
                }
            ),
            "/latest/dynamic/instance-identity/document": json.dumps(
                {
                    "instanceId": node["instanceId"],
                    "region": self.region,
                    "accountId": ACCOUNT,
                    "availabilityZone": node["zone"],
                    "privateIp": node["ip"],
                }  # fmt: skip
            ),
            "/latest/user-data": node.get("userData", ""),
        }
        return table.get(path)


# --------------------------------------------------------------------------- the process


def _serve_in(namespace: str | None, address: str, port: int, handler, context: ssl.SSLContext | None = None):
    """A server whose listening socket lives in `namespace` (created by a thread that joined it)."""
    from labkit.hosts import netns

    def make() -> ThreadingHTTPServer:
        server = ThreadingHTTPServer((address, port), handler)
        if context is not None:
            server.socket = context.wrap_socket(server.socket, server_side=True)
        return server

    server = netns.call_in(namespace, make) if namespace else make()
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=int(config["motoPort"]), verbose=False)
    moto.start()
    config["moto"] = f"http://127.0.0.1:{config['motoPort']}"
    gateway = Gateway(config)
    ApiHandler.gateway = gateway
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config["certificate"], config["privateKey"])
    _serve_in(None, config["apiAddress"], 443, ApiHandler, context)
    served: set[str] = set()

    def serve_nodes(config: dict[str, Any]) -> None:
        for node in config["nodes"]:
            if node["namespace"] not in served:
                _serve_in(node["namespace"], IMDS_ADDRESS, 80, Imds(node, config["region"]).handler())
                served.add(node["namespace"])

    serve_nodes(config)
    _seed(config)
    reload = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    Path(config["readyFile"]).write_text(str(os.getpid()))
    while True:
        if reload.wait(0.5):
            reload.clear()
            again = json.loads(Path(argv[0]).read_text())
            gateway.add_nodes(again)
            serve_nodes(again)
            Path(config["readyFile"]).write_text(str(os.getpid()))
        if gateway.group is not None:
            with contextlib.suppress(OSError):
                gateway.group.tick()  # the deregistration delay runs out without a caller


def _seed(config: dict[str, Any]) -> None:
    """What the program's resources hold before any node asks: the SSM parameters (the engine
    creates them) and the weights in the lab bucket (the operator's copy)."""
    import boto3

    session = boto3.session.Session(
        aws_access_key_id="lab", aws_secret_access_key="lab", region_name=config["region"]
    )
    ssm = session.client("ssm", endpoint_url=config["moto"])
    for parameter in config.get("parameters", []):
        ssm.put_parameter(
            Name=parameter["name"], Value=parameter["value"] or "-", Type=parameter["type"], Overwrite=True
        )
    bucket = config.get("bucket")
    if bucket:
        s3 = session.client("s3", endpoint_url=config["moto"])
        location = (
            {}
            if config["region"] == "us-east-1"
            else {"CreateBucketConfiguration": {"LocationConstraint": config["region"]}}
        )
        s3.create_bucket(Bucket=bucket["name"], **location)
        for key, path in bucket["objects"].items():
            s3.put_object(Bucket=bucket["name"], Key=key, Body=Path(path).read_bytes())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
