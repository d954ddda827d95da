"""The tag contract between the components and the policy pack: what a resource is for.

The AWS target tags its GPU nodes and security groups with `ROLE_TAG`; the policy pack
(policies/) recognises them by the same constants, so the two cannot drift apart.
"""

from __future__ import annotations

ROLE_TAG = "qwen-cluster:role"
NODE_TAG = "qwen-cluster:node"  # the node's name from qwen-cluster:nodes

# Values of CONTAINER_ROLE_LABEL (below), the docker label on every container the program runs:
# the change plan reads it to tell a model server from the load balancer.
HEAD_CONTAINER = "head"  # a replica head's model server (vLLM)
PIPELINE_WORKER_CONTAINER = "pipeline-worker"  # a pipeline-parallel member after the head (headless)
LOAD_BALANCER_CONTAINER = "load-balancer"  # nginx on bareMetal.loadBalancerNode
MONITORING_CONTAINER = "monitoring"  # the exporters, the endpoint, Prometheus and Alertmanager

# Values of ROLE_TAG.
GPU_NODE = "gpu-node"  # instances and launch templates of the node group; bare-metal hosts
NODE_SG = "node-sg"  # the GPU nodes' security group (members reach each other on everything)
LB_SG = "lb-sg"  # the model load balancer's security group (the only way to the model port)
BASTION_SG = "bastion-sg"  # the SSH jump host's security group (the nodes' only SSH source)
BASTION = "bastion"  # the SSH jump host itself

CONTAINER_ROLE_LABEL = "qwen-cluster.role"  # docker label: what a bare-metal container is for
