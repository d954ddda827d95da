"""scripts/doctor.py against a fake Prometheus on loopback answering like its HTTP API."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from qwen_cluster.render.monitoring import alerts
from tooling import doctor, stackfile

ONPREM = stackfile.load("onprem")


def rules_answer(names: list[str] | None = None, health: str = "ok") -> dict:
    names = names if names is not None else [alert.name for alert in alerts.alerts(ONPREM)]
    rules = [
        {"name": name, "type": "alerting", "health": health, "state": "inactive", "query": "x"}
        for name in names
    ]
    return {"status": "success", "data": {"groups": [{"name": "qwen-cluster-alerts", "rules": rules}]}}


def alert(name: str, labels: dict[str, str], state: str = "firing", **annotations: str) -> dict:
    spec = next(a for a in alerts.alerts(ONPREM) if a.name == name)
    return {
        "labels": {"alertname": name, "severity": spec.severity, **labels},
        "annotations": {"summary": f"summary of {name}", "cause": spec.cause, "fix": "fix it", **annotations},
        "state": state,
        "activeAt": "2026-12-02T19:00:00Z",
        "value": "0e+00",
    }


def alerts_answer(*alerts: dict) -> dict:
    return {"status": "success", "data": {"alerts": list(alerts)}}


@contextlib.contextmanager
def fake_prometheus(routes: dict[str, object], status: int = 200) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(routes.get(self.path.split("?", 1)[0], {"status": "error"})).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run(capsys, url: str, *extra: str) -> tuple[int, str]:
    code = doctor.main(["onprem", "--prometheus", url, *extra])
    return code, capsys.readouterr().out


def test_healthy_cluster_exits_0(capsys):
    with fake_prometheus({"/api/v1/rules": rules_answer(), "/api/v1/alerts": alerts_answer()}) as url:
        code, out = run(capsys, url, "--json")
    assert code == 0
    assert json.loads(out) == {"healthy": True, "prometheus": url, "findings": [], "notes": []}


def test_a_cut_link_names_the_node_and_the_replica(capsys):
    firing = alerts_answer(
        alert(
            "QwenNodeUnreachable",
            {"node": "worker-2", "peer": "worker-2"},
            summary="node worker-2 does not answer ping from any other member",
        ),
        alert(
            "QwenReplicaDown",
            {"replica": "2", "replica_head": "worker-2"},
            summary="replica 2 (head worker-2) is not serving",
        ),
        # Pending: not yet a finding.
        alert("QwenNodeLatencyHigh", {"node": "master", "peer": "worker-1"}, state="pending"),
    )
    with fake_prometheus({"/api/v1/rules": rules_answer(), "/api/v1/alerts": firing}) as url:
        code, out = run(capsys, url, "--json")
    assert code == 1
    document = json.loads(out)
    assert document["healthy"] is False
    assert [(f["what"], f["where"]) for f in document["findings"]] == [
        ("node worker-2 does not answer ping from any other member", ["worker-2"]),
        ("replica 2 (head worker-2) is not serving", ["worker-2"]),
    ]
    assert all(
        set(f) == {"step", "check", "severity", "what", "where", "cause", "fix"} for f in document["findings"]
    )
    assert document["findings"][0]["severity"] == "critical"


def test_a_closed_port_names_both_nodes_in_the_guides_terms(capsys):
    labels = {
        "node": "master",
        "peer": "worker-1",
        "port": "5000",
        "port_name": "model-service",
        "peer_ip": "192.168.1.101",
    }
    firing = alerts_answer(
        alert(
            "QwenInterNodePortUnreachable",
            labels,
            summary="master cannot connect to worker-1 port 5000 (model-service)",
            cause="a firewall port closed between master and worker-1",
        )
    )
    with fake_prometheus({"/api/v1/rules": rules_answer(), "/api/v1/alerts": firing}) as url:
        code, out = run(capsys, url)
    assert code == 1
    assert "master cannot connect to worker-1 port 5000" in out
    assert "where: master, worker-1" in out
    assert "cause: a firewall port closed between master and worker-1" in out


def test_all_replicas_down_names_every_head(capsys):
    firing = alerts_answer(alert("QwenAllReplicasDown", {}))
    with fake_prometheus({"/api/v1/rules": rules_answer(), "/api/v1/alerts": firing}) as url:
        code, out = run(capsys, url, "--json")
    assert code == 1
    assert json.loads(out)["findings"][0]["where"] == ["master", "worker-1", "worker-2", "worker-3"]


def test_rules_not_loaded_is_a_finding(capsys):
    names = [alert.name for alert in alerts.alerts(ONPREM) if alert.name != "QwenGpuXidErrors"]
    with fake_prometheus({"/api/v1/rules": rules_answer(names), "/api/v1/alerts": alerts_answer()}) as url:
        code, out = run(capsys, url, "--json")
    assert code == 1
    (finding,) = json.loads(out)["findings"]
    assert "QwenGpuXidErrors" in finding["what"] and finding["where"] == ["master"]


def test_unreachable_prometheus_exits_2(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, out = run(capsys, f"http://127.0.0.1:{port}", "--json")
    assert code == 2
    assert json.loads(out)["healthy"] is False and "cannot ask Prometheus" in json.loads(out)["error"]


def test_an_answer_that_is_not_prometheus_exits_2(capsys):
    with fake_prometheus({"/api/v1/rules": rules_answer()}, status=500) as url:
        code, _ = run(capsys, url)
    assert code == 2


def test_without_a_url_it_asks_the_address_the_stack_gives_prometheus():
    # Offline, onprem has the throwaway password and TLS pair (tooling/stackfile.py): https.
    assert doctor.configured_url(ONPREM) == "https://192.168.1.100:9090"
    opened = {"qwen-cluster:monitoring": {"openToMonitoringCidrs": True}}
    assert doctor.configured_url(stackfile.validate({**stackfile.read("onprem"), **opened})) == (
        "http://192.168.1.100:9090"
    )


def test_with_monitoring_tls_it_asks_over_https_and_trusts_the_stacks_ca_alone():
    from tests.helpers.monitoring_tls import issue, with_monitoring

    pki = issue("192.168.1.100")
    cluster = stackfile.validate(
        with_monitoring(stackfile.read("onprem"), pki, "a-monitoring-password-0123456789")
    )
    assert doctor.configured_url(cluster) == "https://192.168.1.100:9090"
    assert doctor.monitoring_ca(cluster) == pki.ca_certificate
