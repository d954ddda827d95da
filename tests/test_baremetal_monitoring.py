"""Monitoring on bare metal, as the program registers it (offline render under mocks), and
what a day-2 change does to it (tooling/changes/)."""

from __future__ import annotations

import functools

import pytest

from qwen_cluster.render.monitoring import containers as monitoring_containers
from tests.helpers.configs import open_monitoring
from tests.helpers.secrets import plain
from tooling import changes, offline, stackfile

CONTAINER = "docker:index/container:Container"


@pytest.fixture(scope="module")
def onprem() -> offline.Render:
    render = offline.render(stackfile.read("onprem"), "onprem")
    assert render.error is None, render.error
    return render


def containers(render: offline.Render) -> dict[str, dict]:
    return {r.name: r.inputs for r in render.of_type(CONTAINER)}


def test_every_node_runs_its_endpoint_and_exporters_pinned_on_host_networking(onprem):
    found = containers(onprem)
    for node in ("master", "worker-1", "worker-2", "worker-3"):
        for role in ("node-exporter", "blackbox-exporter", "dcgm-exporter", "nodemetrics"):
            inputs = found[f"{node}-monitoring-{role}"]
            assert inputs["networkMode"] == "host"
            assert inputs["restart"] == "unless-stopped"
    images = {r.inputs["name"] for r in onprem.of_type("docker:index/remoteImage:RemoteImage")}
    assert {
        monitoring_containers.PROMETHEUS_IMAGE,
        monitoring_containers.NODE_EXPORTER_IMAGE,
        monitoring_containers.DCGM_EXPORTER_IMAGE,
    } <= images
    assert all(":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest") for image in images)


def test_exporters_bind_loopback_the_endpoint_the_node_address_and_the_gpu_exporter_gets_the_gpus(onprem):
    found = containers(onprem)
    assert "--web.listen-address=127.0.0.1:9100" in found["worker-1-monitoring-node-exporter"]["command"]
    assert "--web.listen-address=127.0.0.1:9115" in found["worker-1-monitoring-blackbox-exporter"]["command"]
    dcgm = found["worker-1-monitoring-dcgm-exporter"]
    assert dcgm["gpus"] == "all" and "127.0.0.1:9400" in dcgm["command"]
    uploads = {u["file"]: u["content"] for u in found["worker-1-monitoring-nodemetrics"]["uploads"]}
    config = next(text for name, text in uploads.items() if name.endswith(".json"))
    assert '"listen": "192.168.1.101:8000"' in config and '"node": "worker-1"' in config


def test_prometheus_and_alertmanager_run_on_the_monitoring_node_only(onprem):
    found = containers(onprem)
    assert {name for name in found if name.startswith("monitoring-")} == {
        "monitoring-prometheus",
        "monitoring-alertmanager",
    }
    providers = {r.name: r.provider for r in onprem.of_type(CONTAINER)}
    assert providers["monitoring-prometheus"] == providers["master-model-vllm"]
    assert "--web.listen-address=192.168.1.100:9090" in found["monitoring-prometheus"]["command"]
    assert "--web.listen-address=192.168.1.100:9093" in found["monitoring-alertmanager"]["command"]
    assert "--cluster.listen-address=" in found["monitoring-alertmanager"]["command"]
    assert onprem.outputs["prometheus"] == "https://192.168.1.100:9090"  # the offline TLS pair
    assert onprem.outputs["monitoringEndpoints"]["worker-2"] == "http://192.168.1.102:8000/metrics"


def test_prometheus_has_no_http_lifecycle_api(onprem):
    """Without --web.enable-lifecycle, POST /-/quit and /-/reload answer 403: reload is by SIGHUP."""
    command = containers(onprem)["monitoring-prometheus"]["command"]
    assert not [flag for flag in command if "lifecycle" in flag]
    script = plain(onprem.named("monitoring-config").inputs["create"])  # a secret: it writes the password
    assert "docker kill --signal HUP" in script and "/-/reload" not in script


def _diff(onprem: offline.Render, *edits: str) -> list[changes.Change]:
    new = offline.render(changes.apply_changes(stackfile.read("onprem"), list(edits)), "onprem")
    assert new.error is None, new.error
    return [change for change in changes.diff(onprem, new) if change.action != "same"]


def test_a_new_alert_bound_reloads_prometheus_and_restarts_nothing(onprem):
    moved = _diff(onprem, "monitoring.maxRequestsWaiting=80", "monitoring.maxTtftP99Seconds=20")
    assert [(c.type, c.name, c.action) for c in moved] == [
        ("command:remote:Command", "monitoring-config", "update")
    ]


def test_monitoring_off_leaves_the_model_servers_alone(onprem):
    moved = _diff(onprem, 'monitoring={"exporters": false, "prometheus": false}')
    assert moved and {c.action for c in moved} == {"delete", "update"}
    assert not [c for c in moved if "model" in c.name or "load-balancer" in c.name]
    # The one update: the monitoring node's firewall stops admitting Prometheus and Alertmanager,
    # which no longer run anywhere.
    assert [(c.name, c.keys) for c in moved if c.action == "update"] == [("master-firewall", ["create"])]


def test_the_lab_has_a_stand_in_for_every_monitoring_container_serving_its_ports(onprem):
    from labkit.images import standins

    served = {}
    for resource in onprem.of_type(CONTAINER):
        if resource.name.startswith(("master-monitoring-", "monitoring-")):
            container = standins.Container.from_inputs(resource.name, resource.inputs)
            served[container.name] = (standins.stand_in_for(container).kind, standins.serves(container))
    assert served == {
        "qwen-node-exporter": ("node-exporter", [9100]),
        "qwen-blackbox-exporter": ("blackbox-exporter", [9115]),
        "qwen-dcgm-exporter": ("dcgm-exporter", [9400]),
        "qwen-nodemetrics": ("nodemetrics", [8000]),
        "qwen-prometheus": ("prometheus", [9090]),
        "qwen-alertmanager": ("alertmanager", [9093]),
    }


# --- credentials (monitoring.password) and TLS (monitoring.tls) --------------------------------------

MONITORING_PASSWORD = "a-monitoring-password-for-the-test-0123"
MONITORING_IP = "192.168.1.100"  # onprem's master, monitoring.node by default


def _with_password(password: str = MONITORING_PASSWORD, serial: int = 1):
    return _rendered(password, serial)


@functools.lru_cache(maxsize=4)
def _rendered(password: str, serial: int, again: int = 0):
    """Each render once (~6 s); `again` renders the same config anew."""
    from tests.helpers.monitoring_tls import issue, with_monitoring
    from tooling import offline, stackfile

    stack_config = with_monitoring(stackfile.read("onprem"), issue(MONITORING_IP, serial), password)
    return offline.render(stack_config, "onprem")


def _secret_value(value):
    from tests.helpers.secrets import SECRET_SIG

    assert isinstance(value, dict) and SECRET_SIG in value, "not a secret"
    return value["value"]


def _heredoc(script: str, name: str) -> str:
    marker = f"QWEN_{name.upper().replace('.', '_')}_EOF"
    return script.split(f"<<'{marker}'\n", 1)[1].split(f"\n{marker}", 1)[0]


def test_with_a_password_prometheus_and_alertmanager_read_a_web_config_with_its_hash_and_tls():
    import bcrypt
    import yaml

    from qwen_cluster.render.monitoring import webconfig
    from tests.helpers.monitoring_tls import issue
    from tests.helpers.secrets import shown_in_clear

    render = _with_password()
    assert render.error is None, render.error
    servers = {c.inputs["name"]: c.inputs for c in render.of_type(CONTAINER)}
    for name in ("qwen-prometheus", "qwen-alertmanager"):
        assert "--web.config.file=/etc/qwen-monitoring/web-tls.yml" in servers[name]["command"], name
    (files,) = [c for c in render.of_type("command:remote:Command") if c.name == "monitoring-config"]
    script = _secret_value(files.inputs["create"])
    web = yaml.safe_load(_heredoc(script, "web-tls.yml"))
    hashed = web["basic_auth_users"][webconfig.USER]
    assert bcrypt.checkpw(MONITORING_PASSWORD.encode(), hashed.encode())
    assert web["tls_server_config"] == {
        "cert_file": "/etc/qwen-monitoring/tls.pem",
        "key_file": "/etc/qwen-monitoring/tls.pem",
        "min_version": "TLS12",
        "cipher_suites": webconfig.cipher_suites(),
    }
    pki = issue(MONITORING_IP)
    assert _heredoc(script, "tls.pem") == pki.certificate.strip() + "\n" + pki.private_key.strip()
    assert _heredoc(script, "ca.pem") == pki.ca_certificate.strip()
    assert "chmod 0640" in script and "password_file: /etc/qwen-monitoring/password" in script
    prometheus = yaml.safe_load(_heredoc(script, "prometheus.yml"))
    tls_client = {"scheme": "https", "tls_config": {"ca_file": "/etc/qwen-monitoring/ca.pem"}}
    for job in prometheus["scrape_configs"][1:]:
        assert tls_client.items() <= job.items(), job
    assert tls_client.items() <= prometheus["alerting"]["alertmanagers"][0].items()
    assert "scheme" not in prometheus["scrape_configs"][0]  # the nodes' endpoints stay plain
    for secret in (MONITORING_PASSWORD, pki.private_key.splitlines()[1]):
        assert shown_in_clear(render.resources, secret) == []
    assert render.outputs["prometheus"] == f"https://{MONITORING_IP}:9090"
    assert render.outputs["alertmanager"] == f"https://{MONITORING_IP}:9093"


def test_a_password_without_tls_is_refused_naming_the_key():
    from tooling import offline, stackfile

    stack_config = stackfile.read("onprem", offline_keys=False)
    key = "qwen-cluster:monitoring"
    stack_config[key] = {**(stack_config.get(key) or {}), "password": {"secure": MONITORING_PASSWORD}}
    render = offline.render(stack_config, "onprem")
    assert render.error is not None and "monitoring.password is set without monitoring.tls" in str(
        render.error
    )
    assert "monitoring.tls.certificate" in str(render.error)


def test_the_same_secrets_render_the_same_step_and_new_ones_another():
    def script(password, serial=1):
        render = _with_password(password, serial)
        (files,) = [c for c in render.of_type("command:remote:Command") if c.name == "monitoring-config"]
        return _secret_value(files.inputs["create"])

    first = script(MONITORING_PASSWORD)
    (again,) = [c for c in _rendered(MONITORING_PASSWORD, 1, again=1).of_type("command:remote:Command")
                if c.name == "monitoring-config"]  # fmt: skip
    assert _secret_value(again.inputs["create"]) == first
    assert script(MONITORING_PASSWORD + "-rotated") != first
    assert script(MONITORING_PASSWORD, serial=2) != first


def test_a_new_certificate_rewrites_the_files_step_only():
    """exporter-toolkit reads the certificate again on every connection (webconfig.py): a new
    one is the files step's in-place update, no container replaced."""
    before, after = _with_password(), _with_password(serial=2)
    moved = {c.name: c.action for c in changes.diff(before, after) if c.action != "same"}
    assert moved == {"monitoring-config": "update"}


def test_turning_tls_on_starts_prometheus_and_alertmanager_again_and_nothing_else(opened):
    """exporter-toolkit chooses HTTP or HTTPS when a server starts: the web config's name is in
    their command lines, so turning TLS on replaces the two containers (their data is on the host)."""
    after = _with_password()
    moved = {c.name: c.action for c in changes.diff(opened, after) if c.action != "same"}
    assert set(moved) == {"monitoring-config", "monitoring-prometheus", "monitoring-alertmanager"}, moved
    assert moved["monitoring-config"] == "update"


@pytest.fixture(scope="module")
def opened() -> offline.Render:
    """onprem open on purpose: no password, no TLS."""
    render = offline.render(open_monitoring(stackfile.read("onprem")), "onprem")
    assert render.error is None, render.error
    return render


def test_without_a_password_nothing_asks_for_credentials(opened):
    servers = {c.inputs["name"]: c.inputs for c in opened.of_type(CONTAINER)}
    assert not [arg for arg in servers["qwen-prometheus"]["command"] if "web.config" in arg]
