import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cluster import probes
from labkit.models import modelserver
from qwen_cluster.render import nginx
from tests.helpers import tools
from tests.helpers.baremetal import ONPREM, ONPREM_CACHE_AWARE, ONPREM_DISAGGREGATED
from tests.helpers.configs import TEST_API_KEY
from tests.helpers.nginx_loopback import locked_nginx
from tests.helpers.standin_server import serving
from tests.helpers.wait import wait_until


@pytest.fixture(scope="module")
def conf() -> str:
    return nginx.for_cluster(ONPREM)


def test_upstream_is_every_replica_head_on_the_model_port_with_least_conn(conf):
    upstream = conf[conf.index("upstream qwen_model") : conf.index("server {")]
    servers = re.findall(r"server (\S+) max_fails=3 fail_timeout=30s;", upstream)
    assert servers == [f"192.168.1.10{i}:5000" for i in range(4)]
    assert "least_conn;" in upstream
    # Kept-alive upstream connections hide a cut link until proxy_read_timeout (lab finding).
    assert re.search(r"^\s*keepalive\s", upstream, re.MULTILINE) is None


def test_listens_on_the_load_balancer_port(conf):
    assert "listen 80;" in conf


@pytest.mark.parametrize(
    "directive",
    [
        "proxy_set_header Host $host;",
        "proxy_set_header X-Real-IP $remote_addr;",
        "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_buffering off;",
        "proxy_read_timeout 3600s;",
        "proxy_send_timeout 3600s;",
        "proxy_next_upstream error timeout http_502 http_503 non_idempotent;",
        "location = /health",
    ],
)
def test_streaming_directives(conf, directive):
    assert directive in conf


def test_timeouts_follow_idle_timeout():
    text = nginx.render([("10.0.0.1", 5000)], listen_port=8080, idle_timeout_seconds=900)
    assert "proxy_read_timeout 900s;" in text and "listen 8080;" in text


def test_needs_an_upstream():
    with pytest.raises(ValueError):
        nginx.render([], listen_port=80, idle_timeout_seconds=60)


@tools.needs("nginx")
def nginx_t(prefix, conf: str) -> subprocess.CompletedProcess:
    """`nginx -t` of `conf` with the test key, under the prefix `prefix`."""
    (prefix / "nginx.conf").write_text(conf)
    (prefix / nginx.KEYS_FILE).write_text(nginx.keys_conf([TEST_API_KEY]))
    return subprocess.run(
        ["nginx", "-t", "-e", "stderr", "-p", f"{prefix}/", "-c", str(prefix / "nginx.conf")],
        capture_output=True,
        text=True,
    )


def test_passes_nginx_t_under_a_temporary_prefix(tmp_path):
    for directory in ("logs", "state"):
        (tmp_path / directory).mkdir()
    conf = nginx.for_cluster(ONPREM, runtime_dir="state", log_dir="logs", pid_file="nginx.pid", user=None)
    result = nginx_t(tmp_path, conf)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_request_bodies_are_buffered_so_a_dead_replica_can_be_retried(conf):
    # With proxy_request_buffering off nginx cannot pass a request on once the body is sent.
    assert "proxy_request_buffering off" not in conf


def directive(conf: str, name: str) -> int:
    (value,) = re.findall(rf"^\s*{name}\s+(\d+);", conf, re.MULTILINE)
    return int(value)


def test_workers_may_open_twice_as_many_files_as_connections(conf):
    # Each proxied request holds a client and an upstream connection (gixy-ng's rule).
    assert directive(conf, "worker_rlimit_nofile") >= 2 * directive(conf, "worker_connections")


def pinned_nginx_version() -> str:
    from components.baremetal.serving import NGINX_IMAGE

    version = NGINX_IMAGE.removeprefix("nginx:")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"NGINX_IMAGE {NGINX_IMAGE} is not a pinned release"
    return version


@pytest.mark.parametrize(
    "paths",
    [{}, {"runtime_dir": "state", "log_dir": "logs", "pid_file": "nginx.pid", "user": None}],
    ids=["deployed", "lab"],
)
def test_gixy_ng_finds_nothing_for_the_pinned_nginx(tmp_path, paths):
    gixy = shutil.which("gixy", path=str(Path(sys.executable).parent))
    assert gixy, "gixy-ng is installed from requirements.txt"
    (tmp_path / "nginx.conf").write_text(nginx.for_cluster(ONPREM, **paths))
    # --nginx-version: gixy-ng also reports the known CVEs of the release the container runs.
    result = subprocess.run(
        [gixy, "-f", "json", "--nginx-version", pinned_nginx_version(), str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
    )
    findings = json.loads(result.stdout or "null")
    assert findings == [], json.dumps(findings, indent=2) + result.stderr
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- the locked endpoint


def _locked(**paths) -> str:
    return nginx.render(
        [("10.0.0.1", 5000), ("10.0.0.2", 5000)],
        listen_port=443,
        idle_timeout_seconds=3600,
        api_keys=True,
        tls=True,
        **paths,
    )


def test_only_the_openai_routes_health_and_nginx_health_have_a_location_besides_the_404():
    locations = re.findall(r"^\s*location (.+?) \{", _locked(), re.MULTILINE)
    routes = [route.location for route in nginx.API_ROUTES]
    assert sorted(locations) == sorted([*routes, "= /health", "= /nginx-health", "/"])
    catch_all = _locked().split("location / {", 1)[1].split("}", 1)[0]
    assert "return 404" in catch_all and "proxy_pass" not in catch_all


def test_the_allowlist_names_no_admin_or_tokenizer_route():
    paths = {route.path for route in nginx.API_ROUTES}
    assert paths == {
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/responses/{id}/cancel",
    }


def test_every_api_route_checks_the_key_and_health_does_not():
    conf = _locked()
    for route in nginx.API_ROUTES:
        block = conf.split(f"location {route.location} {{", 1)[1].split("proxy_pass", 1)[0]
        assert f"if ({nginx.KEY_VARIABLE} = 0)" in block and "return 401" in block
    health = conf.split("location = /health {", 1)[1].split("}", 2)[1]
    assert nginx.KEY_VARIABLE not in health


def test_an_open_endpoint_renders_no_key_check():
    conf = nginx.render([("10.0.0.1", 5000)], listen_port=80, idle_timeout_seconds=60)
    assert nginx.KEY_VARIABLE not in conf and nginx.KEYS_FILE not in conf


def test_the_key_is_stripped_before_any_model_server():
    assert 'proxy_set_header Authorization "";' in _locked()


def test_tls_is_1_2_and_1_3_with_mozilla_intermediate_ciphers_only():
    conf = _locked()
    assert "listen 443 ssl;" in conf
    assert re.search(r"^\s*ssl_protocols TLSv1\.2 TLSv1\.3;$", conf, re.MULTILINE)
    (ciphers,) = re.findall(r"^\s*ssl_ciphers (\S+);$", conf, re.MULTILINE)
    suites = ciphers.split(":")
    assert all(suite.startswith("ECDHE-") and ("GCM" in suite or "CHACHA20" in suite) for suite in suites)


def test_keys_are_whole_headers_matched_case_sensitively():
    text = nginx.keys_conf(["abc.def+ghi/jkl=" + "x" * 20])
    assert '"~^Bearer abc\\.def\\+ghi/jkl=xxxxxxxxxxxxxxxxxxxx$" 1;' in text


def test_gixy_ng_finds_nothing_in_the_locked_tls_endpoint(tmp_path):
    gixy = shutil.which("gixy", path=str(Path(sys.executable).parent))
    assert gixy, "gixy-ng is installed from requirements.txt"
    (tmp_path / "nginx.conf").write_text(_locked())
    result = subprocess.run(
        [gixy, "-f", "json", "--nginx-version", pinned_nginx_version(), str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
    )
    findings = json.loads(result.stdout or "null")
    assert findings == [], json.dumps(findings, indent=2) + result.stderr


@tools.needs("nginx")
def test_through_a_real_nginx_only_keyed_openai_routes_reach_the_model_server(tmp_path):
    """nginx (the Debian binary) on loopback in front of the stand-in, with a key and TLS."""
    with locked_nginx(tmp_path) as (port, access, server):
        def status(method: str, path: str, how=access) -> int:
            return probes.request("127.0.0.1", port, method, path, access=how).status

        assert status("GET", "/v1/models") == 200
        assert status("GET", "/v1/models", probes.ClientAccess(None, access.ca_file)) == 401
        assert status("GET", "/v1/models", probes.ClientAccess("x" * 40, access.ca_file)) == 401
        for path in ("/metrics", "/tokenize", "/v1/../metrics", "//metrics", "/v1/%2e%2e/metrics"):
            assert status("POST", path) == 404, path
        assert status("GET", "/v1/chat/completions") == 403
        reached = {path for (path, _), count in server.stats.requests.items() if count}
        assert reached == {"/v1/models"} and server.stats.with_authorization == 0


def test_a_disaggregated_endpoint_serves_every_route_but_the_stored_responses():
    served = nginx.api_routes(ONPREM_DISAGGREGATED)
    assert {(route.method, route.path) for route in nginx.API_ROUTES if route not in served} == {
        ("GET", "/v1/responses/{id}"),
        ("POST", "/v1/responses/{id}/cancel"),
    }
    assert nginx.api_routes(ONPREM) == nginx.API_ROUTES
    conf = nginx.for_cluster(ONPREM_DISAGGREGATED)
    for route in nginx.STORED_RESPONSE_ROUTES:
        location = conf[conf.index(f"location {route.location} {{") :]
        location = location[: location.index("\n        }")]
        assert "return 501" in location and "proxy_pass" not in location, location
        # The key is checked first: a stranger learns nothing of what the deployment serves.
        assert location.index("return 401") < location.index("return 501")


@tools.needs("nginx")
def test_through_a_real_nginx_a_disaggregated_endpoint_answers_stored_responses_itself(tmp_path):
    """vLLM's router in P/D mode answers them 501 in plain text; nginx answers first, in JSON."""
    with locked_nginx(tmp_path, disaggregated=True) as (port, access, server):

        def ask(method: str, path: str, how=access) -> probes.Reply:
            return probes.request("127.0.0.1", port, method, path, access=how)

        for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
            reply = ask(method, path)
            assert reply.status == 501, (path, reply)
            assert "disaggregated" in json.loads(reply.body)["error"]["message"]
            assert ask(method, path, probes.ClientAccess(None, access.ca_file)).status == 401
        assert ask("POST", "/v1/responses").status == 200
        # The stand-in counts a request once it has answered it.
        wait_until(
            lambda: {path for (path, _), n in server.stats.requests.items() if n} == {"/v1/responses"},
            what="the stand-in counting /v1/responses alone",
            timeout=5,
        )


def test_only_a_disaggregated_endpoint_retries_a_500_on_the_next_server():
    retried = re.compile(r"proxy_next_upstream ([a-z0-9_ ]+);")
    assert retried.findall(nginx.for_cluster(ONPREM))[0] == "error timeout http_502 http_503 non_idempotent"
    assert retried.findall(nginx.for_cluster(ONPREM_DISAGGREGATED))[0] == (
        "error timeout http_502 http_503 http_500 non_idempotent"
    )


@tools.needs("nginx")
def test_through_a_real_nginx_a_disaggregated_router_answering_500_is_retried_on_the_decode_pool(tmp_path):
    """vLLM's router in P/D mode answers 500 while it still picks a prefill server that died
    (nginx.P_D_RETRY): the request goes on to the backup, the decode pool, and succeeds."""
    import http.server
    import threading

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b"Transparent proxy request failed"
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    router = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=router.serve_forever, daemon=True).start()
    try:
        for disaggregated, expected in ((True, 200), (False, 500)):
            directory = tmp_path / str(disaggregated)
            directory.mkdir()
            with locked_nginx(directory, router_at=router.server_address, disaggregated=disaggregated) as (
                port,
                access,
                _replica,
            ):
                reply = probes.chat("127.0.0.1", port, "hello", access=access, max_tokens=4)
                assert reply.status == expected, (disaggregated, reply)
    finally:
        router.shutdown()


# --- cache-aware routing: vLLM's router first, the replicas its backups -----------------------


def cache_aware_conf() -> str:
    return nginx.for_cluster(ONPREM_CACHE_AWARE)


def test_cache_aware_upstream_is_the_router_with_every_head_as_backup():
    conf = cache_aware_conf()
    upstream = conf[conf.index("upstream qwen_model") : conf.index("server {")]
    lines = re.findall(r"server (\S+) max_fails=3 fail_timeout=30s( backup)?;", upstream)
    assert lines == [("127.0.0.1:30000", "")] + [(f"192.168.1.10{i}:5000", " backup") for i in range(4)]
    # The router, then up to three replicas directly.
    assert "proxy_next_upstream_tries 4;" in conf


def test_least_conn_has_no_router_and_no_backup(conf):
    assert "backup" not in conf and ":30000" not in conf


def test_the_install_script_keeps_the_router_first_and_the_heads_backup():
    script = nginx.install_script("conf", [("10.0.0.4", 5000)], router_at=("127.0.0.1", 30000))
    assert "echo 'server 127.0.0.1:30000 max_fails=3 fail_timeout=30s;'" in script
    assert 'flag=" backup"' in script


@tools.needs("nginx")
def test_through_a_real_nginx_requests_reach_the_router_and_its_admin_routes_do_not(tmp_path):
    with (
        serving(modelserver.Settings(node="router")) as (router_port, router_server),
        locked_nginx(tmp_path, router_at=("127.0.0.1", router_port)) as (port, access, replica),
    ):

        def status(method: str, path: str) -> int:
            return probes.request("127.0.0.1", port, method, path, access=access).status

        # All to the router while it serves: the replica is its backup (least_conn would spread
        # these over both).
        assert [status("GET", "/v1/models") for _ in range(8)] == [200] * 8
        admin = ("/add_worker?url=http://x:1", "/remove_worker?url=http://x:1", "/list_workers")
        # vLLM's scale-out routes (`--enable-scale-out`, which cache-aware routing turns on).
        scale_out = ("/v1/chat/completions/render", "/v1/completions/render", "/inference/v1/generate")
        for path in (*admin, *scale_out):
            assert status("POST", path) == 404, path
        assert status("GET", "/workers") == 404
        reached = {path for (path, _), count in router_server.stats.requests.items() if count}
        assert reached == {"/v1/models"}
        assert not any(replica.stats.requests.values())


def _held(sock: socket.socket) -> tuple[str, int]:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()


@tools.needs("nginx")
def test_through_a_real_nginx_a_dead_router_degrades_to_the_replicas(tmp_path):
    # A port held (bound, never listening) so that nothing else takes it: connecting is refused.
    with socket.socket() as dead, locked_nginx(tmp_path, router_at=_held(dead)) as (port, access, replica):
        statuses = [
            probes.request("127.0.0.1", port, "GET", "/v1/models", access=access).status for _ in range(5)
        ]
        assert statuses == [200] * 5
        # The stand-in counts a request once it has answered it.
        wait_until(
            lambda: sum(n for (path, _), n in replica.stats.requests.items() if path == "/v1/models") == 5,
            what="the replica counting the 5 requests",
            timeout=5,
        )


@tools.needs("nginx")
def test_nginx_takes_a_drained_backup_beside_the_router(tmp_path):
    for directory in ("logs", "state"):
        (tmp_path / directory).mkdir()
    servers = nginx.upstream_servers(ONPREM_CACHE_AWARE)
    router_at = nginx.router_server(ONPREM_CACHE_AWARE)
    conf = nginx.for_cluster(
        ONPREM_CACHE_AWARE,
        runtime_dir="state",
        log_dir="logs",
        pid_file="nginx.pid",
        user=None,
        upstream_file=nginx.UPSTREAM_FILE,
    )
    upstream = nginx.upstream_conf(servers, down=frozenset({"192.168.1.101:5000"}), router_at=router_at)
    assert "server 192.168.1.101:5000 max_fails=3 fail_timeout=30s backup down;" in upstream
    (tmp_path / nginx.UPSTREAM_FILE).write_text(upstream)
    result = nginx_t(tmp_path, conf)
    assert result.returncode == 0, result.stderr
