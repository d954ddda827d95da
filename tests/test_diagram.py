"""The cluster diagram shows every flow of the exposure list, with its ports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qwen_cluster.config import validate
from tests.helpers.configs import nodes
from tooling import stackfile
from tooling.diagram import MAX_DRAWN_NODES, diagram


def test_onprem_diagram_draws_nodes_lb_and_flows():
    source = diagram(stackfile.load("onprem"), title="onprem").source
    for node in ("master", "worker-1", "worker-2", "worker-3"):
        assert f'"n-{node}"' in source or f"n-{node} " in source
    assert "nginx on master" in source
    assert 'clients -> lb [label="80/tcp"]' in source
    assert source.count('label="5000/tcp"') == 4  # the LB to every replica head
    assert 'label="8000/tcp"' in source and 'label="22/tcp"' in source
    assert "all traffic, members only" in source


def test_aws_diagram_names_the_nlb_and_the_instance_type():
    source = diagram(stackfile.load("prod")).source
    assert "Network Load Balancer (internal)" in source
    assert "p5.48xlarge, 3200 Gbit/s EFA" in source


def test_large_clusters_collapse_into_one_box(aws_raw):
    aws_raw["nodes"] = nodes(MAX_DRAWN_NODES + 1, prefix="192.168.")
    aws_raw["network"]["cidr"] = "192.168.0.0/17"
    source = diagram(validate(aws_raw)).source
    assert f"{MAX_DRAWN_NODES + 1} nodes" in source and "n-worker-1" not in source


@pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's dot is not installed (make system installs it)"
)
def test_diagram_renders_to_svg(tmp_path):
    path = diagram(stackfile.load("dev")).render(tmp_path / "dev", format="svg", cleanup=True)
    assert Path(path).read_text().lstrip().startswith("<?xml")
