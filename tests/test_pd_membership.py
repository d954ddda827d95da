"""P/D mode's run-time membership, with the real parts: vLLM's router (the 0.1.17 wheel) in P/D
mode reaching stand-in workers through nginx's worker listeners (render/nginx.py), and the
rollout's rendered drain and ready scripts (render/rollout.py) taking a prefill replica out of
the router's choice and back, where 0.1.17's admin routes cannot add a P/D worker back."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from labkit.models import router as router_venv
from qwen_cluster.render import nginx, rollout, router
from tests.helpers import tools
from tests.helpers.http_thread import in_thread
from tests.helpers.standin_server import free_port
from tests.helpers.wait import wait_until

pytestmark = [tools.needs("nginx"), tools.needs("ss")]

ALIASES = ("127.1.0.1", "127.1.0.2", "127.1.0.3")  # prefill, prefill, decode
# The router's health checks every second here (the program's: router.HEALTH_CHECK_INTERVAL_SECONDS),
# so that its three failures and two passes take seconds.
INTERVAL = 1


class Worker(http.server.BaseHTTPRequestHandler):
    """A stand-in vLLM: /health 200, and a completion whose kv_transfer_params the router passes on."""

    protocol_version = "HTTP/1.1"

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send(200, b'{"object":"list","data":[{"id":"m","object":"model"}]}')

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.hits += 1
        body = {
            "id": "x",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1},
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        self._send(200, json.dumps(body).encode())

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        pass


@contextlib.contextmanager
def worker() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    server.hits = 0
    server.handle_error = lambda request, address: None  # the router's health client resets idle sockets
    with in_thread(server):
        yield server


def nginx_conf(directory: Path, servers: list[int], port: int) -> str:
    listeners = "".join(
        nginx.worker_listener(
            listen=f"{alias}:{port}",
            upstream=f"qwen_replica_{index}",
            server=("127.0.0.1", backend),
            marker=nginx.drain_marker(str(directory), "127.0.0.1") + f"-{backend}",
            idle_timeout_seconds=60,
        )
        for index, (alias, backend) in enumerate(zip(ALIASES, servers, strict=True))
    )
    # Workers as root: nginx's `if (-f marker)` runs in a worker, and pytest's directory is 0700
    # (the program's conf dir is 0755: `mkdir -p` under umask 022, nginx.install_script).
    return f"""user root;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {directory}/body;
    proxy_temp_path {directory}/proxy;
{listeners}}}
"""


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """Two prefill workers and one decode worker behind nginx's listeners, the router in P/D mode
    in front; yields (conf_dir, the workers, their URLs as the router names them, the router's URL)."""
    directory = tmp_path_factory.mktemp("pd")
    executable = router_venv.executable(router_venv.ensure_venv(log=lambda line: None))
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(worker()) for _ in ALIASES]
        port = free_port()
        backends = [w.server_address[1] for w in workers]
        (directory / "nginx.conf").write_text(nginx_conf(directory, backends, port))
        server = subprocess.Popen(
            ["nginx", "-p", f"{directory}/", "-c", str(directory / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        stack.callback(lambda: (server.terminate(), server.wait(timeout=10)))
        urls = [router.worker_url(alias, port) for alias in ALIASES]
        api, metrics = free_port(), free_port()
        argv = [
            str(executable), "--host", "127.0.0.1", "--port", str(api),
            "--vllm-pd-disaggregation", "--prefill", urls[0], "--prefill", urls[1], "--decode", urls[2],
            "--kv-connector", router.KV_CONNECTOR, "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--health-check-interval-secs", str(INTERVAL),
            "--health-failure-threshold", str(router.HEALTH_FAILURES),
            "--health-success-threshold", str(router.HEALTH_SUCCESSES),
            "--log-level", "warning",
        ]  # fmt: skip
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lambda: (process.terminate(), process.wait(timeout=10)))
        base = f"http://127.0.0.1:{api}"
        wait_until(lambda: _answers(f"{base}/health"), what="the router answering", timeout=60)
        (directory / nginx.ROUTER_FILE).write_text(router.address_line(("127.0.0.1", api)) + "\n")
        yield directory, workers, urls, base


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def complete(base: str) -> int:
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def run(text: str, marker: str) -> subprocess.CompletedProcess:
    # The test's nginx reads one marker per backend port (all stand-ins are on 127.0.0.1).
    text = text.replace(f"marker={marker.rsplit('-', 1)[0]}", f"marker={marker}")
    return subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=120)


def test_a_drained_prefill_replica_gets_no_request_until_its_ready_step(pd):
    directory, workers, urls, base = pd
    backend = workers[0].server_address[1]
    server = ("127.0.0.1", backend)
    marker = nginx.drain_marker(str(directory), "127.0.0.1") + f"-{backend}"
    drained = run(
        rollout.drain_script(
            server,
            replica="replica 0",
            drain_timeout_seconds=30,
            fingerprint="x",
            conf_dir=str(directory),
            pd_worker_url=urls[0],
        ),
        marker,
    )
    assert drained.returncode == 0, drained.stderr + drained.stdout
    assert f"router: {urls[0]} is unhealthy" in drained.stdout
    before = workers[0].hits
    assert [complete(base) for _ in range(4)] == [200] * 4
    assert workers[0].hits == before and workers[1].hits >= 4

    ready = run(
        rollout.ready_script(
            server,
            replica="replica 0",
            health_timeout_seconds=30,
            fingerprint="x",
            only_if_down=False,
            conf_dir=str(directory),
            pd_worker_url=urls[0],
        ),
        marker,
    )
    assert ready.returncode == 0, ready.stderr + ready.stdout
    assert f"router: {urls[0]} is healthy" in ready.stdout
    assert [complete(base) for _ in range(4)] == [200] * 4
    assert workers[0].hits > before
