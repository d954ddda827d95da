"""The tag contract between the components and the policy pack: what a resource is for.

The AWS target tags its GPU nodes and security groups with `ROLE_TAG`; the policy pack
(policies/) recognises them by the same constants, so the two cannot drift apart.
"""

from __future__ import annotations

ROLE_TAG = "qwen-cluster:role"
# On every AWS resource the program creates, its value the stack's name: the deploy role's
# policy (tooling/deploy_policy.py) reaches EC2 resources through it (aws:ResourceTag).
STACK_TAG = "qwen-cluster:stack"
NODE_TAG = "qwen-cluster:node"  # the node's name from qwen-cluster:nodes

# Values of CONTAINER_ROLE_LABEL (below), the docker label on every container the program runs:
# the change plan reads it to tell a model server from the load balancer.
HEAD_CONTAINER = "head"  # a replica head's model server (vLLM)
PIPELINE_WORKER_CONTAINER = "pipeline-worker"  # a pipeline-parallel member after the head (headless)
LOAD_BALANCER_CONTAINER = "load-balancer"  # nginx on bareMetal.loadBalancerNode
MONITORING_CONTAINER = "monitoring"  # the exporters, the endpoint, Prometheus and Alertmanager
ROUTER_CONTAINER = "router"  # vLLM's router behind nginx (loadBalancer.routing cache-aware)

# The model server's container name on every node of both targets (one per node, head or
# pipeline worker alike: the role is in CONTAINER_ROLE_LABEL). A fixed identity: a new container
# replaces the old delete-before-replace.
MODEL_SERVER_CONTAINER = "qwen-vllm"

# Values of ROLE_TAG.
GPU_NODE = "gpu-node"  # instances and launch templates of the node group; bare-metal hosts
NODE_SG = "node-sg"  # the GPU nodes' security group (members reach each other on everything)
LB_SG = "lb-sg"  # the model load balancer's security group (the only way to the model port)
MONITORING_SG = "monitoring-sg"  # on monitoring.node only: Prometheus and Alertmanager from monitoringCidrs
BASTION_SG = "bastion-sg"  # the SSH jump host's security group (the nodes' only SSH source)
BASTION = "bastion"  # the SSH jump host itself

CONTAINER_ROLE_LABEL = "qwen-cluster.role"  # docker label: what a bare-metal container is for
