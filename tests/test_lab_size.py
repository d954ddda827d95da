"""A lab knows its own size: the node count it was brought up with is in its state, and every
command works on the lab as it is; one given another count refuses in one line."""

from __future__ import annotations

import json
import subprocess

import pytest

from labkit import cli as lab_cli
from labkit.cluster import blueprint, lifecycle
from labkit.hosts import netns


@pytest.fixture
def state_root(tmp_path, monkeypatch):
    """A state root of the test's own; the marker of what labs share points there too."""
    monkeypatch.setattr(lifecycle, "STATE_ROOT", str(tmp_path))
    monkeypatch.setattr(lifecycle, "ETC_MARKER", tmp_path / "created-etc-netns")
    return tmp_path


def _recorded(label: str, count: int) -> None:
    lifecycle.record_size(blueprint.load("onprem", nodes=count, label=label))


def test_a_lab_not_up_takes_the_count_given_or_the_stack_files(state_root):
    assert lifecycle.recorded_nodes("sz") is None
    assert lifecycle.nodes_for("sz", None) is None and lifecycle.nodes_for("sz", 8) == 8


def test_a_lab_up_with_two_nodes_is_planned_with_two_without_nodes_given(state_root):
    _recorded("sz", 2)
    assert lifecycle.nodes_for("sz", None) == 2 and lifecycle.nodes_for("sz", 2) == 2
    planned = lab_cli.lab_plan_for("onprem", label="sz")
    assert [member.node for member in planned.nodes] == ["master", "worker-1"]


def test_another_count_than_the_labs_is_refused_in_one_line(state_root, capsys):
    _recorded("sz", 2)
    with pytest.raises(lifecycle.SizeError, match="^lab sz is up with 2 nodes, not --nodes 4: leave"):
        lifecycle.nodes_for("sz", 4)
    for command in ("check", "up", "run"):
        assert lab_cli.main([command, "onprem", "--label", "sz", "--nodes", "4"]) == 2
        printed = capsys.readouterr().out.strip()
        assert printed.startswith("lab sz is up with 2 nodes, not --nodes 4") and "\n" not in printed


def test_a_lab_recorded_before_its_size_file_reads_the_config_it_applied(state_root):
    applied = lifecycle.state_file_for("old")
    applied.parent.mkdir(parents=True)
    nodes = [
        {"name": "master", "ip": "192.168.1.100", "role": "master"},
        {"name": "worker-1", "ip": "192.168.1.101"},
    ]
    applied.write_text(json.dumps({"config": {"qwen-cluster:nodes": nodes}, "render": {}}))
    assert lifecycle.recorded_nodes("old") == 2


@pytest.mark.skipif(
    bool(netns.missing_requirements()), reason="; ".join(netns.missing_requirements()) or "ok"
)
def test_down_removes_every_namespace_of_a_lab_larger_than_its_stack_file(state_root):
    """onprem has four nodes; a lab of eight holds worker-4..7 too: down finds them all."""
    label = "szdown"
    _recorded(label, 8)
    # Another lab's state beside it: down leaves what labs share (the lab users, /etc/netns) to the
    # last lab, and the machine's real labs must keep them.
    (state_root / "another-lab").mkdir()
    names = [
        f"{blueprint.namespace_prefix(label)}{name}" for name in ("switch", "node-master", "node-worker-7")
    ]
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert sorted(lifecycle.down(label)) == sorted(names)
        assert not [name for name in netns.listed() if name in names]
        assert lifecycle.recorded_nodes(label) is None  # the size goes with the lab
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
