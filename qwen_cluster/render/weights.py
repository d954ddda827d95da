"""Where the model's weights come from, where a node keeps them, and the staging script that puts
the image and the weights on a node before any replica drains (pure; both targets).

    model_path(cluster) -> str                     what `vllm serve` loads, inside the container
    server_environment(cluster) -> dict[str, str]  the model server's Hugging Face settings
    stage_script(cluster, host_cache) -> str       pull the image, fetch the weights (bash, as root)
    s3_read_policy(weights) -> dict                the node role's read on exactly the S3 prefix

Staging runs while the node still serves (docker pull and the fetch touch neither the running
container nor its port), so a replica's time out of service is its restart and its load from
local disk. The model server runs with HF_HUB_OFFLINE=1: it never reaches the Hub or the mirror
itself, and a missing file fails its start on the node (the rollout stops there) rather than
sending 65.6 GB per node over the internet inside a health timeout.

Sources (`model.weights.source`):
- hub / mirror: the staged image's own huggingface_hub (`snapshot_download`, the library vLLM
  itself downloads with) fills the host cache; a mirror is its `HF_ENDPOINT` (huggingface_hub
  constants.py reads HF_ENDPOINT for every request). vLLM then resolves `model.name` from the
  cache offline.
- s3 (AWS): `aws s3 sync` of the prefix into the host cache, through the VPC's S3 gateway
  endpoint (components/aws/network.py); vLLM loads that directory (`model_path`) and serves it
  as model.name (`--served-model-name`). Why a sync and not vLLM's streaming loader reading s3://
  at start: docs/decisions.md "Weights".
"""

from __future__ import annotations

import json
from typing import Any

from qwen_cluster.config import ClusterConfig, Weights
from qwen_cluster.render import shell

# The Hugging Face cache inside every model container (HF_HOME), a host directory mounted there.
CONTAINER_CACHE = "/root/.cache/huggingface"
# Where an S3 copy lives inside that cache: HF_HOME/qwen-cluster-weights/<model.name>.
S3_COPY_DIR = "qwen-cluster-weights"
# huggingface_hub's own entry point (huggingface_hub/_snapshot_download.py): downloads every file
# of the repository that is not yet in the cache, and only those.
_FETCH = "import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))"
# IAM ARNs of the standard partition; GovCloud (aws-us-gov) and China (aws-cn) differ.
_S3_ARN = "arn:aws:s3:::"


def model_path(cluster: ClusterConfig) -> str:
    """What `vllm serve` is given: the repository id (resolved in the cache), or the S3 copy."""
    if cluster.model.weights.source == "s3":
        return f"{CONTAINER_CACHE}/{S3_COPY_DIR}/{cluster.model.name}"
    return cluster.model.name


def server_environment(cluster: ClusterConfig) -> dict[str, str]:
    """HF_HOME is the mounted cache; HF_HUB_OFFLINE=1: the server loads what staging fetched and
    asks nobody (huggingface_hub constants.py HF_HUB_OFFLINE; vLLM honours it the same way)."""
    return {"HF_HOME": CONTAINER_CACHE, "HF_HUB_OFFLINE": "1"}


def _fetch_lines(cluster: ClusterConfig, host_cache: str) -> list[str]:
    weights, model = cluster.model.weights, cluster.model.name
    if weights.source == "s3":
        target = f"{host_cache}/{S3_COPY_DIR}/{model}"
        return [
            f"install -d -m 0755 {shell.quote(target)}",
            # Regional endpoint: the gateway endpoint serves buckets of the VPC's own region.
            f"export AWS_DEFAULT_REGION={shell.quote(cluster.aws.region if cluster.aws else '')}",
            # sync copies only what differs (size, modified time): a re-run on a staged node lists
            # the prefix and copies nothing.
            f"aws s3 sync --only-show-errors --no-progress {shell.quote(weights.uri)} {shell.quote(target)}",
        ]
    endpoint = [f"--env=HF_ENDPOINT={weights.uri}"] if weights.source == "mirror" else []
    run = [
        "docker",
        "run",
        "--rm",
        "--network=host",
        # `z`: a label shared with the model container, which mounts the same cache (SELinux
        # hosts; docker ignores it elsewhere).
        f"--volume={host_cache}:{CONTAINER_CACHE}:z",
        f"--env=HF_HOME={CONTAINER_CACHE}",
        *endpoint,
        "--entrypoint=python3",
        cluster.model.image,
        "-c",
        _FETCH,
        model,
    ]
    return [" ".join(shell.quote(word) for word in run)]


def stage_script(cluster: ClusterConfig, host_cache: str) -> str:
    """The image and the weights onto one node, run as root while the node serves. Its text
    depends on the image, model.name, model.weights and the cache directory only, so it changes
    exactly when what it stages does."""
    source = cluster.model.weights.source
    where = cluster.model.weights.uri or "the Hugging Face Hub"
    body = [
        "# One staging at a time on a node: on AWS the stack-wide staging and the node's own may",
        "# run together on a new machine; the second finds everything in place.",
        "exec 9>/run/lock/qwen-cluster-stage.lock",
        "flock 9",
        f"install -d -m 0755 {shell.quote(host_cache)}",
        "# The new image next to the one serving: the container is replaced later, by the rollout.",
        f"docker pull --quiet {shell.quote(cluster.model.image)}",
        f"# The weights of {cluster.model.name} from {where} ({source}) into the host cache.",
        *_fetch_lines(cluster, host_cache),
        f"echo {shell.quote(f'staged {cluster.model.image} and {cluster.model.name} ({source})')}",
    ]
    return shell.script(f"stage the model server's image and weights ({source})", "\n".join(body))


def s3_read_policy(weights: Weights) -> dict[str, Any]:
    """Read on exactly `weights.uri`: its objects, and the listing of its keys (aws s3 sync lists
    with the prefix `<prefix>/`). Nothing else of the bucket, no write."""
    bucket, prefix = weights.s3_bucket, weights.s3_prefix
    if not bucket:
        raise ValueError("model.weights.source is not s3: no S3 prefix to read")
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "ReadModelWeights",
                "Effect": "Allow",
                "Action": "s3:GetObject",
                "Resource": f"{_S3_ARN}{bucket}/{prefix}/*",
            },
            {
                "Sid": "ListModelWeights",
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": f"{_S3_ARN}{bucket}",
                "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}},
            },
        ],
    }


def s3_read_policy_json(weights: Weights) -> str:
    return json.dumps(s3_read_policy(weights), sort_keys=True)
