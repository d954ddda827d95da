"""The cluster as a picture: nodes, load balancer, clients, monitoring and the flows with
their ports, drawn from the same exposure list the firewalls and security groups use."""

from __future__ import annotations

import graphviz

from qwen_cluster.config import ClusterConfig, Target
from qwen_cluster.ports import Peer
from qwen_cluster.ports import Target as RuleTarget

# Above this many nodes the node group is drawn as one box: a 256-node picture helps nobody.
MAX_DRAWN_NODES = 8


def diagram(cluster: ClusterConfig, title: str = "") -> graphviz.Digraph:
    topology = cluster.topology
    rules = cluster.exposures()
    graph = graphviz.Digraph(
        "qwen-cluster",
        graph_attr={
            "rankdir": "LR",
            "fontname": "Helvetica",
            "label": title,
            "labelloc": "t",
            "fontsize": "16",
            "nodesep": "0.3",
            "ranksep": "0.9",
            "compound": "true",
        },
        node_attr={"fontname": "Helvetica", "fontsize": "11", "shape": "box", "style": "rounded"},
        edge_attr={"fontname": "Helvetica", "fontsize": "10"},
    )

    listener = next(rule for rule in rules if rule.target is RuleTarget.LOAD_BALANCER)
    graph.node("clients", "clients\n" + "\n".join(listener.cidrs), shape="ellipse")
    if cluster.target is Target.AWS:
        lb_label = (
            f"Network Load Balancer ({cluster.load_balancer.scheme})\nTCP :{cluster.load_balancer.port}"
        )
    else:
        lb_label = f"nginx on {cluster.load_balancer_node.name}\n:{cluster.load_balancer.port}"
    lb_label += f"\nidle timeout {cluster.load_balancer.idle_timeout_seconds} s"
    graph.node("lb", lb_label, shape="box", style="filled", fillcolor="#dbe9f6")
    graph.edge("clients", "lb", label=f"{cluster.load_balancer.port}/tcp")

    bandwidth = f"{cluster.bandwidth_gbps:g} Gbit/s" + (" EFA" if cluster.aws and cluster.aws.efa else "")
    where = cluster.aws.instance_type if cluster.aws else f"{cluster.gpus_per_node} GPUs/node"
    with graph.subgraph(name="cluster_nodes") as group:
        group.attr(label=f"node segment {cluster.network.cidr} — {where}, {bandwidth}", style="dashed")
        if len(cluster.nodes) <= MAX_DRAWN_NODES:
            for node in sorted(cluster.nodes, key=lambda n: n.role != "master"):
                head = " (replica head)" if topology.is_head(node.name) else ""
                fill = "#e8f4e0" if topology.is_head(node.name) else "#f4f4f4"
                group.node(
                    f"n-{node.name}",
                    f"{node.name}{head}\n{node.ip}  {node.role}",
                    style="filled",
                    fillcolor=fill,
                )
            head_ids = [f"n-{head.name}" for head in topology.heads]
            member_ids = [f"n-{node.name}" for node in cluster.nodes]
        else:
            group.node(
                "n-group",
                f"{len(cluster.nodes)} nodes\n{len(topology.replicas)} replicas "
                f"x TP {topology.tensor_parallel} x PP {topology.pipeline_parallel}",
                style="filled",
                fillcolor="#e8f4e0",
            )
            head_ids = member_ids = ["n-group"]

    for head in head_ids:
        graph.edge("lb", head, label=f"{topology.model_port}/tcp", color="#1f77b4")
    cluster_ports = ", ".join(f"{e.name} {e.port}" for e in cluster.ports if e.scope.value == "cluster")
    mesh_label = f"all traffic, members only\n(NCCL/EFA; {cluster_ports})"
    graph.node("mesh", mesh_label, shape="note")
    for member in member_ids:
        graph.edge(member, "mesh", dir="both", style="dashed", color="#777777", arrowsize="0.6")

    for rule in rules:
        if rule.target is not RuleTarget.NODES or rule.peer is not Peer.CIDRS:
            continue
        source = f"src-{rule.name}"
        graph.node(source, f"{rule.name}\n" + "\n".join(rule.cidrs), shape="ellipse")
        # One arrow to the node group as a whole: every member admits the same sources.
        graph.edge(
            source,
            member_ids[len(member_ids) // 2],
            lhead="cluster_nodes",
            label=f"{rule.ports}/{rule.protocol}",
            color="#999999",
        )
    return graph
