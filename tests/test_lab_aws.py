"""The AWS target rehearsed on the node side (root): `dev` (two GPU nodes) with its weights in
the lab's S3 bucket. Day 0: first boot and every SSM association in the engine's order, every
replica serving through the load balancer (HAProxy) with the lab's key over TLS; the node role's
policy holds on the nodes' own AWS CLI; then an image bump rolled under client load, begun while
a replica still loads; Prometheus and Alertmanager behind the lab's monitoring password, which
a rotation changes in place; `down` leaves nothing.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import secrets
import shutil
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from labkit.aws import lab, ssmrun
from labkit.cluster import lifecycle, probes
from labkit.engine import executor
from labkit.hosts import dockerd, netns
from qwen_cluster.ports import ALERTMANAGER, PROMETHEUS, Vantage, port_of
from qwen_cluster.render import ssm
from qwen_cluster.render.monitoring import webconfig
from tests.helpers.wait import wait_until
from tooling import changes, stackfile

LABEL = f"aws{os.getpid() % 100000}"
S3_URI = "s3://qwen-cluster-lab-weights/Qwen/Qwen3-32B/"
NEEDED = ("ip", "haproxy", "nsenter", "unshare", "openssl")
MISSING = netns.missing_requirements() + [f"{b} not installed" for b in NEEDED if not shutil.which(b)]
if not Path("/usr/bin/aws").exists():
    MISSING.append("the AWS CLI is not installed (Debian's awscli: scripts/setup-system.sh)")
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")


@pytest.fixture(scope="module")
def day0():
    lab.down(LABEL)
    raw = stackfile.read("dev")
    raw["qwen-cluster:model"] = {**raw["qwen-cluster:model"], "weights": {"source": "s3", "uri": S3_URI}}
    aws_plan = lab.build(stackfile.validate(raw), LABEL, raw, "dev")
    try:
        report, rendered = lab.up(aws_plan)
        assert report.ok, [(s.resource, s.detail[-800:]) for s in report.steps if not s.ok]
        yield aws_plan, report, rendered
    finally:
        lab.down(LABEL)


def _chat(aws_plan, key_index: int | None = 0):
    client = aws_plan.plan.vantage(Vantage.CLIENT).namespace
    access = lifecycle.client_access(aws_plan.plan, key_index)
    lb = aws_plan.plan.load_balancer
    return netns.call_in(
        client, probes.chat, lb.ip, aws_plan.plan.cluster.load_balancer.port, "hi", access=access
    )


def test_day0_boots_every_node_and_runs_every_association_in_order(day0):
    aws_plan, report, rendered = day0
    ran = {step.resource: step for step in report.steps if step.op != "same"}
    for name in rendered.dependencies():
        if name in ran:
            for before in rendered.dependencies()[name] & set(ran):
                assert ran[before].started + ran[before].seconds <= ran[name].started + 0.01, (before, name)
    assert {run.association for run in report.runs.values()} == set(
        lab.model.read(rendered, "us-west-2").associations
    )
    for run in report.runs.values():
        assert run.status == ssmrun.SUCCESS, (run.association, run.detail)
    boots = [s for s in report.steps if s.step == "boot"]
    assert len(boots) == 2 and all("user data: Success" in s.detail for s in boots)


def _until_served_by(aws_plan, nodes: set[str], key_index: int | None = 0) -> None:
    """Until the load balancer has sent a chat to each of `nodes`: a target it just registered
    takes its health check's healthy threshold (HAProxy, as the NLB) before it gets any."""
    seen: set[str] = set()

    def chat() -> tuple[set[str], tuple]:
        reply = _chat(aws_plan, key_index)
        if reply.ok and reply.node:
            seen.add(reply.node)
        return set(seen), (reply.status, reply.error, reply.node)  # the last reply, if it times out

    what = f"chats answered by each of {sorted(nodes)}"
    wait_until(chat, what=what, timeout=60, done=lambda answer: answer[0] >= nodes)


def test_day0_every_replica_serves_through_the_load_balancer_with_the_key_over_tls(day0):
    aws_plan, _, _ = day0
    _until_served_by(aws_plan, {"master", "worker-1"})
    replies = [_chat(aws_plan) for _ in range(6)]
    assert all(reply.ok for reply in replies), [reply.error or reply.status for reply in replies]
    assert {reply.node for reply in replies} == {"master", "worker-1"}
    assert _chat(aws_plan, key_index=None).status == 401


def test_day0_staged_the_weights_from_s3_before_each_server_started(day0):
    aws_plan, report, _ = day0
    ran = {step.resource: step for step in report.steps}
    for node in ("master", "worker-1"):
        copy = (
            aws_plan.root
            / "nodes"
            / node
            / "fs/var/cache/qwen-cluster/huggingface/qwen-cluster-weights/Qwen/Qwen3-32B"
        )
        assert sorted(p.name for p in copy.iterdir()) == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]
        stage, server = ran[f"gpu-nodes-{node}-stage"], ran[f"gpu-nodes-{node}-server"]
        assert stage.started + stage.seconds <= server.started + 0.01


def test_the_node_role_refuses_what_it_does_not_allow_and_imds_wants_a_token(day0):
    aws_plan, _, rendered = day0
    _, machines = lab.context(aws_plan, rendered)
    node = machines["master"]
    status, code, output = node.execute(
        "#!/bin/bash\nexport AWS_DEFAULT_REGION=us-west-2\n"
        "aws ssm put-parameter --name /qwen-cluster/dev/x --value y --type String\n",
        "deny",
        60,
    )
    assert status == ssmrun.FAILED and "AccessDenied" in output, output
    status, _, output = node.execute(
        "#!/bin/bash\nexport AWS_DEFAULT_REGION=us-west-2\n"
        "aws s3 cp s3://qwen-cluster-lab-weights/elsewhere/f -\n",
        "deny-s3",
        60,
    )
    assert status == ssmrun.FAILED and ("403" in output or "Forbidden" in output), output
    status, _, output = node.execute(
        "#!/bin/bash\nexport AWS_DEFAULT_REGION=us-west-2\n"
        "aws ssm get-parameter --name /qwen-cluster/prod/endpoint/api-keys --with-decryption\n",
        "deny-other-stack",
        60,
    )
    assert status == ssmrun.FAILED and "AccessDenied" in output, output
    # The monitoring credentials and the servers' private key: the nodes share one role (whose
    # managed policy allows GetParameter on "*"), yet only the monitoring node's instance reads them.
    for name in ("password", "web-config", "tls-private-key"):
        read = (
            "#!/bin/bash\nexport AWS_DEFAULT_REGION=us-west-2\n"
            f"aws ssm get-parameter --name /qwen-cluster/dev/monitoring/{name} --with-decryption >/dev/null\n"
        )
        status, _, output = machines["worker-1"].execute(read, f"deny-monitoring-{name}", 60)
        assert status == ssmrun.FAILED and "AccessDenied" in output, output
        status, _, output = node.execute(read, f"allow-monitoring-{name}", 60)
        assert status == ssmrun.SUCCESS, output
    _, _, output = node.execute(
        "#!/bin/bash\ncurl -s -o /dev/null -w '%{http_code}' http://169.254.169.254/latest/meta-data/instance-id\n",
        "imds-v1",
        30,
    )
    assert output.strip() == "401"


def test_check_on_the_running_lab_passes(day0):
    from labkit.aws import check

    _, results = check.run(LABEL)
    assert all(result.ok for result in results), [r for r in results if not r.ok]
    groups = {result.group for result in results}
    assert {"containment", "latency", "ssm", "containers", "load balancer"} <= groups


def _failed_steps(result: dict) -> str:
    """The failed steps with their whole detail (the run's status and output tail), which
    pytest's shortened repr of the step dicts would cut off."""
    return "\n".join(f"{s['resource']} ({s['op']} on {s['node']}): {s.get('detail', '')}"
                      for s in result["steps"] if not s["ok"])  # fmt: skip


def _still_loading(aws_plan, rendered, node: str) -> tuple[threading.Thread, threading.Event]:
    """`node`'s replica as one still loading after a day 0 that did not wait for it: registered
    anew (`initial`, the NLB sends it nothing until its checks pass), its server stopped until
    the master's model-server run of the next change begins, then started: it loads and rises.
    Set the event when the change ends: a change stopped before that run starts it at once."""
    stack, _ = lab.context(aws_plan, rendered)
    group, instance = stack.target_group, stack.instances[node]
    for action in ("deregister_targets", "register_targets"):
        lab.deployer_call(aws_plan, action, group.arn, instance.instance_id, group.port)
    member = next(m for m in aws_plan.plan.nodes if m.node == node)
    daemon = lab.node_daemon(aws_plan, member)
    dockerd.docker(daemon, "stop", "--time", "1", ssm.CONTAINER_NAME)
    runs = aws_plan.root / "nodes" / "master" / "runs"
    before = set(runs.glob("*-modelServer"))

    def start_once_the_master_runs() -> None:
        try:
            wait_until(lambda: set(runs.glob("*-modelServer")) - before or change_ended.is_set(),
                       what="the master's model-server run", timeout=120)  # fmt: skip
        finally:  # also when the change stopped before it: the next tests need worker-1 serving
            dockerd.docker(daemon, "start", ssm.CONTAINER_NAME)

    change_ended = threading.Event()
    thread = threading.Thread(target=start_once_the_master_runs, daemon=True)
    thread.start()
    return thread, change_ended


def test_an_image_bump_begun_while_a_replica_loads_drains_none_before_it_serves_and_fails_nothing(day0):
    # Begun as `up` then `upgrade` at once can begin: worker-1 still loading. The master may
    # leave only once worker-1 is in service (rollout.maxUnavailable 1 at two replicas).
    aws_plan, _, rendered = day0
    loading, change_ended = _still_loading(aws_plan, rendered, "worker-1")
    try:
        result = lab.upgrade(LABEL, ["model.image=vllm/vllm-openai:v0.33.1"], max_requests=2000)
    finally:
        change_ended.set()
        loading.join(timeout=30)
    assert result["ok"], _failed_steps(result)
    assert result["failed"] == 0 and result["streamsCut"] == 0, result["failures"]
    assert result["requests"] > 100
    assert result["maxReplicasDown"] == aws_plan.plan.cluster.max_unavailable == 1
    stack, _ = lab.context(aws_plan, rendered)
    runs = sorted((aws_plan.root / "nodes" / "master" / "runs").glob("*-modelServer"))
    waited = f"waiting for {stack.instances['worker-1'].instance_id} to be in service"
    assert waited in (runs[-1] / "stdout").read_text()  # the master's run of this change
    assert result["ssm"]["everyDocumentOnEveryNode"], result["ssm"]
    assert result["ssm"]["notSucceeded"] == [], result["ssm"]["notSucceeded"]
    servers = [s for s in result["steps"] if s["resource"].endswith("-server")]
    assert [s["node"] for s in servers] == ["master", "worker-1"]  # one lane at 2 replicas
    images = {_chat(aws_plan).image for _ in range(6)}
    assert images == {"vllm/vllm-openai:v0.33.1"}


def _model_pids(aws_plan) -> dict[str, int]:
    """The model containers' processes, as each node's dockerd reports them."""
    found = {}
    for member in aws_plan.plan.nodes:
        for entry in lifecycle.containers(aws_plan.plan, member, "model").values():
            if entry["State"]["Running"]:
                found[member.node] = entry["State"]["Pid"]
    return found


def test_a_key_rotation_reloads_the_proxies_and_restarts_no_model_server(day0):
    aws_plan, _, _ = day0
    identity = lifecycle.endpoint_identity(aws_plan.plan)
    pids = _model_pids(aws_plan)
    result = lab.upgrade(LABEL, [f'access.apiKeys=["{identity.api_keys[1]}"]'], max_requests=0)
    assert result["ok"], _failed_steps(result)
    assert result["parametersUpdated"] == ["/qwen-cluster/dev/endpoint/api-keys"]
    assert sorted(s["resource"] for s in result["steps"]) == ["node-proxy-master", "node-proxy-worker-1"]
    assert _model_pids(aws_plan) == pids and len(pids) == 2
    assert _chat(aws_plan, key_index=1).ok
    assert _chat(aws_plan, key_index=0).status == 401


def _http(
    namespace: str,
    url: str,
    login: str | None,
    method: str = "GET",
    body: bytes | None = None,
    ca_file: str | None = None,
):
    """(status, body) of one request from inside `namespace`, with basic auth `user:password`;
    over https verifying `ca_file` alone (the lab's CA: monitoring.tls, the lab's own)."""
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def send() -> tuple[int, bytes]:
        request = urllib.request.Request(url, data=body, method=method)
        if login is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
        if body is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    return netns.call_in(namespace, send)


def _monitoring_pids(aws_plan) -> dict[str, int]:
    master = next(m for m in aws_plan.plan.nodes if m.node == "master")
    found = lifecycle.containers(aws_plan.plan, master)
    return {name: found[name]["State"]["Pid"] for name in ("qwen-prometheus", "qwen-alertmanager")}


def test_prometheus_and_alertmanager_ask_for_the_password_and_a_rotation_keeps_their_state(day0):
    """monitoring.password and monitoring.tls on AWS (the lab's own, as on bare metal): the
    monitoring node's run read the web config, the password and the certificate and key from
    SecureString parameters; both servers speak TLS only and are verified against the lab CA.
    Without the password, or with a wrong one, both servers answer 401 from a member and from their
    own node; with it, 200. A new password is one run of the monitoring node's association: the
    old one is refused at once, the new one accepted, and the same processes keep Alertmanager's
    silence and Prometheus's data from before (its own scrapes log in with the new password)."""
    aws_plan, _, _ = day0
    cluster = aws_plan.plan.cluster
    where = cluster.monitoring_node
    identity = lifecycle.endpoint_identity(aws_plan.plan)
    password = identity.monitoring_password
    login = f"{webconfig.USER}:{password}"
    # Over https (monitoring.tls from the lab's CA, read from its SecureString parameters).
    prometheus = f"https://{where.ip}:{port_of(cluster.ports, PROMETHEUS)}"
    alertmanager = f"https://{where.ip}:{port_of(cluster.ports, ALERTMANAGER)}"
    http = functools.partial(_http, ca_file=identity.ca_file)
    urls = [
        *(prometheus + path for path in ("/-/healthy", "/-/ready", "/api/v1/query?query=up")),
        *(alertmanager + path for path in ("/-/healthy", "/-/ready", "/api/v2/silences")),
    ]
    namespaces = [m.namespace for m in aws_plan.plan.nodes if m.node in ("master", "worker-1")]

    def statuses(current: str) -> dict[str, tuple[int, ...]]:
        return {
            f"{namespace} {url}": tuple(
                http(namespace, url, auth)[0] for auth in (None, f"{webconfig.USER}:wrong-password", current)
            )
            for namespace in namespaces
            for url in urls
        }

    for url in (prometheus, alertmanager):  # up since day 0; ready once their storage is open
        wait_until(lambda url=url: http(namespaces[0], f"{url}/-/ready", login)[0] == 200,
                   what=f"{url} ready", timeout=60)  # fmt: skip
    seen = statuses(login)
    assert set(seen.values()) == {(401, 401, 200)}, seen
    # TLS only: plain HTTP gets Go's fixed refusal (net/http server.go) and nothing else.
    for port in (port_of(cluster.ports, PROMETHEUS), port_of(cluster.ports, ALERTMANAGER)):
        plain = netns.call_in(namespaces[1], probes.request, str(where.ip), port, "GET", "/-/healthy")
        assert plain.status == 400 and b"HTTP request to an HTTPS server" in plain.body, plain
    silence = {
        "matchers": [{"name": "alertname", "value": "QwenReplicaDown", "isRegex": False}],
        "startsAt": "2026-01-01T00:00:00Z",
        "endsAt": "2099-01-01T00:00:00Z",
        "createdBy": "test_lab_aws",
        "comment": "kept across the rotation",
    }
    master_ns = namespaces[0]
    silences, body = f"{alertmanager}/api/v2/silences", json.dumps(silence).encode()
    assert http(master_ns, silences, None, "POST", body)[0] == 401
    posted = http(master_ns, silences, login, "POST", body)
    assert posted[0] == 200, posted
    before_rotation = time.time()
    pids = _monitoring_pids(aws_plan)
    model_pids = _model_pids(aws_plan)

    rotated = "rotated-" + secrets.token_hex(20)
    # A password needs monitoring.tls (config/rules.py): the lab's own pair, as it gives every
    # stack (labkit/engine/substitutions.py), so the certificate's parameters stay as they are.
    certificate, private_key = identity.monitoring_tls(str(where.ip))
    tls = {"certificate": certificate, "privateKey": private_key, "caCertificate": identity.ca_certificate}
    result = lab.upgrade(
        LABEL, [f"monitoring.password={rotated}", f"monitoring.tls={json.dumps(tls)}"], max_requests=0
    )
    assert result["ok"], _failed_steps(result)
    assert result["parametersUpdated"] == [
        "/qwen-cluster/dev/monitoring/password",
        "/qwen-cluster/dev/monitoring/web-config",
    ]
    assert [s["resource"] for s in result["steps"]] == ["monitoring-master"]  # one run, in place
    assert result["ssm"]["notSucceeded"] == [], result["ssm"]["notSucceeded"]
    new_login = f"{webconfig.USER}:{rotated}"
    seen = statuses(new_login)
    assert set(seen.values()) == {(401, 401, 200)}, seen
    assert http(master_ns, f"{prometheus}/-/healthy", login)[0] == 401  # the old one is refused
    # The same processes: no restart, so the silence and the data from before are there.
    assert _monitoring_pids(aws_plan) == pids and _model_pids(aws_plan) == model_pids
    status, body = http(master_ns, silences, new_login)
    assert status == 200 and [s for s in json.loads(body) if s["comment"] == silence["comment"]], body
    status, body = http(master_ns, f"{prometheus}/api/v1/query?query=up&time={before_rotation}", new_login)
    assert status == 200 and json.loads(body)["data"]["result"], body

    rotated_at = time.time()  # after the run that wrote the new files

    def scraped_since() -> dict[str, str]:
        since = urllib.parse.quote(f"up and timestamp(up) > {rotated_at}")
        answer = http(master_ns, f"{prometheus}/api/v1/query?query={since}", new_login)[1]
        return {r["metric"]["job"]: r["value"][1] for r in json.loads(answer)["data"]["result"]}

    up = wait_until(
        scraped_since,
        what="Prometheus's scrapes of itself and Alertmanager with the new password",
        timeout=60,
        done=lambda up: "prometheus" in up and "alertmanager" in up,
    )
    assert (up["prometheus"], up["alertmanager"]) == ("1", "1"), up


def test_a_node_added_boots_gets_every_association_registers_and_serves(day0):
    aws_plan, _, _ = day0
    nodes = [*stackfile.read("dev")["qwen-cluster:nodes"], {"name": "worker-2", "ip": "10.42.1.102"}]
    result = lab.upgrade(LABEL, [f"nodes={json.dumps(nodes)}"], max_requests=2000)
    assert result["ok"], _failed_steps(result)
    assert result["nodesAdded"] == ["worker-2"]
    assert result["failed"] == 0 and result["streamsCut"] == 0, result["failures"]
    assert result["requests"] > 50 and result["maxReplicasDown"] == 0
    ran = {s["resource"]: s for s in result["steps"]}
    boot, server = ran["gpu-nodes-worker-2"], ran["gpu-nodes-worker-2-server"]
    assert boot["node"] == "worker-2" and boot["at"] + boot["seconds"] <= server["at"] + 0.01
    assert {s["resource"] for s in result["steps"] if s["resource"].endswith("-server")} == {
        "gpu-nodes-worker-2-server"
    }  # the replicas that served are left alone
    documents = result["ssm"]["documents"]
    assert all(documents[d].get(i) == ssmrun.SUCCESS for d in documents for i in ["worker-2"]), documents
    assert result["ssm"]["notSucceeded"] == [], result["ssm"]["notSucceeded"]
    assert result["ssm"]["everyDocumentOnEveryNode"], documents
    # The key the stack accepts now (a key rotation may or may not have run before this test).
    _until_served_by(aws_plan, {"master", "worker-1", "worker-2"}, key_index=result["clientKey"])
    # The stack-wide staging targets the GPU nodes by tag and is not changed: State Manager runs it
    # on the instance that came to match its targets, as on every node before.
    assert result["ssm"]["runs"]["gpu-nodes-stage"] == {"worker-2": ssmrun.SUCCESS}, result["ssm"]["runs"]


def test_a_node_removed_drains_its_target_before_its_instance_goes_and_fails_nothing(day0):
    """Runs after the node-added test (dev keeps its two nodes)."""
    aws_plan, _, _ = day0
    before = executor.load_state(lifecycle.state_file_for(LABEL))
    assert "gpu-nodes-worker-2" in {r.name for r in before.render.custom_resources}, "needs worker-2 added"
    nodes = stackfile.read("dev")["qwen-cluster:nodes"]
    result = lab.upgrade(LABEL, [f"nodes={json.dumps(nodes)}"], max_requests=2000)
    assert result["ok"], _failed_steps(result)
    assert result["nodesRemoved"] == ["worker-2"]
    assert result["failed"] == 0 and result["streamsCut"] == 0, result["failures"]
    assert result["requests"] > 50 and result["maxReplicasDown"] == 0
    # Out of the target group, drained, before the instance is terminated.
    assert result["targetAtTermination"] == {"worker-2": "unused"}, result["targetAtTermination"]
    # What the plan says: that node's resources deleted, the other nodes' monitoring updated.
    after = executor.load_state(lifecycle.state_file_for(LABEL))
    planned = {c.name: c.action for c in changes.diff(before.render, after.render) if c.action != "same"}
    deleted = [s["resource"] for s in result["steps"] if s["op"] == "delete"]
    assert sorted(deleted) == sorted(name for name, action in planned.items() if action == "delete")
    assert {name for name, action in planned.items() if action != "delete"} == {
        "monitoring-master",
        "monitoring-worker-1",
    }
    assert {"gpu-nodes-worker-2", "model-lb-worker-2", "gpu-nodes-worker-2-server"} <= set(deleted)
    # Dependents first: its registration, then the wait for its drain, then its instance.
    assert (
        deleted.index("model-lb-worker-2")
        < deleted.index("model-lb-worker-2-drained")  # the program's wait for the drain
        < deleted.index("gpu-nodes-worker-2")
    )
    # Other labs (a parallel worker's, a bench's) may hold a worker-2 of their own: look only at ours.
    assert f"qcl-{LABEL}-node-worker-2" not in netns.listed()
    assert f"qcl-{LABEL}-node-worker-1" in netns.listed()
    _until_served_by(aws_plan, {"master", "worker-1"}, key_index=result["clientKey"])


def test_down_leaves_nothing_behind(day0):
    aws_plan, _, _ = day0
    lab.down(LABEL)
    prefix = f"qcl-{LABEL}-"
    assert not [name for name in netns.listed() if name.startswith(prefix)]
    assert not [p for p in netns.NETNS_ETC.glob(f"{prefix}*")] if netns.NETNS_ETC.exists() else True
    assert not aws_plan.root.exists()
    # The nodes' Docker engines, their containers, the disks' holders, HAProxy, the API stand-in:
    # every process of the lab carries its cgroup mark, and none is left.
    assert not netns.marked_pids(LABEL)
    assert not (lifecycle.DOCKER_RUN_ROOT / LABEL).exists()
    assert not (lifecycle.DOCKER_DATA_ROOT / LABEL).exists()
    # No mount namespace anywhere still holds a node's disk or a container of it.
    holding = []
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        try:
            text = mountinfo.read_text()
        except OSError:
            continue  # the process ended meanwhile
        if str(aws_plan.root) in text or f"/{LABEL}/" in text:
            holding.append(mountinfo.parent.name)
    assert not holding, holding
