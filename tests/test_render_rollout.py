"""The rollout's scripts and the load balancer's install script, run for real against a real
nginx and two stand-in replicas on loopback (no root, no namespace): what a drain waits for,
when a replica comes back, what a membership change does to the upstream file."""

from __future__ import annotations

import http.server
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from qwen_cluster.render import nginx, rollout
from tests.helpers.baremetal import shellcheck
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Replica:
    """A stand-in model server: names itself in every answer; /slow?s=N streams for N seconds
    (`streaming` counts the streams it is sending); /health answers 503 for the next
    `loading_probes` probes, then `health`."""

    def __init__(self, name: str, port: int | None = None):
        self.name = name
        self.health = 200
        self.loading_probes = 0
        self.health_probes = 0
        self.streaming = 0
        self.port = port or free_port()
        replica = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    replica.health_probes += 1
                    if replica.loading_probes > 0:
                        replica.loading_probes -= 1
                        self._answer(503, b"")
                    else:
                        self._answer(replica.health, b"")
                elif self.path.startswith(SLOW):
                    self.send_response(200)
                    self.send_header("X-Replica", replica.name)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    replica.streaming += 1
                    try:
                        # The pause is the behaviour under test: a long stream in flight, one
                        # chunk every 0.1 s, that a drain must wait for.
                        for _ in range(int(self.path.split("=")[1]) * 10):
                            self.wfile.write(b"2\r\n.\n\r\n")
                            self.wfile.flush()
                            time.sleep(0.1)
                        self.wfile.write(b"0\r\n\r\n")
                    finally:
                        replica.streaming -= 1
                else:
                    self._answer(200, replica.name.encode())

            def _answer(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("X-Replica", replica.name)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # probes that hang up early
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


# A long GET that nginx lets through (an allowed route: nginx.API_ROUTES): a replica streams it.
SLOW = "/v1/responses/slow"


class LoadBalancer:
    """nginx under a temporary prefix with the project's nginx.conf and the upstream file,
    installed by the rendered install script, and a `docker` first on PATH that answers for
    the nginx "container" as the docker CLI does (inspect, exec nginx -t, kill --signal=HUP),
    so the scripts run their real docker path."""

    def __init__(self, root: Path, servers: list[tuple[str, int]]):
        self.root = root
        self.conf_dir = root / "conf"
        self.port = free_port()
        for directory in ("logs", "temp"):
            (root / directory).mkdir()
        self.conf = nginx.render(
            servers,
            listen_port=self.port,
            idle_timeout_seconds=60,
            runtime_dir="temp",
            log_dir="logs",
            pid_file="nginx.pid",
            user=None,
            upstream_file=nginx.UPSTREAM_FILE,
        )
        main = self.conf_dir / nginx.CONF_FILE
        self.base = ["nginx", "-p", f"{root}/", "-c", str(main), "-e", "stderr"]
        bin_dir = root / "bin"
        bin_dir.mkdir()
        docker = bin_dir / "docker"
        base = " ".join(self.base)
        docker.write_text(
            "#!/bin/bash\n"
            f'if [ -e {root}/docker-down ]; then echo "Cannot connect to the Docker daemon at '
            'unix:///var/run/docker.sock. Is the docker daemon running?" >&2; exit 1; fi\n'
            f'alive() {{ [ -s {root}/nginx.pid ] && kill -0 "$(cat {root}/nginx.pid)" 2>/dev/null; }}\n'
            'case "$1" in\n'
            f"  inspect) if [ -e {root}/nginx.pid ]; then alive && echo true || echo false; "
            'else echo "Error: No such object: ${@: -1}" >&2; exit 1; fi ;;\n'
            f"  exec) exec {base} -t -q ;;\n"
            f"  kill) exec {base} -s reload ;;\n"
            '  *) echo "test docker: $* is not modelled" >&2; exit 125 ;;\n'
            "esac\n"
        )
        docker.chmod(0o755)
        self.env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}
        self.process: subprocess.Popen | None = None

    def run(self, text: str, *args: str) -> subprocess.CompletedProcess[str]:
        path = self.root / "step.sh"
        path.write_text(text)
        return subprocess.run(
            ["bash", str(path), *args], env=self.env, capture_output=True, text=True, timeout=60
        )

    def install(
        self, servers: list[tuple[str, int]], router_at: tuple[str, int] | None = None
    ) -> subprocess.CompletedProcess[str]:
        script = nginx.install_script(self.conf, servers, conf_dir=str(self.conf_dir), router_at=router_at)
        return self.run(script)

    def start(self) -> None:
        self.process = subprocess.Popen([*self.base, "-g", "daemon off;"])
        wait_until(self.accepts, what=f"nginx accepting on 127.0.0.1:{self.port}", timeout=5)

    def accepts(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def get(self, path: str = "/v1/models") -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as answer:
            return answer.status, answer.headers["X-Replica"]

    def upstream(self) -> str:
        return (self.conf_dir / nginx.UPSTREAM_FILE).read_text()


@pytest.fixture
def cluster(tmp_path):
    a, b = Replica("a"), Replica("b")
    lb = LoadBalancer(tmp_path, [a.address, b.address])
    yield lb, a, b
    lb.stop()
    for replica in (a, b):
        replica.server.shutdown()


def served_by(lb: LoadBalancer, count: int = 8) -> set[str]:
    return {lb.get()[1] for _ in range(count)}


def settles_on(lb: LoadBalancer, expected: set[str]) -> set[str]:
    """Who serves, once the reload (a signal nginx handles a moment later) has taken effect;
    fails naming who served last when that is not `expected` within 5 s."""
    return wait_until(
        lambda: served_by(lb),
        what=f"the load balancer serving from exactly {sorted(expected)}",
        timeout=5,
        interval=0.2,
        done=lambda seen: seen == expected,
    )


def stream_holder(*replicas: Replica) -> Replica:
    """The replica a stream reached, once it is sending it (nginx then holds its connection)."""
    return wait_until(
        lambda: next((replica for replica in replicas if replica.streaming), None),
        what="a replica sending the /slow stream",
        timeout=5,
    )


def down_line(replica: Replica) -> str:
    return f"server 127.0.0.1:{replica.port} max_fails=3 fail_timeout=30s down;"


def test_install_before_nginx_runs_writes_the_files_and_every_server_is_in(cluster):
    lb, a, b = cluster
    result = lb.install([a.address, b.address])
    assert result.returncode == 0, result.stderr
    assert "not running yet" in result.stdout
    assert " down;" not in lb.upstream()
    lb.start()
    assert settles_on(lb, {"a", "b"}) == {"a", "b"}


def test_a_new_server_enters_down_and_a_drained_one_stays_down(cluster):
    lb, a, b = cluster
    assert lb.install([a.address]).returncode == 0
    lb.start()
    assert settles_on(lb, {"a"}) == {"a"}
    result = lb.install([a.address, b.address])  # a node joins
    assert result.returncode == 0, result.stderr
    assert "reloaded" in result.stdout
    assert down_line(b) in lb.upstream() and down_line(a) not in lb.upstream()
    assert settles_on(lb, {"a"}) == {"a"}
    drained = rollout.drain_script(
        a.address, replica="a", drain_timeout_seconds=5, fingerprint="x", conf_dir=str(lb.conf_dir)
    )
    assert lb.run(drained).returncode == 0
    assert lb.install([a.address, b.address]).returncode == 0  # a re-apply keeps both down
    assert down_line(a) in lb.upstream() and down_line(b) in lb.upstream()


def test_a_config_nginx_refuses_is_rolled_back_and_fails_the_step(cluster):
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    before = lb.upstream()
    lb.conf = lb.conf.replace("least_conn;", "least_conn; no_such_directive;")
    result = lb.install([a.address])
    assert result.returncode == 1 and "previous files are back" in result.stderr
    assert lb.upstream() == before
    assert settles_on(lb, {"a", "b"}) == {"a", "b"}


def test_drain_takes_the_replica_out_and_waits_for_its_stream_to_finish(cluster):
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    streams: list[tuple[int, str, int]] = []

    def stream():
        with urllib.request.urlopen(f"http://127.0.0.1:{lb.port}{SLOW}?s=3", timeout=30) as answer:
            streams.append((answer.status, answer.headers["X-Replica"], len(answer.read())))

    reader = threading.Thread(target=stream)
    reader.start()
    # The replica holding the stream is drained; the stream must end whole, not be cut.
    holder = stream_holder(a, b)
    other = b if holder is a else a
    started = time.monotonic()
    result = lb.run(
        rollout.drain_script(
            holder.address,
            replica=holder.name,
            drain_timeout_seconds=20,
            fingerprint="f",
            conf_dir=str(lb.conf_dir),
        )
    )
    waited = time.monotonic() - started
    reader.join()
    assert result.returncode == 0, result.stderr
    assert streams == [(200, holder.name, 60)]  # 30 chunks of ".\n"
    assert waited >= 2.0, waited  # it waited for the stream (3 s, of which only its start had gone)
    assert "with 0 requests in flight" in result.stdout
    assert down_line(holder) in lb.upstream()
    assert settles_on(lb, {other.name}) == {other.name}


def test_drains_of_two_lanes_at_once_both_take_their_replica_out(cluster):
    """Lanes drain at the same moment on the load balancer's host: neither mark is lost."""
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    running = []
    for replica in (a, b):
        path = lb.root / f"drain-{replica.name}.sh"
        path.write_text(
            rollout.drain_script(
                replica.address, replica=replica.name, drain_timeout_seconds=5, fingerprint="f",
                conf_dir=str(lb.conf_dir),
            )
        )
        running.append(subprocess.Popen(["bash", str(path)], env=lb.env, stdout=subprocess.DEVNULL))
    assert [process.wait(timeout=60) for process in running] == [0, 0]
    assert down_line(a) in lb.upstream() and down_line(b) in lb.upstream()


def test_docker_unreachable_during_a_drain_fails_the_step_and_the_server_stays_in(cluster):
    """A drain that cannot reach nginx's container does not mark the server down: the file a
    later reload would read stays as it was, and nginx keeps sending the replica traffic."""
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    before = lb.upstream()
    (lb.root / "docker-down").touch()
    result = lb.run(
        rollout.drain_script(
            a.address, replica="a", drain_timeout_seconds=20, fingerprint="f", conf_dir=str(lb.conf_dir)
        )
    )
    (lb.root / "docker-down").unlink()
    assert result.returncode != 0
    assert "Cannot connect to the Docker daemon" in result.stderr
    assert "the upstream file is as it was" in result.stderr
    assert lb.upstream() == before and down_line(a) not in lb.upstream()
    assert settles_on(lb, {"a", "b"}) == {"a", "b"}


def test_a_container_that_does_not_exist_is_not_running_and_nothing_else_is(cluster):
    """Only docker's "No such object" counts as absent; the install goes on for a first start."""
    lb, a, b = cluster
    assert lb.install([a.address]).returncode == 0  # no nginx "container" yet
    (lb.root / "docker-down").touch()
    result = lb.install([a.address, b.address])
    assert result.returncode != 0 and "Cannot connect to the Docker daemon" in result.stderr


def test_drain_gives_up_waiting_after_the_drain_timeout(cluster):
    lb, a, b = cluster
    assert lb.install([a.address]).returncode == 0
    lb.start()
    reader = threading.Thread(
        target=lambda: urllib.request.urlopen(f"http://127.0.0.1:{lb.port}{SLOW}?s=6").read()
    )
    reader.start()
    assert stream_holder(a) is a
    started = time.monotonic()
    result = lb.run(
        rollout.drain_script(
            a.address, replica="a", drain_timeout_seconds=2, fingerprint="f", conf_dir=str(lb.conf_dir)
        )
    )
    assert result.returncode == 0
    assert "after rollout.drainTimeoutSeconds=2; they will be cut" in result.stdout
    assert time.monotonic() - started < 5
    reader.join()


def test_ready_waits_for_health_then_puts_the_replica_back(cluster):
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    conf_dir = str(lb.conf_dir)
    drain = rollout.drain_script(
        b.address, replica="b", drain_timeout_seconds=5, fingerprint="f", conf_dir=conf_dir
    )
    assert lb.run(drain).returncode == 0
    b.health = 503  # loading its model
    ready = rollout.ready_script(
        b.address,
        replica="b",
        health_timeout_seconds=3,
        fingerprint="f",
        only_if_down=False,
        conf_dir=conf_dir,
        poll_seconds=1,
    )
    failed = lb.run(ready)
    assert failed.returncode == 1
    assert "did not answer /health with 200 within rollout.healthTimeoutSeconds=3" in failed.stderr
    assert down_line(b) in lb.upstream() and settles_on(lb, {"a"}) == {"a"}  # the rollout stops; b stays out

    b.health, b.loading_probes, b.health_probes = 200, 2, 0  # it finishes loading while ready waits
    passed = lb.run(ready)
    assert passed.returncode == 0, passed.stderr
    assert b.health_probes == 3  # two 503s waited through, then the 200
    assert "is back in rotation" in passed.stdout
    assert down_line(b) not in lb.upstream() and settles_on(lb, {"a", "b"}) == {"a", "b"}


def test_ready_counts_a_refused_connection_as_not_ready(cluster):
    """vLLM opens its port only once loaded (no 503 while loading): the gate waits through
    refused connections as through 503s."""
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    conf_dir = str(lb.conf_dir)
    drain = rollout.drain_script(
        b.address, replica="b", drain_timeout_seconds=5, fingerprint="f", conf_dir=conf_dir
    )
    assert lb.run(drain).returncode == 0
    b.server.shutdown()
    b.server.server_close()  # loading: nothing listens on b's port
    ready = rollout.ready_script(
        b.address, replica="b", health_timeout_seconds=2, fingerprint="f", only_if_down=False,
        conf_dir=conf_dir, poll_seconds=1,
    )
    failed = lb.run(ready)
    assert failed.returncode == 1 and "did not answer /health with 200" in failed.stderr
    b.server = Replica("b", port=b.port).server  # loaded: the port opens, /health answers 200
    passed = lb.run(ready)
    assert passed.returncode == 0, passed.stderr
    assert "is back in rotation" in passed.stdout


def test_ready_on_create_leaves_a_server_in_rotation_alone(cluster):
    """Day 0: every server starts in rotation, so no gate waits and the replicas start
    together; only a server that is down (a node that joined later) waits for its health."""
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    b.health = 503
    ready = rollout.ready_script(
        b.address,
        replica="b",
        health_timeout_seconds=60,
        fingerprint="f",
        only_if_down=True,
        conf_dir=str(lb.conf_dir),
    )
    started = time.monotonic()
    result = lb.run(ready)
    assert result.returncode == 0 and "is in rotation" in result.stdout
    assert time.monotonic() - started < 2


def test_retire_drains_a_replica_that_left_the_upstream(cluster):
    lb, a, b = cluster
    assert lb.install([a.address, b.address]).returncode == 0
    lb.start()
    assert lb.install([a.address]).returncode == 0  # b left: the upstream no longer has it
    retire = rollout.retire_script(b.address, replica="b", drain_timeout_seconds=5, conf_dir=str(lb.conf_dir))
    result = lb.run(retire)
    assert result.returncode == 0, result.stderr
    assert "with 0 requests in flight" in result.stdout
    assert settles_on(lb, {"a"}) == {"a"}


def test_scripts_change_with_the_containers_they_gate():
    spec = {"image": "vllm/vllm-openai:v0.33.0", "envs": ["VLLM_HOST_IP=192.168.1.101"]}
    bumped = {**spec, "image": "vllm/vllm-openai:v0.33.1"}
    one, two = rollout.fingerprint([spec]), rollout.fingerprint([bumped])
    assert one != two and rollout.fingerprint([dict(reversed(spec.items()))]) == one
    server = ("192.168.1.101", 5000)
    assert rollout.drain_script(
        server, replica="r", drain_timeout_seconds=300, fingerprint=one
    ) != rollout.drain_script(server, replica="r", drain_timeout_seconds=300, fingerprint=two)


def test_scripts_are_shellcheck_clean(tmp_path):
    server = ("192.168.1.101", 5000)
    for text in (
        nginx.install_script("events {}\n", [server]),
        rollout.drain_script(server, replica="r", drain_timeout_seconds=300, fingerprint="f"),
        rollout.ready_script(
            server, replica="r", health_timeout_seconds=1800, fingerprint="f", only_if_down=True
        ),
        rollout.ready_script(
            server, replica="r", health_timeout_seconds=1800, fingerprint="f", only_if_down=False
        ),
        rollout.retire_script(server, replica="r", drain_timeout_seconds=300),
        nginx.remove_script(),
    ):
        shellcheck(text, tmp_path)


# --- with vLLM's router (loadBalancer.routing cache-aware) -----------------------------------


class Router:
    """A stand-in of vllm-router's admin routes and its `vllm_router_running_requests` gauge,
    on one loopback port: it records each admin call with the upstream file as it was then."""

    def __init__(self, lb: LoadBalancer):
        self.calls: list[tuple[str, str]] = []  # (path with query, the upstream file then)
        self.running: dict[str, int] = {}
        self.port = free_port()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                stand_in.calls.append((self.path, lb.upstream()))
                self._answer(200, b"Successfully done")

            def do_GET(self):
                series = 'vllm_router_running_requests{{worker="{}"}} {}'
                lines = [series.format(w, n) for w, n in stand_in.running.items()]
                self._answer(200, ("\n".join(lines) + "\n").encode())

            def _answer(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def routed(cluster):
    """The cluster behind a router: nginx's files name it (the router's metrics on its one port)."""
    lb, a, b = cluster
    router = Router(lb)
    assert lb.install([a.address, b.address], router_at=("127.0.0.1", router.port)).returncode == 0
    (lb.conf_dir / nginx.ROUTER_FILE).write_text(f"127.0.0.1:{router.port} 127.0.0.1:{router.port}\n")
    lb.start()
    yield lb, a, b, router
    router.server.shutdown()


def url(replica: Replica) -> str:
    return f"http://127.0.0.1:{replica.port}"


def test_with_a_router_the_drain_leaves_it_first_and_waits_for_its_count(routed):
    lb, a, b, router = routed
    router.running[url(b)] = 1  # a stream the router sends to b, on a connection it owns
    threading.Timer(4.0, router.running.update, [{url(b): 0}]).start()
    started = time.monotonic()
    drain = rollout.drain_script(
        b.address, replica="b", drain_timeout_seconds=20, fingerprint="f", conf_dir=str(lb.conf_dir),
        routed=True,
    )
    result = lb.run(drain)
    assert result.returncode == 0, result.stderr
    # No connection of its own (a drain of an idle replica takes 2 polls): the router.s count held it.
    assert time.monotonic() - started >= 4.0
    assert [path for path, _ in router.calls] == [f"/remove_worker?url={url(b)}"]
    assert down_line(b).replace(" down;", " backup;") in router.calls[0][1]  # still in nginx then
    assert f"server 127.0.0.1:{b.port} max_fails=3 fail_timeout=30s backup down;" in lb.upstream()
    assert "with 0 requests in flight" in result.stdout


def test_with_a_router_the_gate_rejoins_it_after_nginx(routed):
    lb, a, b, router = routed
    conf_dir = str(lb.conf_dir)
    drain = rollout.drain_script(
        b.address, replica="b", drain_timeout_seconds=5, fingerprint="f", conf_dir=conf_dir, routed=True
    )
    assert lb.run(drain).returncode == 0
    ready = rollout.ready_script(
        b.address, replica="b", health_timeout_seconds=5, fingerprint="f", only_if_down=False,
        conf_dir=conf_dir, routed=True,
    )
    result = lb.run(ready)
    assert result.returncode == 0, result.stderr
    path, upstream_then = router.calls[-1]
    assert path == f"/add_worker?url={url(b)}"
    assert " backup down;" not in upstream_then  # back in nginx before the router


def test_a_router_that_is_not_running_is_passed_over(routed):
    lb, a, b, router = routed
    with socket.socket() as held:  # bound, never listening: refused
        held.bind(("127.0.0.1", 0))
        (lb.conf_dir / nginx.ROUTER_FILE).write_text(f"127.0.0.1:{held.getsockname()[1]} 127.0.0.1:1\n")
        drain = rollout.drain_script(
            b.address, replica="b", drain_timeout_seconds=5, fingerprint="f", conf_dir=str(lb.conf_dir),
        routed=True,
        )
        result = lb.run(drain)
    assert result.returncode == 0, result.stderr
    assert "router: not running; nothing to remove" in result.stdout
    assert " backup down;" in lb.upstream()
