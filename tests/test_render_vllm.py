"""The one vLLM command (qwen_cluster/render/vllm.py) and its config: `model.vllmFlags`, `rollout`."""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys

import pytest

from components.baremetal import serving
from qwen_cluster import config
from qwen_cluster.config import ConfigError
from qwen_cluster.render import ssm, vllm
from tests.helpers.aws_stacks import variant
from tests.helpers.wait import wait_until
from tooling import stackfile


def cluster_of(stack_config) -> config.ClusterConfig:
    return config.validate(stackfile.cluster_keys(stack_config))


def with_flags(flags, stack: str = "dev") -> dict:
    return variant(stack, model={"vllmFlags": flags})


def errors_of(stack_config) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        cluster_of(stack_config)
    return caught.value.errors


def test_qwen3_defaults_separate_thinking_and_bound_the_context():
    argv = vllm.serve_argv(stackfile.load("dev"))
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    assert "--reasoning-parser=qwen3" in argv
    assert "--max-model-len=32768" in argv
    assert "--served-model-name=Qwen/Qwen3-32B" in argv


def test_owned_flags_come_from_the_config():
    argv = vllm.serve_argv(stackfile.load("prod"))
    assert argv[3:8] == [
        "--host=127.0.0.1",
        "--port=5000",
        "--tensor-parallel-size=8",
        "--pipeline-parallel-size=1",
        "--gpu-memory-utilization=0.9",
    ]
    assert not any(arg.startswith("--distributed-executor-backend") for arg in argv)


def test_on_aws_vllm_listens_on_loopback_behind_the_node_proxy():
    cluster = stackfile.load("dev")
    assert {vllm.listen_address(cluster, node.name) for node in cluster.nodes} == {"127.0.0.1"}


def test_on_bare_metal_vllm_listens_on_the_node_address_only():
    cluster = stackfile.load("onprem")
    for node in cluster.nodes:
        assert f"--host={node.ip}" in vllm.serve_argv(cluster, node.name)


def test_stack_flags_override_defaults_add_switches_and_drop_with_false():
    cluster = cluster_of(
        with_flags({"--max-model-len": 16384, "--enable-prefix-caching": True, "--reasoning-parser": False})
    )
    argv = vllm.serve_argv(cluster)
    assert "--max-model-len=16384" in argv and "--max-model-len=32768" not in argv
    assert "--enable-prefix-caching" in argv
    assert not any(arg.startswith("--reasoning-parser") for arg in argv)


def test_flag_values_survive_the_shell():
    cluster = cluster_of(with_flags({"--hf-overrides": '{"rope_parameters": {"factor": 4.0}}'}))
    script = vllm.server_script(cluster, "master")
    assert '--hf-overrides={"rope_parameters": {"factor": 4.0}}' in shlex.split(script.removeprefix("exec "))


@pytest.mark.parametrize(
    ("flag", "value", "source"),
    [
        ("--port", 8080, "ports (the clients entry)"),
        ("--host", "127.0.0.1", "the program"),
        ("--tensor-parallel-size", 2, "model.tensorParallel"),
        ("--pipeline-parallel-size", 2, "model.pipelineParallel"),
        ("--gpu-memory-utilization", 0.95, "GPU_MEMORY_UTILIZATION"),
        ("--distributed-executor-backend", "mp", "model.distributedBackend"),
        ("--served-model-name", "other", "model.name"),
        ("--nnodes", 2, "model.pipelineParallel"),
        ("--node-rank", 1, "member order"),
        ("--master-addr", "10.0.0.1", "head's address"),
        ("--master-port", 29501, "ports (the cluster entry"),
        ("--headless", True, "the topology"),
        ("--api-server-count", 0, "the topology"),
    ],
)
def test_owned_flags_are_refused_naming_key_and_value(flag, value, source):
    (error,) = errors_of(with_flags({flag: value}))
    assert error.startswith(f"model.vllmFlags {flag} {value!r} is set by the program from ")
    assert source in error


# The other names vLLM 0.33.0's parser gives the owned flags (vllm/engine/arg_utils.py,
# vllm/entrypoints/common/cli_args.py), its underscore spelling, and argparse's prefixes.
@pytest.mark.parametrize(
    ("alias", "value", "canonical"),
    [
        ("--device-memory-utilization", 0.99, "--gpu-memory-utilization"),
        ("-tp", 2, "--tensor-parallel-size"),
        ("-pp", 2, "--pipeline-parallel-size"),
        ("-dp", 2, "--data-parallel-size"),
        ("-n", 2, "--nnodes"),
        ("-r", 1, "--node-rank"),
        ("-asc", 0, "--api-server-count"),
        ("--gpu_memory_utilization", 0.99, "--gpu-memory-utilization"),
        ("--served_model_name", "other", "--served-model-name"),
        ("--tensor_parallel_size", 2, "--tensor-parallel-size"),
    ],
)
def test_aliases_of_owned_flags_are_refused_naming_the_flag_vllm_reads(alias, value, canonical):
    (error,) = errors_of(with_flags({alias: value}))
    assert error.startswith(f"model.vllmFlags {alias} {value!r} is read by vLLM as {canonical}, which ")


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--config", "/etc/vllm.yaml", "loads any flag"),
        ("--uds", "/run/vllm.sock", "ignore --host and --port"),
        ("--grpc", True, "gRPC on --port"),
        ("--grpc-port", 6050, "another listener"),
        ("--kv-cache-memory-bytes", "8G", "replaces --gpu-memory-utilization"),
    ],
)
def test_indirections_of_owned_flags_are_refused(flag, value, why):
    (error,) = errors_of(with_flags({flag: value}))
    assert error.startswith(f"model.vllmFlags {flag} {value!r} ") and why in error
    assert error.endswith("settings the program owns; remove it")


@pytest.mark.parametrize(
    ("prefix", "whole"), [("--gpu-memory", "--gpu-memory-utilization"), ("--head", "--headless")]
)
def test_a_prefix_argparse_completes_to_an_owned_flag_is_refused(prefix, whole):
    (error,) = errors_of(with_flags({prefix: 1}))
    assert f"{prefix} 1 abbreviates {whole}" in error


def test_flags_no_owned_flag_starts_with_pass():
    cluster = cluster_of(with_flags({"--max-model-len": 8192, "--data-parallel-size-local": 1}))
    assert "--max-model-len=8192" in vllm.serve_argv(cluster)


def test_flags_are_long_dashed_names():
    (error,) = errors_of(with_flags({"max_model_len": 4096}))
    assert error == "model.vllmFlags 'max_model_len' is not a long vLLM flag (write it as '--max-model-len')"


def test_a_flag_takes_one_value():
    (error,) = errors_of(with_flags({"--allowed-origins": ["a", "b"]}))
    assert "--allowed-origins ['a', 'b']: give one value" in error


def test_both_targets_run_the_same_command():
    onprem = stackfile.load("onprem")
    node = onprem.nodes[1]
    script, env = serving.server_command(onprem, node)
    assert script.endswith(vllm.server_script(onprem, node.name))
    assert env["VLLM_HOST_IP"] == str(node.ip) and "VLLM_PORT" not in env
    prod = stackfile.load("prod")
    parameters = ssm.parameters(prod, "worker-1")
    assert ssm.decoded(parameters["ServerScript"]) == vllm.server_script(prod, "worker-1")


def test_a_flag_change_changes_the_command_on_both_targets():
    for stack in ("dev", "onprem"):
        before = stackfile.load(stack)
        after = cluster_of(with_flags({"--enable-prefix-caching": True}, stack))
        assert vllm.server_script(before, "master") != vllm.server_script(after, "master")


def pipeline(**model) -> config.ClusterConfig:
    return cluster_of(variant("prod", model={"pipelineParallel": 2, **model}))


def test_pipeline_parallel_replicas_use_vllms_own_multinode_launch_by_default():
    cluster = pipeline()
    master = cluster.topology.ports.vllm_master
    head = shlex.split(vllm.server_script(cluster, "master").removeprefix("exec "))
    worker = vllm.headless_argv(cluster, "worker-1")
    # The member runs that line under the watch of its head (test_a_member_stops_when_its_head_is_gone).
    assert vllm.server_script(cluster, "worker-1") == vllm.member_script(worker, "10.50.1.100", master)
    assert head[:3] == worker[:3] and head[:2] == ["vllm", "serve"]
    launch = ["--distributed-executor-backend=mp", "--nnodes=2", "--master-addr=10.50.1.100"]
    launch.append(f"--master-port={master}")
    for flag in launch:
        assert flag in head and flag in worker
    assert "--node-rank=0" in head and "--node-rank=1" in worker
    # The head serves the API; the member after it is headless: no HTTP, no host or port.
    assert "--port=5000" in head and "--headless" not in head
    assert "--headless" in worker and not [arg for arg in worker if arg.startswith(("--port", "--host"))]
    # Both build the same engine: the same engine flags apart from rank, host and port.
    def engine(argv):
        return [a for a in argv if not a.startswith(("--node-rank", "--host", "--port", "--headless"))]

    assert engine(head) == engine(worker)
    assert "ray" not in vllm.server_script(cluster, "master") + vllm.server_script(cluster, "worker-1")


def _member_under_watch(tmp_path, head: socket.socket, port: int) -> subprocess.Popen:
    """member_script over a stand-in for `vllm serve --headless`: a process that connects to the
    head's port and holds the connection, as a worker holds the head's TCPStore; it records the
    SIGTERM it gets and then exits 0."""
    term = str(tmp_path / "term")
    holder = (
        "import signal, socket, sys, time\n"
        f"s = socket.create_connection(('127.0.0.1', {port}))\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (open({term!r}, 'w').close(), sys.exit(0)))\n"
        "while True: time.sleep(1)\n"
    )
    script = vllm.member_script([sys.executable, "-c", holder], "127.0.0.1", port)
    script = script.replace(f"sleep {vllm.HEAD_WATCH_SECONDS} ", "sleep 0.1 ")
    with open(tmp_path / "stderr", "w") as stderr:
        return subprocess.Popen(["bash", "-c", script], stderr=stderr, text=True)


def _joined(tmp_path) -> None:
    """The watch has seen the connection (it arms itself only then)."""
    wait_until(lambda: "joined its head" in (tmp_path / "stderr").read_text(), what="joined", timeout=20)


def _listening() -> tuple[socket.socket, int]:
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen()
    return head, head.getsockname()[1]


def test_a_member_stops_when_its_head_is_gone(tmp_path):
    """The real member waits forever for a head that has gone (HEAD_CONNECTED says why): the
    watch stops it once its connection to the head's master port ends, and exits 1."""
    head, port = _listening()
    member = _member_under_watch(tmp_path, head, port)
    try:
        connection, _ = head.accept()
        _joined(tmp_path)
        assert member.poll() is None
        connection.close()
        head.close()
        status = wait_until(
            member.poll, what="exits when its head is gone", timeout=20, done=lambda c: c is not None
        )
        assert status == 1 and "is gone" in (tmp_path / "stderr").read_text()
        assert (tmp_path / "term").exists()  # the member was stopped, not left behind
    finally:
        member.kill()
        head.close()


def test_a_member_passes_docker_stop_on_and_exits_with_it(tmp_path):
    head, port = _listening()
    member = _member_under_watch(tmp_path, head, port)
    try:
        connection, _ = head.accept()
        _joined(tmp_path)
        member.send_signal(signal.SIGTERM)
        status = wait_until(
            member.poll, what="the member exits on SIGTERM", timeout=20, done=lambda code: code is not None
        )
        assert status == 0 and (tmp_path / "term").exists()
        connection.close()
    finally:
        member.kill()
        head.close()


def test_the_master_port_is_pinned_inside_the_cluster_range():
    cluster = pipeline()
    assert cluster.topology.ports.vllm_master in range(6000, 6101)


def test_no_vllm_port_variable_is_claimed_to_pin_anything():
    cluster = pipeline()
    for node in cluster.nodes:
        assert vllm.environment(cluster, node.name) == {"VLLM_HOST_IP": str(node.ip)}


def test_ray_with_the_official_image_is_refused_naming_the_key():
    (error,) = errors_of(variant("prod", model={"pipelineParallel": 2, "distributedBackend": "ray"}))
    assert error.startswith("model.distributedBackend 'ray' cannot start in model.image vllm/vllm-openai:")


def test_ray_stays_for_an_image_that_carries_it():
    cluster = pipeline(distributedBackend="ray", image="registry.example/vllm-with-ray:v0.33.0")
    pinned = cluster.topology.ports
    head = vllm.server_script(cluster, "master")
    worker = vllm.server_script(cluster, "worker-1")
    assert head.startswith("ray start --node-ip-address=10.50.1.100 --head")
    assert f"--port={pinned.gcs}" in head and "--distributed-executor-backend=ray" in head
    assert " && exec vllm serve " in head  # vLLM only once the Ray head is up
    assert "--nnodes" not in head  # vLLM refuses nnodes > 1 with the Ray executor
    assert "ray-client-server-port" not in head + worker  # would need ray[client] (grpcio)
    # The worker does not block in `ray start` (it outlives `ray stop`): it exits with its raylet.
    assert "--block" not in worker
    assert worker == (
        "ray start --node-ip-address=10.50.1.101 "
        + " ".join(pinned.ray_start_args(head=False, head_ip="10.50.1.100"))
        + " && "
        + vllm.RAYLET_WATCH
    )
    env = vllm.environment(cluster, "worker-1")
    assert env["RAY_ADDRESS"] == f"10.50.1.100:{pinned.gcs}"
    assert env["AUTOSCALER_METRIC_PORT"] == str(pinned.autoscaler_metrics)
    assert env["DASHBOARD_METRIC_PORT"] == str(pinned.dashboard_metrics)


def test_a_ray_worker_exits_when_its_raylet_is_gone(tmp_path):
    """The watch, run against a fake /proc: it loops while a `raylet` runs, exits 1 after."""
    import subprocess

    watch = vllm.RAYLET_WATCH.replace("/proc/", f"{tmp_path}/proc/").replace("sleep 5", "sleep 0.05")
    (tmp_path / "proc" / "7").mkdir(parents=True)
    (tmp_path / "proc" / "7" / "comm").write_text("bash\n")
    done = subprocess.run(["bash", "-c", watch], capture_output=True, text=True, timeout=10)
    assert done.returncode == 1 and "raylet is gone" in done.stderr
    (tmp_path / "proc" / "8").mkdir()
    (tmp_path / "proc" / "8" / "comm").write_text("raylet\n")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(["bash", "-c", watch], capture_output=True, timeout=0.5)


def test_rollout_defaults_and_bounds():
    cluster = stackfile.load("dev")
    assert (cluster.rollout.drain_timeout_seconds, cluster.rollout.health_timeout_seconds) == (300, 1800)
    (error,) = errors_of(variant("dev", rollout={"healthTimeoutSeconds": 10}))
    assert error.startswith("rollout.healthTimeoutSeconds 10: ")
    (error,) = errors_of(variant("dev", rollout={"drainTimeout": 10}))
    assert error == "rollout.drainTimeout is not a known key"


# --- the pinned release (config.DEFAULT_IMAGE) and its graceful shutdown ---------------------


def test_the_default_image_is_the_current_release():
    assert config.DEFAULT_IMAGE == "vllm/vllm-openai:v0.33.0"
    assert stackfile.load("onprem").model.image == config.DEFAULT_IMAGE


def test_vllm_drains_on_sigterm_with_its_own_shutdown_timeout():
    argv = vllm.serve_argv(stackfile.load("dev"))
    assert "--shutdown-timeout=60" in argv


@pytest.mark.parametrize(
    "flag",
    # Spellings the current release does not define: an unknown flag stops `vllm serve` at start.
    [
        "--model",
        "--shutdown-mode",
        "--shutdown-drain-timeout",
        "--enable-graceful-shutdown",
        "--drain-timeout",
    ],
)
def test_no_flag_the_release_lacks_is_rendered(flag):
    for stack in ("dev", "prod", "onprem"):
        assert not any(word.split("=")[0] == flag for word in vllm.serve_argv(stackfile.load(stack)))


def test_the_stop_grace_outlasts_vllms_shutdown_timeout():
    cluster = stackfile.load("dev")
    assert vllm.stop_grace_seconds(cluster) == 60 + vllm.STOP_MARGIN_SECONDS
    longer = cluster_of(with_flags({"--shutdown-timeout": 600}))
    assert vllm.stop_grace_seconds(longer) == 600 + vllm.STOP_MARGIN_SECONDS


def test_dropping_the_shutdown_flag_for_an_older_image_leaves_the_margin():
    cluster = cluster_of(with_flags({"--shutdown-timeout": False}))
    assert not any(word.startswith("--shutdown-timeout") for word in vllm.serve_argv(cluster))
    assert vllm.stop_grace_seconds(cluster) == vllm.STOP_MARGIN_SECONDS


def test_a_bare_metal_container_stops_within_the_grace_on_every_stop():
    cluster = stackfile.load("onprem")
    spec = serving.model_container_spec(cluster, cluster.master)
    grace = vllm.stop_grace_seconds(cluster)
    assert spec["stop_timeout"] == grace and spec["destroy_grace_seconds"] == grace


def test_the_aws_run_stops_the_old_container_within_the_grace_before_removing_it():
    cluster = stackfile.load("dev")
    assert ssm.parameters(cluster, "master")["StopSeconds"] == str(vllm.stop_grace_seconds(cluster))
    script = ssm.run_script()
    stop = script.index("docker stop --time='{{ StopSeconds }}' qwen-vllm")
    assert stop < script.index("docker rm --force qwen-vllm")
