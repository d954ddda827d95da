"""The node's :8000 endpoint (qwen_cluster/node/nodemetrics.py): merged sources, one health metric per
source, output that Prometheus's text format parsers accept."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from qwen_cluster.node import nodemetrics
from qwen_cluster.render.monitoring import endpoint as monitoring_endpoint
from tests.helpers import tools
from tests.helpers.http_thread import in_thread
from tests.helpers.wait import wait_until
from tooling import stackfile

VLLM_TEXT = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-32B"} 3.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-32B"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-32B"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-32B"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-32B"} 4.5
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""
NODE_TEXT = """\
# HELP node_network_speed_bytes speed_bytes value of /sys/class/net/<iface>.
# TYPE node_network_speed_bytes gauge
node_network_speed_bytes{device="eth0"} 1.25e+09
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 3.25
"""
PROBE_TEXT = """\
# HELP probe_success Displays whether or not the probe was a success
# TYPE probe_success gauge
probe_success 1
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def fake_exporter(routes: dict[str, str]) -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = routes.get(self.path.split("?", 1)[0])
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    with in_thread(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as port:
        yield port


@contextlib.contextmanager
def endpoint(config: dict) -> Iterator[str]:
    with in_thread(nodemetrics.serve({**config, "listen": "127.0.0.1:0"})) as port:
        yield f"http://127.0.0.1:{port}"


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> list:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def test_merges_sources_labels_each_and_reports_each_sources_health():
    with fake_exporter({"/metrics": NODE_TEXT}) as node, fake_exporter({"/metrics": VLLM_TEXT}) as vllm:
        config = {
            "node": "master",
            "node_ip": "127.0.0.1",
            "timeout": 1.0,
            "sources": [
                {"name": "node", "url": f"http://127.0.0.1:{node}/metrics"},
                {"name": "vllm", "url": f"http://127.0.0.1:{vllm}/metrics"},
                {"name": "gpu", "url": f"http://127.0.0.1:{free_port()}/metrics"},  # nothing listens
            ],
        }
        with endpoint(config) as url:
            text = get(f"{url}/metrics")
    found = samples(text)
    up = {s.labels["qwen_source"]: s.value for s in found if s.name == "qwen_source_up"}
    assert up == {"node": 1, "vllm": 1, "gpu": 0}
    # Both sources export process_cpu_seconds_total: kept apart by qwen_source.
    cpu = {s.labels["qwen_source"]: s.value for s in found if s.name == "process_cpu_seconds_total"}
    assert cpu == {"node": 3.25, "vllm": 12.5}
    waiting = next(s for s in found if s.name == "vllm:num_requests_waiting")
    assert waiting.labels == {"qwen_source": "vllm", "engine": "0", "model_name": "Qwen/Qwen3-32B"}
    buckets = [s for s in found if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert [b.labels["le"] for b in buckets] == ["1.0", "+Inf"]
    nic = next(s for s in found if s.name == "qwen_node_nic_info")
    assert nic.labels["device"] == "lo" and nic.labels["address"] == "127.0.0.1"


def test_each_probe_is_labelled_with_its_peer_and_a_silent_blackbox_is_a_source_down():
    with fake_exporter({"/probe": PROBE_TEXT}) as blackbox:
        probes = [
            {
                "url": f"http://127.0.0.1:{blackbox}/probe?module=icmp&target=10.0.0.2",
                "labels": {"peer": "worker-1", "peer_ip": "10.0.0.2", "module": "icmp"},
            },
            {
                "url": f"http://127.0.0.1:{blackbox}/probe?module=tcp_connect&target=10.0.0.3:5000",
                "labels": {
                    "peer": "worker-2",
                    "peer_ip": "10.0.0.3",
                    "module": "tcp_connect",
                    "port": "5000",
                },
            },
        ]
        with endpoint({"node": "master", "timeout": 1.0, "probes": probes}) as url:
            found = samples(get(f"{url}/metrics"))
    success = {(s.labels["peer"], s.labels["module"]): s.value for s in found if s.name == "probe_success"}
    assert success == {("worker-1", "icmp"): 1, ("worker-2", "tcp_connect"): 1}
    assert next(s.value for s in found if s.name == "qwen_source_up") == 1

    dead = [{**probe, "url": f"http://127.0.0.1:{free_port()}/probe"} for probe in probes]
    with endpoint({"node": "master", "timeout": 0.5, "probes": dead}) as url:
        found = samples(get(f"{url}/metrics"))
    assert not [s for s in found if s.name == "probe_success"]  # no false "peer unreachable"
    assert next(s.value for s in found if s.name == "qwen_source_up") == 0


def test_label_values_with_braces_and_quotes_survive():
    text = '# TYPE odd gauge\nodd{path="/a}b",quote="say \\"hi\\""} 1\n'
    merger = nodemetrics.Merger()
    merger.add_text(text, {"qwen_source": "x"})
    (sample,) = samples(merger.text())
    assert sample.labels == {"qwen_source": "x", "path": "/a}b", "quote": 'say "hi"'}


def test_a_slow_source_does_not_hold_the_scrape_past_its_timeout():
    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            time.sleep(3)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = {
            "timeout": 0.3,
            "sources": [{"name": "node", "url": f"http://127.0.0.1:{server.server_address[1]}/"}],
        }
        with endpoint(config) as url:
            started = time.monotonic()
            found = samples(get(f"{url}/metrics"))
            took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert took < 2
    assert next(s.value for s in found if s.name == "qwen_source_up") == 0


@tools.needs("prometheus-node-exporter", "prometheus-blackbox-exporter")
def test_with_the_real_node_and_blackbox_exporters(tmp_path: Path):
    """Debian's node_exporter and blackbox_exporter behind the endpoint, as rendered."""
    cluster = stackfile.load("onprem")
    node_port, blackbox_port = free_port(), free_port()
    blackbox_config = tmp_path / "blackbox.yml"
    blackbox_config.write_text(monitoring_endpoint.blackbox_config(cluster))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    open_port = listener.getsockname()[1]
    processes = [
        subprocess.Popen(
            ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{node_port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                "prometheus-blackbox-exporter",
                f"--config.file={blackbox_config}",
                f"--web.listen-address=127.0.0.1:{blackbox_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        base = f"http://127.0.0.1:{blackbox_port}/probe?"
        config = {
            "node": "master",
            "node_ip": "127.0.0.1",
            "timeout": 2.0,
            "sources": [{"name": "node", "url": f"http://127.0.0.1:{node_port}/metrics"}],
            "probes": [
                {
                    "url": base + f"module=tcp_connect&target=127.0.0.1:{open_port}",
                    "labels": {"peer": "self", "module": "tcp_connect", "port": str(open_port)},
                },
                {
                    "url": base + f"module=tcp_connect&target=127.0.0.1:{free_port()}",
                    "labels": {"peer": "self", "module": "tcp_connect", "port": "closed"},
                },
            ],
        }
        with endpoint(config) as url:

            def scrape() -> tuple[dict[str, float], list]:
                found = samples(get(f"{url}/metrics"))
                return {s.labels["qwen_source"]: s.value for s in found if s.name == "qwen_source_up"}, found

            up, found = wait_until(
                scrape,
                what="both exporters up behind the endpoint",
                timeout=15,
                interval=0.2,
                done=lambda answer: answer[0] == {"node": 1, "probe": 1},
            )
    finally:
        for process in processes:
            process.kill()
            process.wait()
        listener.close()
    assert up == {"node": 1, "probe": 1}
    assert any(s.name == "node_network_speed_bytes" or s.name.startswith("node_cpu") for s in found)
    tcp = {s.labels["port"]: s.value for s in found if s.name == "probe_success"}
    assert tcp == {str(open_port): 1, "closed": 0}
