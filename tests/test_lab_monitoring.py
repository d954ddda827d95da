"""Monitoring in the lab: the program's monitoring containers run as Debian's Prometheus,
Alertmanager and exporters in the namespaces (labkit/images/standins.py), on the lab's clock
(a 1 s scrape). `check` has a monitoring group; a node's cut link fires node-unreachable and
replica-down and `scripts/doctor.py onprem --lab` names the node, both resolve once the link is
back; a netem delay above network.maxLatencyMs fires the latency alert.

Its own lab for the module (label m<pid>, three of onprem's hosts: the master with Prometheus,
worker-1 for the delay, worker-2 for the cut link); every fault is undone.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from labkit.cluster import blueprint, check, lifecycle, probes
from labkit.cluster import doctor as labdoctor
from labkit.hosts import netns
from qwen_cluster import tags
from qwen_cluster.ports import ALERTMANAGER, PROMETHEUS, Vantage, port_of
from qwen_cluster.render.monitoring import webconfig
from tests.helpers.wait import wait_until
from tests.test_lab_namespaces import MISSING
from tooling import changes, doctor

pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")
ROOT = Path(__file__).resolve().parents[1]
LABEL = f"m{os.getpid() % 100000}"
# Wall-time bound for a fault to show (the issue: within a minute) and to clear.
WITHIN = 60


@pytest.fixture(scope="module")
def running():
    """Its own lab (module scope: down before the next module's lab goes up)."""
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=3, label=LABEL)
    options = lifecycle.Options()
    try:
        yield lab_plan, options, lifecycle.up(lab_plan, options)
    finally:
        lifecycle.down(LABEL)


def _doctor(label: str) -> tuple[int, dict]:
    done = subprocess.run(
        # What monitoring sees (the hosts' own checks are rehearsed in tests/test_lab_doctor.py).
        [sys.executable, str(ROOT / "scripts" / "doctor.py"), "onprem", "--lab", "--label", label, "--json"]
        + ["--from", "monitoring"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout or "{}")


class _Unanswered(str):
    """A query Prometheus did not answer in time (a busy machine): no answer yet, so the wait
    asks again within its bound, and shows the error if that bound passes."""

    def __bool__(self) -> bool:
        return False


def _until(what: str, condition, timeout: float = WITHIN):
    """(seconds it took, the condition's answer), by tests/helpers/wait.py."""

    def asked():
        try:
            return condition()
        except doctor.Unreachable as error:
            return _Unanswered(error)

    started = time.monotonic()
    last = wait_until(asked, what=what, timeout=timeout, interval=1)
    return time.monotonic() - started, last


def _ask(lab_plan):
    """Prometheus's API from its node over https, with doctor's own timeout and CA check
    (tooling/doctor.py http_fetch)."""
    cluster = lab_plan.cluster
    _, fetch = labdoctor.monitoring_fetch(lab_plan)
    where = lab_plan.node(cluster.monitoring_node.name).namespace
    return lambda path: netns.call_in(where, fetch, path)


def _firing(lab_plan) -> list[doctor.Finding]:
    return doctor.findings(_ask(lab_plan), lab_plan.cluster)


def test_check_has_a_monitoring_group_that_passes(running):
    lab_plan, _, report = running
    assert report.ok, [step for step in report.steps if not step.ok]
    results = check.monitoring(lab_plan)
    # Every endpoint, the rules, the alerts; then per server (2) from the monitoring range: plain
    # HTTP, https without and with the password, four TLS versions.
    assert len(results) == len(lab_plan.cluster.nodes) + 2 + 2 * 7
    assert all(result.ok for result in results), [r for r in results if not r.ok]
    tls_rows = {
        (r.target, r.what.split(" ")[0], r.observed.split(" ")[0])
        for r in results
        if r.source == "monitoring"
    }
    assert {("prometheus", "TLSv1", "refused"), ("alertmanager", "TLSv1.1", "refused")} <= tls_rows
    code, answer = _doctor(LABEL)
    assert (code, answer["healthy"], answer["findings"]) == (0, True, [])


def test_a_cut_link_names_the_node_and_clears(running):
    lab_plan, _, _ = running
    victim = lab_plan.node("worker-2")
    netns.run(["ip", "-n", lab_plan.switch, "link", "set", victim.switch_port, "down"])
    try:
        took, _ = _until(
            "node-unreachable and replica-down for worker-2",
            lambda: (
                {"QwenNodeUnreachable", "QwenReplicaDown"}
                <= {f.alert for f in _firing(lab_plan) if "worker-2" in f.where}
            ),
        )
        code, answer = _doctor(LABEL)
        assert code == 1 and not answer["healthy"]
        assert all(f["where"] == ["worker-2"] for f in answer["findings"]), answer
        assert took < WITHIN
    finally:
        netns.run(["ip", "-n", lab_plan.switch, "link", "set", victim.switch_port, "up"])
    _until("the alerts to resolve", lambda: _firing(lab_plan) == [] or None)
    assert _doctor(LABEL)[0] == 0


def _netem(namespace: str, delay_ms: float) -> str | None:
    """Add a netem delay on the node's link; the reason when this kernel has no sch_netem."""
    done = netns.exec_in(
        namespace,
        ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms:g}ms"],
        check=False,
    )
    if done.returncode != 0 and "unknown" in done.stderr.lower():
        return f"this kernel has no netem qdisc (sch_netem): {done.stderr.strip()}"
    assert done.returncode == 0, done.stderr
    return None


def test_a_delay_over_the_latency_budget_fires_the_latency_alert(running):
    lab_plan, _, _ = running
    budget_ms = lab_plan.cluster.network.max_latency_ms
    victim = lab_plan.node("worker-1")
    missing = _netem(victim.namespace, budget_ms * 3)
    if missing:
        pytest.skip(missing)
    try:
        _until(
            "QwenNodeLatencyHigh naming worker-1",
            lambda: any(
                f.alert == "QwenNodeLatencyHigh" and "worker-1" in f.where for f in _firing(lab_plan)
            ),
        )
        code, answer = _doctor(LABEL)
        assert code == 1
        assert any(
            "latency" in f["what"] and "over network.maxLatencyMs" in f["what"] for f in answer["findings"]
        )
    finally:
        netns.exec_in(victim.namespace, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
    _until("the latency alert to resolve", lambda: _firing(lab_plan) == [] or None)


def _pid(lab_plan, node: str, container: str) -> int:
    """The container's main process as its node's Docker engine reports it (a restart or a
    recreation changes it)."""
    return lifecycle.containers(lab_plan, lab_plan.node(node))[container]["State"]["Pid"]


def test_a_new_alert_bound_reloads_prometheus_and_restarts_nothing(running):
    """Day 2 in the lab: the bound changes, the program's command rewrites the rules and sends
    SIGHUP (`docker kill --signal`, on the node's Docker engine); the same Prometheus and model
    servers keep running."""
    lab_plan, options, _ = running
    before = {
        "prometheus": _pid(lab_plan, "master", "qwen-prometheus"),
        **{n.name: _pid(lab_plan, n.name, tags.MODEL_SERVER_CONTAINER) for n in lab_plan.cluster.nodes},
    }
    config = changes.apply_changes(lifecycle.stack_config(lab_plan), ["monitoring.maxRequestsWaiting=7"])
    report = lifecycle.apply(lab_plan, options, config=config)
    assert report.ok, [step for step in report.steps if not step.ok]
    ran = {(step.resource, step.op) for step in report.steps if step.op in ("create", "update", "delete")}
    assert ran == {("monitoring-config", "update")}

    def loaded() -> bool:
        groups = _ask(lab_plan)("/api/v1/rules")["groups"]
        rule = next(r for g in groups for r in g["rules"] if r["name"] == "QwenRequestsWaiting")
        return rule["query"].endswith("> 7")

    _until("the new bound loaded", loaded)
    after = {
        "prometheus": _pid(lab_plan, "master", "qwen-prometheus"),
        **{n.name: _pid(lab_plan, n.name, tags.MODEL_SERVER_CONTAINER) for n in lab_plan.cluster.nodes},
    }
    assert after == before


def test_prometheus_refuses_quit_and_reload_over_http_from_a_member(running):
    """No --web.enable-lifecycle: POST /-/quit and /-/reload answer 403 to a member that logs in
    (every member reaches every port of the others), 401 without the password, and the same
    Prometheus keeps running. Reloading is by SIGHUP (the test above); Alertmanager has no /-/quit
    at all."""
    lab_plan, _, _ = running
    cluster = lab_plan.cluster
    where = cluster.monitoring_node
    member = next(node for node in lab_plan.nodes if node.node != where.name)
    before = _pid(lab_plan, where.name, "qwen-prometheus")
    prometheus_port = port_of(cluster.ports, PROMETHEUS)
    login = f"{webconfig.USER}:{labdoctor.monitoring_password(lab_plan)}"

    verified = probes.ClientAccess(ca_file=lifecycle.endpoint_identity(lab_plan).ca_file)

    def post(port, path, basic_auth=login):
        return netns.call_in(
            member.namespace, probes.post, str(where.ip), port, path, basic_auth=basic_auth, access=verified
        )

    answers = {path: post(prometheus_port, path).status for path in ("/-/quit", "/-/reload")}
    alertmanager = post(port_of(cluster.ports, ALERTMANAGER), "/-/quit").status
    assert answers == {"/-/quit": 403, "/-/reload": 403}
    assert alertmanager in (404, 405), alertmanager
    assert post(prometheus_port, "/-/quit", None).status == 401
    assert "version" in _ask(lab_plan)("/api/v1/status/buildinfo")  # still answering
    assert _pid(lab_plan, where.name, "qwen-prometheus") == before


def test_without_the_password_prometheus_and_alertmanager_answer_401_from_every_vantage(running):
    """The audit's vantages that reach 9090/9093 (the monitoring host, a member), over https
    verifying the lab CA: no route, the health probes included, answers without the password;
    with it, they do. A silence cannot be created without it."""
    lab_plan, _, _ = running
    cluster = lab_plan.cluster
    where = cluster.monitoring_node
    login = f"{webconfig.USER}:{labdoctor.monitoring_password(lab_plan)}"
    sources = [lab_plan.vantage(Vantage.MONITORING), next(n for n in lab_plan.nodes if n.node != where.name)]
    routes = {
        port_of(cluster.ports, PROMETHEUS): ("/-/healthy", "/-/ready", "/api/v1/query?query=up"),
        port_of(cluster.ports, ALERTMANAGER): ("/-/healthy", "/-/ready", "/api/v2/silences"),
    }

    verified = probes.ClientAccess(ca_file=lifecycle.endpoint_identity(lab_plan).ca_file)

    def status(source, port: int, path: str, auth: str | None) -> int:
        headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
        reply = netns.call_in(
            source.namespace,
            probes.request,
            str(where.ip),
            port,
            "GET",
            path,
            headers=headers,
            access=verified,
        )
        return reply.status

    for source in sources:
        for port, paths in routes.items():
            for path in paths:
                seen = tuple(
                    status(source, port, path, auth) for auth in (None, "qwen-monitoring:wrong", login)
                )
                assert seen == (401, 401, 200), (source.node, port, path)
        silence = netns.call_in(
            source.namespace,
            probes.post,
            str(where.ip),
            port_of(cluster.ports, ALERTMANAGER),
            "/api/v2/silences",
            access=verified,
        )
        assert silence.status == 401


def _served_certificate(ip: str, port: int) -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection((ip, port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        return tls.getpeercert(binary_form=True)


def _load(urls: list[str], ca_file: str, login: dict[str, str], stop: threading.Event, seen: Counter) -> None:
    """A client reading both servers over https until `stop`, with the password in `login` (the
    test switches it once the rotation is applied): counts each answer's status, and each
    connection that failed (a handshake with a certificate and a key that do not match would)."""
    context = ssl.create_default_context(cafile=ca_file)
    while not stop.is_set():
        for url in urls:
            token = base64.b64encode(f"{webconfig.USER}:{login['password']}".encode()).decode()
            request = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
            try:
                with urllib.request.urlopen(request, timeout=5, context=context) as response:
                    response.read()
                    seen[response.status] += 1
            except urllib.error.HTTPError as error:
                seen[error.code] += 1
            except (OSError, urllib.error.URLError) as error:
                seen[f"failed: {type(error).__name__}"] += 1


def _apply_under_load(lab_plan, options, config, source, urls, ca_file, client, new_password=None):
    """`config` applied while a client reads `urls` over https from `source`; with `new_password`
    the client switches to it once the apply is done. (the report, the client's answers)."""
    stop, seen = threading.Event(), Counter()
    loader = threading.Thread(target=netns.call_in, args=(source, _load, urls, ca_file, client, stop, seen))
    loader.start()
    try:
        _until("the client's first answers", lambda: seen[200] > 0)
        report = lifecycle.apply(lab_plan, options, config=config)
        if new_password is not None:
            client["password"] = new_password
        answered = seen[200]
        _until("the client's answers after the apply", lambda: seen[200] > answered + 4)
    finally:
        stop.set()
        loader.join(timeout=30)
    return report, seen


def test_rotating_the_certificate_then_the_password_under_load_keeps_alert_state_and_restarts_nothing(
    running,
):
    """Day 2: a new certificate (from the lab CA), then a new password, each applied while a client
    reads both servers: each one step, `monitoring-config` update in place. After the certificate
    the servers present the new one on the next connection and the client, its password unchanged,
    sees only 200s; after the password its old one is refused. No connection of the client fails,
    Alertmanager keeps its silence, Prometheus its history, and no process starts again.
    Last in the module: the lab's password is this test's from here on."""
    lab_plan, options, _ = running
    cluster = lab_plan.cluster
    where = cluster.monitoring_node
    ip = str(where.ip)
    identity = lifecycle.endpoint_identity(lab_plan)
    old_password = labdoctor.monitoring_password(lab_plan)
    new_password = "rotated-lab-monitoring-password-0123456789"
    source = lab_plan.vantage(Vantage.MONITORING).namespace
    prometheus_port, alertmanager_port = (
        port_of(cluster.ports, PROMETHEUS),
        port_of(cluster.ports, ALERTMANAGER),
    )
    prometheus_url = labdoctor.monitoring_url(lab_plan)
    alertmanager_url = labdoctor.monitoring_url(lab_plan, alertmanager_port)
    verified = probes.ClientAccess(ca_file=identity.ca_file)
    silence = {
        "matchers": [{"name": "alertname", "value": "QwenReplicaDown", "isRegex": False}],
        "startsAt": "2026-01-01T00:00:00Z",
        "endsAt": "2099-01-01T00:00:00Z",
        "createdBy": "test_lab_monitoring",
        "comment": "kept across the rotation",
    }

    def login(password: str) -> dict[str, str]:
        return {
            "Authorization": "Basic " + base64.b64encode(f"{webconfig.USER}:{password}".encode()).decode()
        }

    def silences(password: str) -> tuple[int, list]:
        reply = netns.call_in(
            source, probes.request, ip, alertmanager_port, "GET", "/api/v2/silences",
            access=verified, headers=login(password),
        )  # fmt: skip
        return reply.status, (json.loads(reply.body) if reply.status == 200 else [])

    def pids() -> dict[str, int]:
        return {
            "prometheus": _pid(lab_plan, where.name, "qwen-prometheus"),
            "alertmanager": _pid(lab_plan, where.name, "qwen-alertmanager"),
            **{n.name: _pid(lab_plan, n.name, tags.MODEL_SERVER_CONTAINER) for n in cluster.nodes},
        }

    def ran(report) -> set:
        assert report.ok, [step for step in report.steps if not step.ok]
        return {
            (step.resource, step.op) for step in report.steps if step.op in ("create", "update", "delete")
        }

    created = netns.call_in(
        source, _post_json, f"{alertmanager_url}/api/v2/silences", silence, identity.ca_file, old_password
    )
    assert created == 200
    before_rotation = time.time()
    before = pids()
    urls = [f"{prometheus_url}/api/v1/query?query=up", f"{alertmanager_url}/api/v2/silences"]
    client = {"password": old_password}

    # The certificate alone: invisible to a client that trusts the CA (same password, only 200s).
    certificate, private_key = identity.monitoring_tls(ip, stem="rotated")
    config = lifecycle.stack_config(lab_plan)
    key = "qwen-cluster:monitoring"
    config[key] = {
        **(config.get(key) or {}),
        "password": {"secure": old_password},
        "tls": {
            "certificate": {"secure": certificate},
            "privateKey": {"secure": private_key},
            "caCertificate": identity.ca_certificate,
        },
    }
    report, seen_certificate = _apply_under_load(
        lab_plan, options, config, source, urls, identity.ca_file, client
    )
    assert ran(report) == {("monitoring-config", "update")}
    # One file holds the chain and the key: no handshake sees a half-written pair.
    assert set(seen_certificate) == {200}, dict(seen_certificate)
    served = {
        port: netns.call_in(source, _served_certificate, ip, port)
        for port in (prometheus_port, alertmanager_port)
    }
    assert set(served.values()) == {ssl.PEM_cert_to_DER_cert(certificate)}
    assert pids() == before

    # Then the password: between the rewrite and the client's switch its old password is refused,
    # 401, never a failed connection.
    config[key] = {**config[key], "password": {"secure": new_password}}
    report, seen_password = _apply_under_load(
        lab_plan, options, config, source, urls, identity.ca_file, client, new_password=new_password
    )
    assert ran(report) == {("monitoring-config", "update")}
    assert set(seen_password) <= {200, 401} and seen_password[200], dict(seen_password)

    assert silences(old_password)[0] == 401
    status, kept = silences(new_password)
    assert status == 200 and [s for s in kept if s["comment"] == "kept across the rotation"]
    # Prometheus's own history from before the rotations, and its scrapes of itself and of
    # Alertmanager after them (it reads the new password from its file, trusts the same CA).
    ask = doctor.http_fetch(prometheus_url, password=new_password, ca_certificate=identity.ca_certificate)
    earlier = netns.call_in(source, ask, f"/api/v1/query?query=up&time={before_rotation - 2:.3f}")
    assert earlier["result"], "no samples from before the rotation"
    rotated_at = time.time()

    def scraped_since() -> bool:
        query = urllib.parse.quote(
            f'up{{job=~"prometheus|alertmanager"}} == 1 and timestamp(up) > {rotated_at}'
        )
        return len(netns.call_in(source, ask, f"/api/v1/query?query={query}")["result"]) == 2

    _until("Prometheus's scrapes of itself and Alertmanager with the new password", scraped_since)
    assert pids() == before
    print(
        f"rotation under load: the client's answers, certificate {dict(seen_certificate)}, "
        f"password {dict(seen_password)}"
    )


def _post_json(url: str, body: dict, ca_file: str, password: str) -> int:
    token = base64.b64encode(f"{webconfig.USER}:{password}".encode()).decode()
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"},
    )
    with urllib.request.urlopen(
        request, timeout=10, context=ssl.create_default_context(cafile=ca_file)
    ) as reply:
        return reply.status
