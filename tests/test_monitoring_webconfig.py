"""Prometheus and Alertmanager behind the rendered web config: Debian's prometheus and
prometheus-alertmanager for real, on loopback, with the rendered configs and command lines.
Without credentials they answer 401 (their health probes too); Prometheus logs in to itself and
to Alertmanager; a new password takes effect without a restart, and Alertmanager keeps its
silences."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml

from qwen_cluster import config
from qwen_cluster.render.monitoring import alertmanager, prometheus, webconfig
from tests.helpers import tools
from tests.helpers.wait import wait_until

PASSWORD = "first-monitoring-password-0123456789"
ROTATED = "second-monitoring-password-9876543210"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_cluster(prometheus_port: int = 9090, alertmanager_port: int = 9093) -> config.ClusterConfig:
    return config.validate(
        {
            "target": "bare-metal",
            "nodes": [
                {"name": "master", "ip": "127.0.0.1", "role": "master"},
                {"name": "worker-1", "ip": "127.0.0.2"},
            ],
            "network": {"cidr": "127.0.0.0/24", "minBandwidthGbps": 10, "maxLatencyMs": 1.0},
            "access": {
                "clientCidrs": ["10.0.0.0/8"],
                "adminCidrs": ["203.0.113.10/32"],
                "openEndpoint": True,
            },
            # The tests write the web config and password files themselves.
            "monitoring": {"scrapeIntervalSeconds": 1, "openToMonitoringCidrs": True},
            "ports": [
                {"name": "model-service", "port": 5000, "scope": "clients"},
                {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
                {"name": "monitoring", "port": 8000, "scope": "monitoring", "required": False},
                {"name": "prometheus", "port": prometheus_port, "scope": "monitoring", "required": False},
                {"name": "alertmanager", "port": alertmanager_port, "scope": "monitoring", "required": False},
            ],
            "bareMetal": {"nicSpeedGbps": 10, "gpusPerNode": 8, "gpuMemoryGb": 80},
        }
    )


# --- the hash -----------------------------------------------------------------------------------


def test_the_hash_is_the_same_on_every_run_and_checks_with_bcrypt():
    first = webconfig.password_hash(PASSWORD, "onprem/qwen-monitoring")
    webconfig.password_hash.cache_clear()
    assert webconfig.password_hash(PASSWORD, "onprem/qwen-monitoring") == first
    assert first.startswith(f"$2b${webconfig.BCRYPT_COST}$")
    assert bcrypt.checkpw(PASSWORD.encode(), first.encode())
    assert not bcrypt.checkpw(ROTATED.encode(), first.encode())
    assert webconfig.password_hash(PASSWORD, "dev/qwen-monitoring") != first


def test_the_salt_owes_nothing_to_the_password():
    """The salt is printed in the hash: derived from the password, it would let a reader of the
    file test guesses at SHA-256 speed."""
    one = webconfig.password_hash(PASSWORD, "onprem/qwen-monitoring")
    two = webconfig.password_hash(ROTATED, "onprem/qwen-monitoring")
    assert one[:29] == two[:29] == webconfig.salt("onprem/qwen-monitoring").decode()
    assert one != two


def test_the_web_config_names_one_user_with_the_hash():
    hashed = webconfig.password_hash(PASSWORD, "onprem/qwen-monitoring")
    assert yaml.safe_load(webconfig.web_config(hashed)) == {"basic_auth_users": {webconfig.USER: hashed}}


def test_prometheus_logs_in_to_itself_and_alertmanager_but_not_to_the_open_node_endpoints():
    rendered = yaml.safe_load(prometheus.prometheus_config(loopback_cluster(), password_file="/etc/pw"))
    login = {"username": webconfig.USER, "password_file": "/etc/pw"}
    jobs = {job["job_name"]: job.get("basic_auth") for job in rendered["scrape_configs"]}
    assert jobs == {prometheus.JOB: None, "prometheus": login, "alertmanager": login}
    assert rendered["alerting"]["alertmanagers"][0]["basic_auth"] == login
    assert "basic_auth" not in str(yaml.safe_load(prometheus.prometheus_config(loopback_cluster())))


# --- Debian's servers, for real -------------------------------------------------------------------


def _request(url: str, *, password: str | None = None, method: str = "GET", body: bytes | None = None):
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if password is not None:
        token = base64.b64encode(f"{webconfig.USER}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()
    except urllib.error.URLError as unreachable:  # not listening yet
        return 0, str(unreachable.reason).encode()


def _write(path: Path, text: str) -> None:
    """Atomically, as the node's files step writes them (temp file + rename)."""
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text)
    os.replace(temporary, path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tools.require("prometheus", "prometheus-alertmanager")
    tmp = tmp_path_factory.mktemp("webconfig")
    prometheus_port, alertmanager_port = _free_port(), _free_port()
    cluster = loopback_cluster(prometheus_port, alertmanager_port)
    context = webconfig.salt_context("loopback")
    _write(tmp / "web.yml", webconfig.web_config(webconfig.password_hash(PASSWORD, context)))
    _write(tmp / "password", PASSWORD)
    (tmp / "rules.yml").write_text("groups: []\n")
    (tmp / "prometheus.yml").write_text(
        prometheus.prometheus_config(cluster, password_file=str(tmp / "password"))
    )
    (tmp / "alertmanager.yml").write_text(alertmanager.alertmanager_config(cluster))
    web = str(tmp / "web.yml")
    servers = (
        ("prometheus", "prometheus", prometheus.prometheus_args, "prometheus.yml", "tsdb"),
        ("alertmanager", "prometheus-alertmanager", alertmanager.alertmanager_args, "alertmanager.yml", "am"),
    )
    commands = {
        name: [
            program,
            *args(cluster, config_path=str(tmp / config), data_path=str(tmp / data), web_config_path=web),
        ]
        for name, program, args, config, data in servers
    }
    running = {}
    for name, argv in commands.items():
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        running[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    urls = {
        "prometheus": f"http://127.0.0.1:{prometheus_port}",
        "alertmanager": f"http://127.0.0.1:{alertmanager_port}",
    }
    try:
        for name, url in urls.items():
            wait_until(
                lambda url=url: _request(f"{url}/-/ready", password=PASSWORD)[0] == 200,
                what=f"{name} ready",
                timeout=60,
                interval=0.3,
            )
        yield {"tmp": tmp, "urls": urls, "processes": running, "context": context}
    finally:
        for process in running.values():
            process.terminate()
        for process in running.values():
            process.wait(timeout=20)


def _up(servers, password: str, after: float = 0.0) -> dict[str, str]:
    """`up` by job, of scrapes made after `after` (a Unix time)."""
    query = urllib.parse.quote(f"up and timestamp(up) > {after}")
    status, body = _request(f"{servers['urls']['prometheus']}/api/v1/query?query={query}", password=password)
    assert status == 200, body
    return {sample["metric"]["job"]: sample["value"][1] for sample in json.loads(body)["data"]["result"]}


ROUTES = {
    "prometheus": ("/-/healthy", "/-/ready", "/api/v1/query?query=up", "/metrics"),
    "alertmanager": ("/-/healthy", "/-/ready", "/api/v2/silences", "/api/v2/status"),
}


@pytest.mark.parametrize("server", ROUTES)
def test_without_credentials_every_route_answers_401(servers, server):
    base = servers["urls"][server]
    for route in ROUTES[server]:
        assert _request(base + route)[0] == 401, route
        assert _request(base + route, password="not-the-password")[0] == 401, route
        assert _request(base + route, password=PASSWORD)[0] == 200, route


def _silence(comment: str) -> bytes:
    return json.dumps(
        {
            "matchers": [{"name": "alertname", "value": "QwenReplicaDown", "isRegex": False}],
            "startsAt": "2026-01-01T00:00:00Z",
            "endsAt": "2099-01-01T00:00:00Z",
            "createdBy": "test",
            "comment": comment,
        }
    ).encode()


def test_nobody_without_credentials_can_silence_an_alert(servers):
    url = f"{servers['urls']['alertmanager']}/api/v2/silences"
    assert _request(url, method="POST", body=_silence("hide it"))[0] == 401
    status, body = _request(url, password=PASSWORD)
    assert status == 200 and not [s for s in json.loads(body) if s["comment"] == "hide it"]


def test_prometheus_scrapes_itself_and_alertmanager_with_the_password(servers):
    up = wait_until(
        lambda: _up(servers, PASSWORD),
        what="Prometheus's own scrapes up",
        timeout=30,
        interval=0.5,
        done=lambda up: up.get("prometheus") == "1" and up.get("alertmanager") == "1",
    )
    assert up["prometheus"] == up["alertmanager"] == "1"


def test_a_new_password_takes_effect_without_a_restart_and_alertmanager_keeps_its_silences(servers):
    silences = f"{servers['urls']['alertmanager']}/api/v2/silences"
    status, _ = _request(silences, password=PASSWORD, method="POST", body=_silence("kept across rotation"))
    assert status == 200
    pids = {name: process.pid for name, process in servers["processes"].items()}

    tmp = servers["tmp"]
    rotated_at = time.time()
    _write(tmp / "web.yml", webconfig.web_config(webconfig.password_hash(ROTATED, servers["context"])))
    _write(tmp / "password", ROTATED)

    for url in servers["urls"].values():
        assert _request(f"{url}/-/healthy", password=PASSWORD)[0] == 401
        assert _request(f"{url}/-/healthy", password=ROTATED)[0] == 200
    status, body = _request(silences, password=ROTATED)
    assert status == 200 and [s for s in json.loads(body) if s["comment"] == "kept across rotation"]
    # Prometheus reads the new password from its file at the next scrape: no reload.
    fresh = wait_until(
        lambda: _up(servers, ROTATED, after=rotated_at),
        what="scrapes of Prometheus and Alertmanager after the rotation",
        timeout=30,
        interval=0.5,
        done=lambda up: "prometheus" in up and "alertmanager" in up,
    )
    assert (fresh["prometheus"], fresh["alertmanager"]) == ("1", "1")
    assert {name: process.pid for name, process in servers["processes"].items()} == pids
    assert all(process.poll() is None for process in servers["processes"].values())


def test_doctor_logs_in_with_the_password_and_says_what_is_missing_without_it(servers):
    from tooling import doctor

    url = servers["urls"]["prometheus"]
    with pytest.raises(doctor.Unreachable, match=f"HTTP 401.*{doctor.PASSWORD_ENV}"):
        doctor.http_fetch(url, password=None)("/api/v1/rules")
    password = ROTATED if _request(f"{url}/-/healthy", password=ROTATED)[0] == 200 else PASSWORD
    assert doctor.http_fetch(url, password=password)("/api/v1/rules") == {"groups": []}
