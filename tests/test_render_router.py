"""vLLM's router as rendered: the balance thresholds, its command line, and the admin calls the
rollout makes (run against a loopback stand-in of the router's admin routes)."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import threading

import pytest

from qwen_cluster import ports
from qwen_cluster.config import validate
from qwen_cluster.render import router
from qwen_cluster.render.shell import script
from tests.helpers.baremetal import shellcheck


def cache_aware(raw: dict) -> dict:
    raw["loadBalancer"] = {"routing": "cache-aware"}
    return raw


@pytest.mark.parametrize(("replicas", "absolute"), [(1, 2), (2, 2), (3, 3), (4, 4), (16, 16)])
def test_balance_thresholds_fire_with_a_few_replicas(replicas, absolute):
    # The router's defaults (64, 1.5) need 64 more requests in flight on one worker.
    assert router.balance_thresholds(replicas) == (absolute, 1.25)


def test_balance_thresholds_refuse_no_replica():
    with pytest.raises(ValueError, match="replicas 0 must be at least 1"):
        router.balance_thresholds(0)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_bare_metal_router_binds_loopback_and_routes_to_every_head(bare_metal_raw):
    cluster = validate(cache_aware(bare_metal_raw))
    argv = router.command(cluster)
    assert argv[0] == "vllm-router"
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "30000"
    assert flag(argv, "--policy") == "cache_aware"
    heads = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    assert heads == [f"http://192.168.1.{100 + i}:5000" for i in range(4)]
    assert (flag(argv, "--balance-abs-threshold"), flag(argv, "--balance-rel-threshold")) == ("4", "1.25")
    assert (flag(argv, "--prometheus-host"), flag(argv, "--prometheus-port")) == (
        "127.0.0.1",
        str(ports.ROUTER_METRICS_PORT),
    )
    # No key either way: nginx keeps the client keys.
    assert not {"--api-key", "--api-key-validation-urls"} & set(argv)


def test_the_thresholds_follow_the_replicas_not_the_nodes(bare_metal_raw):
    bare_metal_raw["model"] = {"pipelineParallel": 2}
    argv = router.command(validate(cache_aware(bare_metal_raw)))
    assert flag(argv, "--balance-abs-threshold") == "2"
    assert len(argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]) == 2


def test_a_moved_router_row_moves_the_listener(bare_metal_raw):
    raw = cache_aware(bare_metal_raw)
    raw["ports"] = [
        {"name": "model-service", "port": 5000, "scope": "clients"},
        {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
        {"name": "router", "port": 6200, "scope": "cluster"},
    ]
    assert flag(router.command(validate(raw)), "--port") == "6200"


def test_the_router_waits_for_its_workers_as_long_as_the_rollout(bare_metal_raw):
    raw = cache_aware(bare_metal_raw)
    raw["rollout"] = {"healthTimeoutSeconds": 2400}
    raw["loadBalancer"]["idleTimeoutSeconds"] = 5400
    argv = router.command(validate(raw))
    assert flag(argv, "--worker-startup-timeout-secs") == "2400"
    assert flag(argv, "--request-timeout-secs") == "5400"


class _Admin(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []
    answer = (200, "Successfully removed worker")

    def do_POST(self):  # noqa: N802 (the stdlib's name)
        type(self).seen.append(self.path)
        code, text = type(self).answer
        self.send_response(code)
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def admin():
    _Admin.seen = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Admin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_ctl(tmp_path, port: int | None, *args: str) -> subprocess.CompletedProcess:
    """router_ctl with the router's address in a file (nginx.ROUTER_FILE), or no file (None)."""
    address_file = tmp_path / "router.addr"
    if port is not None:
        address_file.write_text(f"127.0.0.1:{port}\n")
    body = f"router_file={address_file}\n" + router.admin_function('"$router_file"') + 'router_ctl "$@"'
    return subprocess.run(
        ["bash", "-c", script("router_ctl", body), "router_ctl", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_router_ctl_removes_and_adds_a_worker_by_its_url(admin, tmp_path):
    port = admin.server_address[1]
    assert run_ctl(tmp_path, port, "remove", "http://10.0.0.4:5000").returncode == 0
    _Admin.answer = (200, "Successfully added worker")
    assert run_ctl(tmp_path, port, "add", "http://10.0.0.4:5000").returncode == 0
    assert _Admin.seen == ["/remove_worker?url=http://10.0.0.4:5000", "/add_worker?url=http://10.0.0.4:5000"]


def test_router_ctl_takes_a_worker_already_there_as_added(admin, tmp_path):
    _Admin.answer = (400, "Worker already exists: http://10.0.0.4:5000")
    assert run_ctl(tmp_path, admin.server_address[1], "add", "http://10.0.0.4:5000").returncode == 0


def test_router_ctl_fails_on_any_other_refusal(admin, tmp_path):
    _Admin.answer = (400, "Failed to add worker http://10.0.0.4:5000")
    result = run_ctl(tmp_path, admin.server_address[1], "add", "http://10.0.0.4:5000")
    assert result.returncode == 1
    assert "answered 400" in result.stderr


def test_router_ctl_says_3_when_no_router_listens(tmp_path):
    with socket.socket() as held:  # bound, never listening: a connection is refused
        held.bind(("127.0.0.1", 0))
        assert run_ctl(tmp_path, held.getsockname()[1], "remove", "http://10.0.0.4:5000").returncode == 3


def test_router_ctl_says_4_without_a_router_configured(tmp_path):
    assert run_ctl(tmp_path, None, "remove", "http://10.0.0.4:5000").returncode == 4


def test_router_ctl_is_shellcheck_clean(tmp_path):
    text = "router_file=/etc/qwen-cluster/nginx/router.addr\n" + router.admin_function('"$router_file"')
    shellcheck(script("router_ctl", text), tmp_path)


class _Metrics(http.server.BaseHTTPRequestHandler):
    text = ""

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(type(self).text.encode())

    def log_message(self, *args):
        pass


def run_running(tmp_path, metrics_port: int | None, worker: str) -> str:
    address_file = tmp_path / "router.addr"
    if metrics_port is not None:
        address_file.write_text(f"127.0.0.1:1 127.0.0.1:{metrics_port}\n")
    body = f"router_file={address_file}\n" + router.running_function('"$router_file"') + 'router_running "$1"'
    done = subprocess.run(
        ["bash", "-c", script("running", body), "running", worker], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_router_running_reads_the_routers_in_flight_count_for_one_worker(tmp_path):
    # The gauge as the 0.1.17 router prints it (metrics-exporter-prometheus), two workers.
    _Metrics.text = (
        "# TYPE vllm_router_running_requests gauge\n"
        'vllm_router_running_requests{worker="http://10.0.0.4:5000"} 3\n'
        'vllm_router_running_requests{worker="http://10.0.0.40:5000"} 7\n'
    )
    server = http.server.HTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert run_running(tmp_path, port, "http://10.0.0.4:5000") == "3"
        assert run_running(tmp_path, port, "http://10.0.0.5:5000") == "0"
    finally:
        server.shutdown()
        server.server_close()


def test_router_running_is_0_without_a_router_or_an_answer(tmp_path):
    assert run_running(tmp_path, None, "http://10.0.0.4:5000") == "0"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        assert run_running(tmp_path, held.getsockname()[1], "http://10.0.0.4:5000") == "0"


def test_the_address_line_names_the_api_then_the_metrics_listener():
    assert router.address_line(("127.0.0.1", 30000)) == "127.0.0.1:30000 127.0.0.1:29000"


# ---------------------------------------------------------------- kv-aware


def kv_aware(raw: dict) -> dict:
    raw["loadBalancer"] = {"routing": "kv-aware"}
    return raw


def test_kv_aware_subscribes_to_every_heads_events_under_its_worker_url(bare_metal_raw):
    cluster = validate(kv_aware(bare_metal_raw))
    argv = router.command(cluster)
    assert flag(argv, "--policy") == "kv_aware"
    workers = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    sources = [argv[i + 1] for i, word in enumerate(argv) if word == "--kv-event-source"]
    # Keyed by the worker's URL as --worker-urls names it, the head's publisher at the kv-events row.
    assert sources == [f"{url}=tcp://{url.removeprefix('http://').split(':')[0]}:5557" for url in workers]
    assert len(sources) == 4
    assert flag(argv, "--kv-event-block-size") == "16"
    assert flag(argv, "--kv-event-model") == cluster.model.name
    # cache_aware's own knobs mean nothing to kv_aware.
    assert not {"--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold"} & set(argv)


def test_cache_aware_renders_no_kv_event_flag(bare_metal_raw):
    argv = router.command(validate(cache_aware(bare_metal_raw)))
    assert not [word for word in argv if word.startswith("--kv-event")]


def test_kv_aware_on_aws_names_the_proxies_listeners_and_the_heads_publishers(aws_raw):
    cluster = validate(kv_aware(aws_raw))
    argv = router.command(cluster)
    sources = [argv[i + 1] for i, word in enumerate(argv) if word == "--kv-event-source"]
    assert sources == [f"http://{head.ip}:30001=tcp://{head.ip}:5557" for head in cluster.topology.heads]


def test_the_replicas_publish_their_events_where_the_router_subscribes(bare_metal_raw):
    from qwen_cluster.render import vllm

    cluster = validate(kv_aware(bare_metal_raw))
    head = cluster.topology.heads[0].name
    argv = vllm.serve_argv(cluster, head)
    configs = [word.split("=", 1)[1] for word in argv if word.startswith("--kv-events-config=")]
    assert len(configs) == 1
    # A wildcard: vLLM binds only such an endpoint and connects to any other (kv_events.py).
    assert json.loads(configs[0]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
    }
    assert "--block-size=16" in argv and "--enable-scale-out" in argv
    # cache-aware publishes nothing and leaves the block size to vLLM.
    plain = vllm.serve_argv(validate(cache_aware(bare_metal_raw)), head)
    assert not [word for word in plain if word.startswith(("--kv-events-config", "--block-size"))]


def test_a_given_block_size_is_the_routers_and_rendered_once(bare_metal_raw):
    from qwen_cluster.render import vllm

    raw = kv_aware(bare_metal_raw)
    raw["model"] = {"vllmFlags": {"--block-size": 128}}
    cluster = validate(raw)
    assert flag(router.command(cluster), "--kv-event-block-size") == "128"
    argv = vllm.serve_argv(cluster)
    assert [word for word in argv if word.startswith("--block-size")] == ["--block-size=128"]


def test_every_member_of_a_multi_node_replica_keeps_the_routers_block_size(bare_metal_raw):
    from qwen_cluster.render import vllm

    raw = kv_aware(bare_metal_raw)
    raw["model"] = {"pipelineParallel": 2}
    cluster = validate(raw)
    member = next(
        node for node in cluster.topology.replicas[0].members if node is not cluster.topology.heads[0]
    )
    headless = vllm.headless_argv(cluster, member.name)
    assert "--block-size=16" in headless
    assert not [word for word in headless if word.startswith("--kv-events-config")]


def test_kv_aware_adds_the_kv_events_row_members_only(bare_metal_raw):
    cluster = validate(kv_aware(bare_metal_raw))
    row = next(entry for entry in cluster.ports if entry.name == ports.KV_EVENTS)
    assert (row.port.low, row.scope) == (5557, ports.Scope.CLUSTER)
    assert cluster.kv_events_port == 5557
    assert validate(cache_aware(bare_metal_raw)).kv_events_port is None


def test_a_kv_events_row_open_to_clients_is_refused(bare_metal_raw):
    raw = kv_aware(bare_metal_raw)
    raw["ports"] = [
        {"name": "model-service", "port": 5000, "scope": "clients"},
        {"name": "inter-node", "port": "6000-6100", "scope": "cluster"},
        {"name": "kv-events", "port": 5557, "scope": "clients"},
    ]
    with pytest.raises(
        ValueError, match=r"ports entry kv-events \(5557, scope clients\) must be a single port"
    ):
        validate(raw)


def test_a_block_size_the_router_cannot_take_is_refused_by_key_and_value(bare_metal_raw):
    raw = kv_aware(bare_metal_raw)
    raw["model"] = {"vllmFlags": {"--block-size": "big"}}
    with pytest.raises(
        ValueError, match=r"model.vllmFlags --block-size 'big' must be a positive whole number"
    ):
        validate(raw)
