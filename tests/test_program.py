"""The whole program under Pulumi mocks: stacks validate, a bad config registers nothing."""

from __future__ import annotations

import pytest

from tooling import offline, stackfile


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_every_stack_file_validates(stack):
    cluster = stackfile.load(stack)
    assert len(cluster.nodes) >= 2


def test_stacks_match_the_design_table():
    dev, prod, onprem = (stackfile.load(s) for s in ("dev", "prod", "onprem"))
    assert (dev.target.value, dev.aws.instance_type, len(dev.nodes)) == ("aws", "g6e.12xlarge", 2)
    assert (prod.target.value, prod.aws.instance_type, len(prod.nodes)) == ("aws", "p5.48xlarge", 4)
    assert onprem.target.value == "bare-metal" and onprem.bare_metal.firewall == "ufw"
    assert [str(n.ip) for n in onprem.nodes] == [
        "192.168.1.100",
        "192.168.1.101",
        "192.168.1.102",
        "192.168.1.103",
    ]
    assert onprem.load_balancer_node.name == "master"
    for cluster in (dev, prod):
        assert len(cluster.topology.replicas) == len(cluster.nodes)


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_a_valid_stack_exports_its_summary(stack):
    render = offline.render_stack(stack)
    assert render.error is None
    assert render.outputs["summary"]["target"] == stackfile.load(stack).target.value


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_a_bad_config_registers_no_resource(stack):
    stack_config = stackfile.read(stack)
    stack_config["qwen-cluster:nodes"] = [{"name": "solo", "ip": "172.16.0.9", "role": "master"}]
    stack_config["qwen-cluster:typo"] = True
    render = offline.render(stack_config, stack)
    assert render.resources == []
    assert "nodes has 1 entries" in render.error
    assert "qwen-cluster:typo is not a known key" in render.error
    assert "nodes[0].ip 172.16.0.9 is outside network.cidr" in render.error


def test_unknown_stack_file_is_named():
    with pytest.raises(FileNotFoundError, match="no stack file Pulumi.staging.yaml"):
        stackfile.read("staging")


def test_dependency_graph_follows_ids_arns_and_depends_on():
    render = offline.Render(
        "t",
        [
            offline.RecordedResource("aws:ec2/vpc:Vpc", "vpc", {}, {"arn": "arn:vpc"}, True),
            offline.RecordedResource(
                "aws:ec2/subnet:Subnet", "subnet", {"vpcId": "vpc-id"}, {"arn": "arn:subnet"}, True
            ),
            offline.RecordedResource(
                "aws:ec2/instance:Instance", "node", {"subnetId": "subnet-id"}, {}, True
            ),
            offline.RecordedResource(
                "aws:lb/targetGroup:TargetGroup", "tg", {"tags": {"x": "arn:vpc"}}, {}, True
            ),
            offline.RecordedResource(
                "command:remote:Command", "verify", {}, {}, True, depends_on=["node", "tg"]
            ),
            offline.RecordedResource("qwen-cluster:aws:Nodes", "group", {}, {}, False),
        ],
        {},
        [],
    )
    assert render.dependencies() == {
        "vpc": set(),
        "subnet": {"vpc"},
        "node": {"subnet"},
        "tg": {"vpc"},
        "verify": {"node", "tg"},
    }
    assert render.critical_path() == ["vpc", "subnet", "node", "verify"]


def _chain_render(edges: dict[str, list[str]], gates: set[str]) -> offline.Render:
    """Commands that depend on each other by name; a name in `gates` is marked as one."""
    return offline.Render(
        "t",
        [
            offline.RecordedResource(
                "command:remote:Command", name, {"gate": name in gates}, {}, True, depends_on=after
            )
            for name, after in edges.items()
        ],
        {},
        [],
    )


def test_the_critical_path_counted_in_gates_is_the_chain_with_the_most_gates():
    # Two lanes: a1 -> g1 -> a2 -> g2 (two gates, four steps) and b1 -> b2 -> b3 -> b4 -> h1
    # (one gate, five steps): by resources the second is longest, by gates the first.
    render = _chain_render(
        {
            "a1": [],
            "g1": ["a1"],
            "a2": ["g1"],
            "g2": ["a2"],
            "b1": [],
            "b2": ["b1"],
            "b3": ["b2"],
            "b4": ["b3"],
            "h1": ["b4"],
        },
        gates={"g1", "g2", "h1"},
    )
    assert render.critical_path() == ["b1", "b2", "b3", "b4", "h1"]
    assert render.critical_path(lambda r: r.inputs["gate"]) == ["g1", "a2", "g2"]
    assert render.critical_path(lambda r: False) == []


def test_the_critical_path_follows_a_chain_deeper_than_the_recursion_limit():
    depth = 5000
    render = _chain_render({f"s{i}": [f"s{i - 1}"] if i else [] for i in range(depth)}, gates=set())
    assert len(render.critical_path()) == depth
