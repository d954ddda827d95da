"""vLLM's own multi-node launch, for real: a replica of two nodes (model.pipelineParallel 2) run
by vLLM's CPU build (labkit/models/realvllm.py) as the program registers its two containers
(components/baremetal/serving.py: the head's `vllm serve --nnodes 2 --node-rank 0 ...`, the
member's `vllm serve --headless ... --node-rank 1` under its head's watch), each on a loopback
address of its own, with the lab's real `vllm` first on PATH (realvllm.CPU_CHANGES).

It serves a chat across the two pipeline stages; and when its head dies, the member stops
instead of waiting forever for it (qwen_cluster/render/vllm.py HEAD_CONNECTED says why).
~35-80 s to healthy on a quiet machine (two process trees, each importing torch); the listeners
of such a replica, in the lab's namespaces, are in docs/lab.md ("A replica across two nodes").
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

from components.baremetal import serving
from labkit.models import realvllm
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import vllm
from tests.helpers import serving_scenario as scenario
from tests.helpers.configs import BASE_BARE_METAL
from tests.helpers.wait import wait_until

ROOT = Path(__file__).resolve().parent.parent
# Bounds for a busy machine (several agents on 2 cores): a quiet start is ~35-80 s.
HEALTHY_TIMEOUT = 600
# The member's watch looks every vllm.HEAD_WATCH_SECONDS; then vLLM's own stop.
MEMBER_EXIT_TIMEOUT = 120


def stack() -> ClusterConfig:
    raw = copy.deepcopy(BASE_BARE_METAL)
    net = f"127.78.{os.getpid() % 250}"
    raw["nodes"] = [
        {"name": "master", "ip": f"{net}.10", "role": "master"},
        {"name": "worker-1", "ip": f"{net}.11"},
    ]
    raw["network"]["cidr"] = f"{net}.0/24"
    raw["model"] = {"pipelineParallel": 2}
    # Gloo's interface, named (the finder looks for an interface holding the node's address, and
    # these loopback addresses are only routed to lo, not held by it).
    raw["bareMetal"] = {**raw["bareMetal"], "interface": "lo"}
    return ClusterConfig.model_validate(raw)


def start(cluster: ClusterConfig, node: str, bin_dir: Path, log: Path) -> subprocess.Popen:
    """The model container the program registers for `node`, as a process group."""
    spec = serving.model_container_spec(cluster, next(n for n in cluster.nodes if n.name == node))
    env = dict(entry.split("=", 1) for entry in spec["envs"])
    env["PATH"] = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"
    env["HOME"] = os.environ.get("HOME", "/root")
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*spec["entrypoints"], *spec["command"]],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_a_replica_spanning_two_nodes_serves_and_its_member_stops_when_the_head_dies(tmp_path):
    cluster = stack()
    bin_dir = tmp_path / "bin"
    realvllm.write_launcher(bin_dir, realvllm.ensure_venv(), realvllm.ensure_model())
    member = start(cluster, "worker-1", bin_dir, tmp_path / "member.log")
    head = start(cluster, "master", bin_dir, tmp_path / "head.log")
    host, port = vllm.listen_address(cluster, "master"), cluster.topology.model_port
    try:
        scenario.observe_loading(host, port, head, HEALTHY_TIMEOUT)
        assert member.poll() is None, "the member exited while its head loaded"
        body = {
            "model": cluster.model.name,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        request = urllib.request.Request(
            f"http://{host}:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            reply = json.load(answer)
        assert reply["choices"][0]["finish_reason"] == "length"
        # Both stages took part: the member's worker ran pipeline rank 1 of the head's world.
        assert "PP rank 1" in (tmp_path / "member.log").read_text(errors="replace")

        os.killpg(head.pid, signal.SIGKILL)  # a crash: nothing of the head is left to say goodbye
        status = wait_until(
            member.poll,
            what="the member exits after its head died",
            timeout=MEMBER_EXIT_TIMEOUT,
            done=lambda code: code is not None,
        )
        assert status == 1
        assert "is gone" in (tmp_path / "member.log").read_text(errors="replace")
    except BaseException as error:
        tails = "".join(
            f"\n--- {name} (tail) ---\n{(tmp_path / name).read_text(errors='replace')[-3000:]}"
            for name in ("head.log", "member.log")
        )
        raise AssertionError(f"{error}{tails}") from error
    finally:
        scenario.kill_group(head)
        scenario.kill_group(member)
