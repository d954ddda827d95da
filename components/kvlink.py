"""KvLink: what a disaggregated stack declares about its prefill->decode path (the model, its KV
dtype, the GPUs, the pools, the backend, the link), registered for the policy pack on both targets.

The pack sizes the link from these figures (policies/kvtransfer.py). It is usually handed the stack
config as well, but `pulumi policy analyze` and any engine path without ConfigureStack start it
without (policies/facts.py NO_CONFIG): then this resource is where it learns that the stack is
disaggregated and what its prefill pool makes. The document is `qwen_cluster.kvlink.declaration`,
registered as the component's inputs and again as its outputs, so a resource policy (inputs) and
a stack policy (outputs: the engine's AnalyzeStack sends every resource's outputs, a component's
being what it registered) read the same thing. No child, nothing created anywhere: the component
is data in the state, and changes with the stack config.
"""

from __future__ import annotations

import pulumi

from qwen_cluster import kvlink
from qwen_cluster.config import ClusterConfig

TYPE = kvlink.DECLARATION_TYPE


class KvLink(pulumi.ComponentResource):
    def __init__(self, name: str, document: dict, opts: pulumi.ResourceOptions | None = None):
        super().__init__(TYPE, name, document, opts)
        self.register_outputs(document)


def declare(cluster: ClusterConfig) -> KvLink | None:
    """The stack's KvLink when serving.mode is disaggregated, else None (nothing registered)."""
    document = kvlink.declaration(cluster)
    return KvLink("kv-link", document) if document is not None else None
