"""The tag contract between the components and the policy pack: what a resource is for.

The AWS target tags its GPU nodes and security groups with `ROLE_TAG`; the policy pack
(policies/) recognises them by the same constants, so the two cannot drift apart.
"""

from __future__ import annotations

ROLE_TAG = "qwen-cluster:role"
NODE_TAG = "qwen-cluster:node"  # the node's name from qwen-cluster:nodes

# Values of ROLE_TAG.
GPU_NODE = "gpu-node"  # instances and launch templates of the node group; bare-metal hosts
NODE_SG = "node-sg"  # the GPU nodes' security group (members reach each other on everything)
LB_SG = "lb-sg"  # the model load balancer's security group (the only way to the model port)
BASTION_SG = "bastion-sg"  # the SSH jump host's security group (the nodes' only SSH source)
BASTION = "bastion"  # the SSH jump host itself

CONTAINER_ROLE_LABEL = "qwen-cluster.role"  # docker label: what a bare-metal container is for
