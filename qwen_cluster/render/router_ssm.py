"""vLLM's router on AWS (loadBalancer.routing cache-aware): an SSM Command document, and the
parameters of the one association that runs it on the master (components/aws/router.py). Pure.

One router for the cluster, on the master, bound to the master's address at the `router` row
(members only): every node's proxy sends to it (render/proxy.py), its workers are the heads'
proxy listeners for it (`router-worker` row), and every model-server run calls its admin routes
(render/ssm.py). Why one router and not one per node: docs/routing.md, "AWS".

What a run does: keeps the container when it already runs this configuration (a hash label, as
the model-server and monitoring documents do); otherwise pulls the pinned image and replaces the
container, with the whole argv as its command (the published image has no ENTRYPOINT:
vllm-project/router Dockerfile.router). It does not wait for the router to listen: the router
listens only once every worker answers /health (measured with the 0.1.17 wheel), which on a new
stack is when the last replica has loaded; each proxy sends to its own vLLM meanwhile.
"""

from __future__ import annotations

import base64
import hashlib
import json

from qwen_cluster import tags
from qwen_cluster.render import router
from qwen_cluster.render.ssm import command_document

CONFIG_LABEL = "qwen-cluster.router-config"
# Pulling the router's image (python:3.12-slim and one binary) and starting it.
RUN_TIMEOUT_SECONDS = 900
_B64 = "^[A-Za-z0-9+/=]*$"
PARAMETERS: dict[str, tuple[str, str]] = {
    "Image": ("^[A-Za-z0-9./:@_-]+$", "the pinned vllm-router image"),
    "Command": (_B64, "base64: the router's argv, one word a line (qwen_cluster/render/router.py)"),
    # Not the model server's ConfigHash: the change plan counts that name as a restarting model
    # server (tooling/changes/impact.py).
    "RouterHash": ("^[0-9a-f]{64}$", "sha256 of the image and argv: equal means no restart"),
}

_RUN = r"""#!/bin/bash
set -euo pipefail
IMAGE='{{ Image }}'
HASH='{{ RouterHash }}'
# (docker ps filters, not --format: SSM reads double braces as its own parameters.)
if [ -n "$(docker ps --quiet --filter 'name=^__NAME__$' --filter "label=__LABEL__=$HASH")" ]; then
  echo "router: already runs configuration $HASH"
  exit 0
fi
mapfile -t ARGV < <(printf '%s' '{{ Command }}' | base64 -d)
docker pull "$IMAGE"
# The proxies send to their own vLLM while no router answers (render/proxy.py).
docker rm --force __NAME__ >/dev/null 2>&1 || true
docker run --detach --name=__NAME__ --restart=unless-stopped --network=host \
  --label=__ROLE_LABEL__=__ROLE__ --label="__LABEL__=$HASH" "$IMAGE" "${ARGV[@]}" >/dev/null
echo "router: started; it listens once every worker answers /health"
"""


def run_script() -> str:
    return (
        _RUN.replace("__NAME__", router.CONTAINER_NAME)
        .replace("__ROLE_LABEL__", tags.CONTAINER_ROLE_LABEL)
        .replace("__ROLE__", tags.ROUTER_CONTAINER)
        .replace("__LABEL__", CONFIG_LABEL)
    )


def document() -> str:
    return command_document(
        "qwen-cluster: vLLM's router on the master, for every node's proxy "
        "(qwen_cluster/render/router_ssm.py)",
        "router",
        PARAMETERS,
        run_script(),
        RUN_TIMEOUT_SECONDS,
    )


def parameters(cluster) -> dict[str, str]:
    """The master's association parameters (cache-aware routing on aws only)."""
    argv = router.command(cluster)
    digest = hashlib.sha256(json.dumps([router.IMAGE, argv, run_script()]).encode()).hexdigest()
    return {
        "Image": router.IMAGE,
        "Command": base64.b64encode(("\n".join(argv) + "\n").encode()).decode(),
        "RouterHash": digest,
    }


def shell_check_text() -> str:
    text = run_script()
    for name in PARAMETERS:
        text = text.replace("{{ " + name + " }}", "0")
    return text
