import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_cluster.render import nginx
from tests.helpers.baremetal import ONPREM


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


def test_passes_nginx_t_under_a_temporary_prefix(tmp_path):
    for directory in ("logs", "state"):
        (tmp_path / directory).mkdir()
    conf = nginx.for_cluster(ONPREM, runtime_dir="state", log_dir="logs", pid_file="nginx.pid", user=None)
    (tmp_path / "nginx.conf").write_text(conf)
    result = subprocess.run(
        ["nginx", "-t", "-e", "stderr", "-p", f"{tmp_path}/", "-c", str(tmp_path / "nginx.conf")],
        capture_output=True,
        text=True,
    )
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
    from qwen_cluster.baremetal.serving import NGINX_IMAGE

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
