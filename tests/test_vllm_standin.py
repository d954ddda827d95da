"""The lab vLLM image's `vllm` (labkit/images/imagebin.py) takes the launch the program renders for
vLLM 0.33.0 and runs the stand-in model server as the release would run: a multi-node head that
waits for its members, a `--headless` member that serves no HTTP, and vLLM's own launch errors.
Nothing is served: the model server's command line is what is checked."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from labkit.images import imagebin, standins
from qwen_cluster import config
from qwen_cluster.render import vllm
from tooling import stackfile

LAB = {"clock": 0.5, "nodes": {"192.168.1.100": "master", "192.168.1.101": "worker-1"}}


def run(argv: list[str], ip: str, monkeypatch) -> list[str]:
    monkeypatch.setenv("VLLM_HOST_IP", ip)
    assert imagebin._launch_error(argv) is None
    return imagebin.model_server_argv(argv, LAB)


def pipeline_cluster() -> config.ClusterConfig:
    raw = stackfile.read("onprem")
    raw["qwen-cluster:model"] = {**raw["qwen-cluster:model"], "pipelineParallel": 2}
    return config.validate(stackfile.cluster_keys(raw))


def rendered(node: str) -> list[str]:
    script = vllm.server_script(pipeline_cluster(), node)
    return shlex.split(script.removeprefix("exec "))[1:]  # the words after `vllm`


def test_the_rendered_head_waits_for_its_member_at_the_master_port(monkeypatch):
    argv = run(rendered("master"), "192.168.1.100", monkeypatch)
    assert argv[argv.index("--node") + 1] == "master"
    assert argv[argv.index("--port") + 1] == "5000"
    assert argv[argv.index("--master-port") + 1] == "6010" and argv[argv.index("--members") + 1] == "1"
    assert argv[argv.index("--shutdown-timeout") + 1] == "30"  # 60 s on the lab clock of 1/2


def test_the_rendered_headless_member_serves_no_http_and_joins_the_head(monkeypatch):
    argv = run(rendered("worker-1"), "192.168.1.101", monkeypatch)
    assert argv[argv.index("--node") + 1] == "worker-1"
    assert argv[argv.index("--join") + 1] == "192.168.1.100:6010"
    assert "--port" not in argv


def test_the_stand_in_refuses_what_vllm_refuses(capsys):
    assert imagebin.vllm(["serve", "m", "--nnodes=2", "--distributed-executor-backend=ray"]) == 1
    assert "nnodes > 1 can only be set when distributed executor backend is mp" in capsys.readouterr().err
    assert imagebin.vllm(["serve", "m", "--nnodes=2", "--node-rank=2"]) == 1
    assert imagebin.vllm(["serve", "m", "--headless", "--api-server-count=1"]) == 1


def test_the_lab_knows_which_ports_a_model_container_serves():
    def container(command: str) -> standins.Container:
        image = "vllm/vllm-openai:v0.33.0"
        return standins.Container("r", "c", image, ["bash", "-c"], [command], {}, {}, {}, {}, None, 0)

    assert standins.serves(container(" ".join(["exec", "vllm", *rendered("master")]))) == [5000, 6010]
    assert standins.serves(container(" ".join(["exec", "vllm", *rendered("worker-1")]))) == []
    single = vllm.server_script(stackfile.load("onprem"), "master")
    assert standins.serves(container(single)) == [5000]


def test_the_labs_ray_leaves_a_raylet_the_rendered_worker_watches_and_ray_stop_ends(monkeypatch, tmp_path):
    import subprocess

    from tests.helpers.wait import wait_until

    monkeypatch.setenv(imagebin.RAY_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert imagebin.ray(["start", "--address=10.0.0.1:6000"]) == 0
    raylet = int((tmp_path / "raylet.pid").read_text())
    assert Path(f"/proc/{raylet}/comm").read_text().strip() == "raylet"
    # This machine's /proc is every namespace's: the watch looks at this raylet only.
    watch = vllm.RAYLET_WATCH.replace("sleep 5", "sleep 0.05").replace("/proc/[0-9]*/", f"/proc/{raylet}/")
    assert watch != vllm.RAYLET_WATCH.replace("sleep 5", "sleep 0.05")
    worker = subprocess.Popen(["bash", "-c", watch], stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):  # the watch runs as long as the raylet
            worker.wait(timeout=0.3)
        assert imagebin.ray(["stop"]) == 0
        exit_code = wait_until(worker.poll, what="the worker's exit after `ray stop`", timeout=10)
        assert exit_code == 1 and "raylet is gone" in worker.stderr.read()
    finally:
        worker.kill()


def test_the_labs_ray_refuses_the_client_server_port_without_grpcio(capsys, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert imagebin.ray(["start", "--head", "--ray-client-server-port=6008"]) == 1
    assert "ray[client]" in capsys.readouterr().err
