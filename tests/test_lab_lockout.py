"""No lock-out, rehearsed: the lab's deployer (its ssh starts in the admin vantage) applies a
stack whose access.adminCidrs leaves its address out (the outsider's instead). On day 0 every
host stops at preflight and nothing changes; on day 2 (a running cluster, adminCidrs moved away)
no host firewall changes. Either way the deployer still reaches every node over SSH
(qwen_cluster/render/firewall.py deployer_check; the unit tests are tests/test_lockout.py).
Two of onprem's hosts (NODES): every check holds host by host."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest

from labkit.cluster import blueprint, lifecycle
from labkit.engine import executor
from labkit.hosts import netns, sshd
from qwen_cluster.ports import Vantage

LABEL = f"lo{os.getpid() % 100000}"
NODES = 2
BINARIES = ("ip", "nginx", "ufw")
MISSING = (
    netns.missing_requirements()
    + sshd.missing_requirements()
    + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
)
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")


def failed(report) -> dict[str, str]:
    return {step.resource: step.detail for step in report.steps if not step.ok}


def reaches_every_node(lab_plan, options) -> dict[str, int]:
    """The deployer's ssh (admin vantage) to each node: exit codes of `true`."""
    client = lifecycle.ssh_client(lab_plan)
    identity = lifecycle.ssh_identity(lab_plan, options)
    return {
        member.node: client.run(
            user=identity.user,
            ip=member.ip,
            command="true",
            host_key=identity.host_keys[member.node],
            timeout=30,
        ).returncode
        for member in lab_plan.nodes
    }


def firewall_document(lab_plan, member) -> dict | None:
    path = Path(lifecycle.node_state(lab_plan, member)) / "firewall.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_deployer_outside_admin_cidrs_is_stopped_before_any_firewall_change_and_keeps_ssh():
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=NODES, label=LABEL)
    options = lifecycle.Options()
    deployer = lab_plan.vantage(Vantage.ADMIN)
    outsider = lab_plan.vantage(Vantage.OUTSIDER)
    elsewhere = copy.deepcopy(lifecycle.stack_config(lab_plan))
    elsewhere["qwen-cluster:access"]["adminCidrs"] = [f"{outsider.ip}/32"]
    nodes = [member.node for member in lab_plan.nodes]
    try:
        # Day 0, deploying from outside the stack's adminCidrs: every host stops at preflight.
        day0 = lifecycle.apply(lab_plan, options, config=elsewhere)
        stopped = failed(day0)
        assert set(stopped) == {f"{node}-preflight" for node in nodes}, stopped
        for member in lab_plan.nodes:
            detail = stopped[f"{member.node}-preflight"]
            assert (
                f"preflight on {member.node} ({member.ip}): FAILED: this deploy connects from {deployer.ip}, "
                f"which access.adminCidrs ({outsider.ip}/32) does not admit to SSH"
            ) in detail
            assert firewall_document(lab_plan, member) is None  # no firewall was applied
            assert not (Path(lifecycle.node_etc(member)) / "sysctl.d" / "90-qwen-cluster.conf").exists()
        created = {name: r.type for name, r in day0.applied.state.items()}
        assert not [n for n, kind in created.items() if kind in (executor.COMMAND, executor.CONTAINER)]
        assert reaches_every_node(lab_plan, options) == dict.fromkeys(nodes, 0)

        # From inside adminCidrs the same lab comes up.
        up = lifecycle.up(lab_plan, options)
        assert up.ok, failed(up)
        before = {member.node: firewall_document(lab_plan, member) for member in lab_plan.nodes}
        assert all(before.values())

        # Day 2: adminCidrs moved away from the deployer. No firewall changes anywhere.
        day2 = lifecycle.apply(lab_plan, options, config=elsewhere)
        stopped = failed(day2)
        assert stopped and set(stopped) <= {
            f"{node}-{step}" for node in nodes for step in ("preflight", "firewall")
        }
        for resource, detail in stopped.items():
            assert f"this deploy connects from {deployer.ip}, which access.adminCidrs" in detail, resource
            assert "Nothing was changed." in detail
        assert {member.node: firewall_document(lab_plan, member) for member in lab_plan.nodes} == before
        assert reaches_every_node(lab_plan, options) == dict.fromkeys(nodes, 0)
    finally:
        lifecycle.down(LABEL)
