"""Bare metal over real SSH (root, network namespaces): every registered command reaches each
node's own sshd as the stack's user, elevated with sudo -n; a user without sudo, a wrong pinned
host key and a docker daemon that stops answering are each refused before anything changes.

One lab for the module, reached as the sudo user; the refusals run their own short-lived labs.
Each lab has two of onprem's hosts (NODES: the master, which is the load balancer's node, and a
worker): every check here holds host by host, and a node more only costs the suite time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from labkit.cluster import blueprint, lifecycle, upgrade
from labkit.engine import executor
from labkit.hosts import netns, sshd
from qwen_cluster.ports import Vantage
from qwen_cluster.render import nginx
from tooling import hostkeys, stackfile

LABEL = f"s{os.getpid() % 100000}"
NODES = 2
BINARIES = ("ip", "nginx", "ufw")
MISSING = (
    netns.missing_requirements()
    + sshd.missing_requirements()
    + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
)
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")


def failures(report) -> list[tuple[str, str]]:
    return [(step.resource, step.detail[-400:]) for step in report.steps if not step.ok]


@pytest.fixture(scope="module")
def running():
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=NODES, label=LABEL)
    options = lifecycle.Options()
    try:
        report = lifecycle.up(lab_plan, options)
        assert report.ok, failures(report)
        yield lab_plan, options, report
    finally:
        lifecycle.down(LABEL)


def test_every_command_ran_over_ssh_as_the_sudo_user(running):
    lab_plan, _, report = running
    assert "bareMetal.sshUser ubuntu -> qcl-deploy (the lab's user)" in report.notes
    for member in lab_plan.nodes:
        log = (lifecycle.ssh_dir(lab_plan) / member.node / "sshd.log").read_text()
        assert f"Accepted publickey for {sshd.DEPLOY_USER}" in log
        # sudo ran the scripts as root: the drop-in they install is root's, mode 0644.
        dropin = Path(lifecycle.node_etc(member)) / "sysctl.d" / "90-qwen-cluster.conf"
        assert (dropin.stat().st_uid, oct(dropin.stat().st_mode & 0o777)) == (0, "0o644")
    preflight = next(s for s in report.steps if s.resource == "worker-1-preflight")
    assert "qcl-deploy reaches docker" in preflight.detail


def test_a_user_without_sudo_fails_preflight_on_every_host_and_nothing_changes():
    label = f"{LABEL}p"
    lifecycle.down(label)
    lab_plan = blueprint.load("onprem", nodes=NODES, label=label)
    try:
        report = lifecycle.up(lab_plan, lifecycle.Options(ssh_user=sshd.PLAIN_USER))
        failed = {step.resource: step.detail for step in report.steps if not step.ok}
        assert set(failed) == {f"{member.node}-preflight" for member in lab_plan.nodes}, failed
        for member in lab_plan.nodes:
            detail = failed[f"{member.node}-preflight"]
            where = f"preflight on {member.node} ({member.ip})"
            assert f"{where}: FAILED: {sshd.PLAIN_USER} cannot run sudo" in detail
            assert "Set bareMetal.sshUser to root or to a user with passwordless sudo" in detail
            assert "add it to group docker" in detail
        failed = {step.resource: step.detail for step in report.steps if not step.ok}
        # Nothing after preflight ran anywhere: no command or container exists (providers and
        # image pulls, which touch no host, are all that was created).
        created = {name: r.type for name, r in report.applied.state.items()}
        assert not [n for n, kind in created.items() if kind in (executor.COMMAND, executor.CONTAINER)]
        for member in lab_plan.nodes:
            assert not (Path(lifecycle.node_etc(member)) / "sysctl.d" / "90-qwen-cluster.conf").exists()
            assert not list(Path(lifecycle.node_state(lab_plan, member)).glob("*.rules*"))
    finally:
        lifecycle.down(label)


def test_a_wrong_pinned_host_key_is_refused_before_any_command_runs():
    label = f"{LABEL}k"
    lifecycle.down(label)
    lab_plan = blueprint.load("onprem", nodes=NODES, label=label)
    wrong = stackfile.placeholder_host_key("not worker-1")
    try:
        report = lifecycle.up(lab_plan, lifecycle.Options(host_key_overrides={"worker-1": wrong}))
        failed = {step.resource: step.detail for step in report.steps if not step.ok}
        assert "worker-1-preflight" in failed
        assert "ssh: connection failed (exit 255)" in failed["worker-1-preflight"]
        assert "Host key verification failed" in failed["worker-1-preflight"]
        log = (lifecycle.ssh_dir(lab_plan) / "worker-1" / "sshd.log").read_text()
        assert "Accepted publickey" not in log  # the client left before logging in
    finally:
        lifecycle.down(label)


def test_hostkeys_pins_what_each_node_answers_in_the_stack_file(running, tmp_path, capsys):
    lab_plan, _, _ = running
    stack = Path(tmp_path / "Pulumi.onprem.yaml")
    # The stack file with the lab's nodes only (its other lines, comments included, as written).
    names = {member.node for member in lab_plan.nodes}
    written = stackfile.read("onprem")["qwen-cluster:nodes"]
    others = [node["name"] for node in written if node["name"] not in names]
    lines = stackfile.stack_path("onprem").read_text().splitlines(keepends=True)

    def names_another(line: str) -> bool:
        return any(f"name: {other}," in line or line.strip().startswith(f"{other}:") for other in others)

    gone = [line for line in lines if names_another(line)]
    assert len(gone) == 2 * len(others)  # each left out in nodes and in hostKeys
    stack.write_text("".join(line for line in lines if line not in gone))
    deployer = lab_plan.vantage(Vantage.ADMIN).namespace

    def in_the_lab(argv: list[str]) -> subprocess.CompletedProcess:
        argv = ["ip", "netns", "exec", deployer, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    assert hostkeys.main(["onprem", "--write"], run=in_the_lab, root=tmp_path) == 0
    keys = lifecycle.ssh_keys(lab_plan)
    pinned = stackfile.read("onprem", tmp_path)["qwen-cluster:bareMetal"]["hostKeys"]
    assert pinned == {member.node: keys.public_host_key(member.node) for member in lab_plan.nodes}
    assert "(CHANGED)" in capsys.readouterr().out  # the placeholders were replaced
    assert "# Placeholders that no host holds" in stack.read_text()  # comments kept


def test_docker_unreachable_when_staging_stops_the_change_before_any_drain(running):
    """The image bump stages on every node before any lane drains. The load balancer's node
    cannot reach its docker daemon, so its staging fails (it pulls through the daemon): no
    drain starts, the upstream file keeps every server in, no model container is replaced, and
    clients see no failure. With the daemon back the same change converges. (A drain that
    cannot reach nginx's container is tested against a real nginx in test_render_rollout.py.)"""
    lab_plan, options, _ = running
    lb = lab_plan.load_balancer
    upstream = Path(lifecycle.node_state(lab_plan, lb)) / "etc-qwen-cluster" / "nginx" / nginx.UPSTREAM_FILE
    before = upstream.read_text()
    change = ["model.image=vllm/vllm-openai:v0.33.1"]
    lifecycle.docker_daemon_down(lab_plan, lb)  # dockerd killed; its containers keep serving
    try:
        stopped = upgrade.run(LABEL, change, options)
    finally:
        lifecycle.docker_daemon_up(lab_plan, lb)
    failed = {step.resource: step.detail for step in stopped.steps if not step.ok}
    assert set(failed) == {f"{lb.node}-model-stage"}, failed
    assert "Cannot connect to the Docker daemon" in failed[f"{lb.node}-model-stage"]
    assert not [s.resource for s in stopped.steps if s.resource.endswith("-drain")]
    assert upstream.read_text() == before and " down;" not in before
    assert not [s for s in stopped.steps if s.resource.endswith("-vllm") and s.op in ("create", "delete")]
    assert stopped.failed == 0, stopped.failures
    converged = upgrade.run(LABEL, change, options)
    assert converged.ok, failures(converged)
    assert converged.failed == 0 and converged.streams_cut == 0, converged.failures
    assert converged.images == {head.node: "vllm/vllm-openai:v0.33.1" for head in lab_plan.heads}
