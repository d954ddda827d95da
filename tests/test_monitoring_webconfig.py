"""Prometheus and Alertmanager behind the rendered web config: Debian's prometheus and
prometheus-alertmanager for real, on loopback, with the rendered configs and command lines.
They speak TLS only (1.2 and 1.3, the endpoint's ciphers); without credentials they answer 401
(their health probes too); Prometheus logs in to itself and to Alertmanager over https, verifying
the CA; a new password and a new certificate take effect without a restart, and Alertmanager
keeps its silences."""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml

from labkit.cluster import probes
from qwen_cluster import config
from qwen_cluster.render import nginx
from qwen_cluster.render.monitoring import alertmanager, containers, prometheus, webconfig
from tests.helpers import tools
from tests.helpers.monitoring_tls import issue
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
            # Its files are written by the tests themselves (password, TLS): the config renders the
            # servers' own config and command lines only.
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


def test_the_web_config_serves_tls_12_and_up_with_the_endpoints_ciphers_from_one_file():
    rendered = yaml.safe_load(webconfig.web_config(None, tls_file="/etc/qwen-monitoring/tls.pem"))
    assert rendered == {
        "tls_server_config": {
            "cert_file": "/etc/qwen-monitoring/tls.pem",
            "key_file": "/etc/qwen-monitoring/tls.pem",
            "min_version": "TLS12",
            "cipher_suites": [
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
                "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
                "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
                "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
                "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
                "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
            ],
        }
    }
    # One list for the endpoint and the monitoring servers: every nginx suite has its Go name.
    assert len(webconfig.cipher_suites()) == len(nginx.TLS_CIPHERS.split(":"))


def test_prometheus_reaches_itself_and_alertmanager_over_https_verifying_the_ca():
    rendered = yaml.safe_load(
        prometheus.prometheus_config(loopback_cluster(), password_file="/etc/pw", ca_file="/etc/ca.pem")
    )
    client = {"scheme": "https", "tls_config": {"ca_file": "/etc/ca.pem"}}
    jobs = {job["job_name"]: job for job in rendered["scrape_configs"]}
    for name in ("prometheus", "alertmanager"):
        assert client.items() <= jobs[name].items(), name
    assert client.items() <= rendered["alerting"]["alertmanagers"][0].items()
    assert "scheme" not in jobs[prometheus.JOB]  # the nodes' endpoints (8000) stay plain HTTP


def test_prometheus_logs_in_to_itself_and_alertmanager_but_not_to_the_open_node_endpoints():
    rendered = yaml.safe_load(prometheus.prometheus_config(loopback_cluster(), password_file="/etc/pw"))
    login = {"username": webconfig.USER, "password_file": "/etc/pw"}
    jobs = {job["job_name"]: job.get("basic_auth") for job in rendered["scrape_configs"]}
    assert jobs == {prometheus.JOB: None, "prometheus": login, "alertmanager": login}
    assert rendered["alerting"]["alertmanagers"][0]["basic_auth"] == login
    assert "basic_auth" not in str(yaml.safe_load(prometheus.prometheus_config(loopback_cluster())))


# --- Debian's servers, for real -------------------------------------------------------------------


# The CA the servers' certificate comes from now (a rotation test changes it): what the clients trust.
CA: dict[str, str] = {}


def _request(
    url: str,
    *,
    password: str | None = None,
    method: str = "GET",
    body: bytes | None = None,
    ca: str | None = None,
):
    """Over https, verifying the server against `ca` (default: the CA in use) alone."""
    context = ssl.create_default_context(cadata=ca or CA.get("pem"))
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if password is not None:
        token = base64.b64encode(f"{webconfig.USER}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
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
    pki = issue("127.0.0.1")
    tls_file = str(tmp / containers.TLS_FILE)
    _write(
        tmp / "web.yml", webconfig.web_config(webconfig.password_hash(PASSWORD, context), tls_file=tls_file)
    )
    _write(tmp / containers.TLS_FILE, containers.tls_pem(pki.certificate, pki.private_key))
    _write(tmp / containers.CA_FILE, pki.ca_certificate)
    _write(tmp / "password", PASSWORD)
    (tmp / "rules.yml").write_text("groups: []\n")
    (tmp / "prometheus.yml").write_text(
        prometheus.prometheus_config(
            cluster, password_file=str(tmp / "password"), ca_file=str(tmp / containers.CA_FILE)
        )
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
        "prometheus": f"https://127.0.0.1:{prometheus_port}",
        "alertmanager": f"https://127.0.0.1:{alertmanager_port}",
    }
    CA["pem"] = pki.ca_certificate
    try:
        for name, url in urls.items():
            wait_until(
                lambda url=url: _request(f"{url}/-/ready", password=PASSWORD)[0] == 200,
                what=f"{name} ready",
                timeout=60,
                interval=0.3,
            )
        ports = {"prometheus": prometheus_port, "alertmanager": alertmanager_port}
        yield {"tmp": tmp, "urls": urls, "ports": ports, "processes": running, "context": context}
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
    tls_file = str(tmp / containers.TLS_FILE)
    hashed = webconfig.password_hash(ROTATED, servers["context"])
    _write(tmp / "web.yml", webconfig.web_config(hashed, tls_file=tls_file))
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


def _current_password(url: str) -> str:
    return ROTATED if _request(f"{url}/-/healthy", password=ROTATED)[0] == 200 else PASSWORD


def test_doctor_logs_in_with_the_password_and_says_what_is_missing_without_it(servers):
    from tooling import doctor

    url = servers["urls"]["prometheus"]
    with pytest.raises(doctor.Unreachable, match=f"HTTP 401.*{doctor.PASSWORD_ENV}"):
        doctor.http_fetch(url, password=None, ca_certificate=CA["pem"])("/api/v1/rules")
    password = _current_password(url)
    assert doctor.http_fetch(url, password=password, ca_certificate=CA["pem"])("/api/v1/rules") == {
        "groups": []
    }
    # Another CA's certificate is refused, and doctor says which key holds the CA it trusts.
    with pytest.raises(doctor.Unreachable, match="not one monitoring.tls.caCertificate issued"):
        doctor.http_fetch(url, password=password, ca_certificate=issue("127.0.0.1", 99).ca_certificate)(
            "/api/v1/rules"
        )


# --- TLS only -------------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ROUTES)
def test_a_plain_http_request_gets_nothing_but_go_s_refusal(servers, server):
    """Go's server answers a plain-HTTP request on a TLS listener with a fixed 400 and closes
    (net/http server.go, "Client sent an HTTP request to an HTTPS server"): no route, no data,
    no authentication challenge."""
    connection = http.client.HTTPConnection("127.0.0.1", servers["ports"][server], timeout=5)
    try:
        connection.request("GET", ROUTES[server][2])
        reply = connection.getresponse()
        status, body = reply.status, reply.read()
    finally:
        connection.close()
    assert status == 400 and b"HTTP request to an HTTPS server" in body, (status, body)


@pytest.mark.parametrize("server", ROUTES)
def test_tls_1_0_and_1_1_are_refused_and_1_2_and_1_3_accepted(servers, server):
    port = servers["ports"][server]
    accepted = {
        version: probes.tls_handshake("127.0.0.1", port, version).accepted for version in probes.TLS_VERSIONS
    }
    assert accepted == {"TLSv1": False, "TLSv1.1": False, "TLSv1.2": True, "TLSv1.3": True}


@pytest.mark.parametrize("server", ROUTES)
def test_tls_1_2_without_forward_secrecy_or_aead_is_refused(servers, server):
    """Only the endpoint's suites: a client offering CBC (ECDHE-ECDSA-AES128-SHA) or no forward
    secrecy (AES128-GCM-SHA256) alone finds no common cipher; one of the list is accepted."""

    def handshake(cipher: str) -> bool:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(f"{cipher}:@SECLEVEL=0")
        try:
            address = ("127.0.0.1", servers["ports"][server])
            with socket.create_connection(address, timeout=5) as raw, context.wrap_socket(raw):
                return True
        except ssl.SSLError:
            return False

    assert not handshake("ECDHE-ECDSA-AES128-SHA")
    assert not handshake("AES128-GCM-SHA256")
    assert handshake("ECDHE-ECDSA-AES128-GCM-SHA256")


def _served_certificate(port: int) -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        return tls.getpeercert(binary_form=True)


def test_a_new_certificate_is_served_on_the_next_connection_without_a_restart(servers):
    """A rotation to a certificate of a new CA: the servers present it on the next connection
    (exporter-toolkit reads the pair on every handshake), Prometheus trusts the new CA file at
    its next scrape (prometheus/common re-reads a changed CA file), Alertmanager keeps its silences,
    and no process is started again."""
    from cryptography import x509

    silences = f"{servers['urls']['alertmanager']}/api/v2/silences"
    password = _current_password(servers["urls"]["prometheus"])
    status, _ = _request(
        silences, password=password, method="POST", body=_silence("kept across a new certificate")
    )
    assert status == 200
    pids = {name: process.pid for name, process in servers["processes"].items()}

    tmp, rotated = servers["tmp"], issue("127.0.0.1", serial=2)
    rotated_at = time.time()
    _write(tmp / containers.TLS_FILE, containers.tls_pem(rotated.certificate, rotated.private_key))
    _write(tmp / containers.CA_FILE, rotated.ca_certificate)
    old_ca, CA["pem"] = CA["pem"], rotated.ca_certificate

    for name, port in servers["ports"].items():
        served = x509.load_der_x509_certificate(_served_certificate(port))
        assert served.serial_number == 1002, name  # tests/helpers/monitoring_tls.py: serial + 1000
        assert _request(f"{servers['urls'][name]}/-/healthy", password=password)[0] == 200
        assert _request(f"{servers['urls'][name]}/-/healthy", password=password, ca=old_ca)[0] == 0
    status, body = _request(silences, password=password)
    assert status == 200 and [s for s in json.loads(body) if s["comment"] == "kept across a new certificate"]
    fresh = wait_until(
        lambda: _up(servers, password, after=rotated_at),
        what="scrapes of Prometheus and Alertmanager over https after the new certificate",
        timeout=30,
        interval=0.5,
        done=lambda up: "prometheus" in up and "alertmanager" in up,
    )
    assert (fresh["prometheus"], fresh["alertmanager"]) == ("1", "1")
    assert {name: process.pid for name, process in servers["processes"].items()} == pids
    assert all(process.poll() is None for process in servers["processes"].values())
