"""The endpoint on AWS: an nginx proxy on every replica head, between the NLB and vLLM (pure).

The NLB forwards TCP and cannot see a path or a header, so the HTTP-aware hop is on the node:
nginx (the bare-metal load balancer's image and its very `server` text, render/nginx.py
server_block) on host networking, listening on the node's address and the model port (the NLB
target), in front of vLLM bound to loopback on the same port (render/vllm.py listen_address).
It checks the API key, allows only the OpenAI routes and /health, and terminates TLS when
`loadBalancer.tls` is set, so the NLB keeps a TCP listener whose idle timeout is
`loadBalancer.idleTimeoutSeconds` (an NLB TLS listener's is fixed at 350 s,
https://docs.aws.amazon.com/elasticloadbalancing/latest/network/update-idle-timeout.html).
Why not an ALB: docs/decisions.md.

The proxy runs apart from the model server, as its own SSM document and association per head
(components/aws/proxy.py): its configuration and the secrets change without touching vLLM.
The secrets (keys, certificate, private key) are SecureString parameters the run reads with the
node's role; the association names them and carries their versions, so a changed key is a new
association run that rewrites the files and reloads nginx (docker kill --signal=HUP), never a
new model-server run.
"""

from __future__ import annotations

import base64

from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import nginx, router, vllm
from qwen_cluster.render.ssm import command_document

CONTAINER_NAME = nginx.PROXY_CONTAINER_NAME
CONF_DIR = nginx.PROXY_CONF_DIR
RUN_TIMEOUT_SECONDS = 900
# A parameter's ARN (GetParameter takes a name or an ARN): an ARN the association holds follows
# the parameter, so the change plan sees a new key reach the association.
_SSM_ARN = "^(arn:[A-Za-z0-9:/._-]+)?$"
_B64 = "^[A-Za-z0-9+/=]*$"
PARAMETERS: dict[str, tuple[str, str]] = {
    "Image": ("^[A-Za-z0-9./:@_-]+$", "the pinned nginx image"),
    "NginxConf": (_B64, "base64: the proxy's nginx.conf (qwen_cluster/render/proxy.py)"),
    "NodeIp": ("^[0-9.]+$", "the node's address, where the proxy listens"),
    "Port": ("^[0-9]+$", "the model port (the NLB target)"),
    "Scheme": ("^https?$", "http, or https with loadBalancer.tls"),
    "Region": ("^[a-z0-9-]+$", "the AWS region (for the aws CLI)"),
    "KeysParameter": (_SSM_ARN, "SecureString: the key map (nginx.keys_conf); empty: open endpoint"),
    "CertificateParameter": (_SSM_ARN, "SecureString: the PEM chain; empty: no TLS"),
    "PrivateKeyParameter": (_SSM_ARN, "SecureString: the PEM private key; empty: no TLS"),
    "SecretsVersion": ("^[0-9,]*$", "the parameters' versions: a new one is a new run"),
}

_RUN = r"""#!/bin/bash
set -euo pipefail
b64() { printf '%s' "$1" | base64 -d; }
export AWS_DEFAULT_REGION='{{ Region }}'
DIR=__DIR__
IMAGE='{{ Image }}'
install -d -m 0700 "$DIR"
backup=$(mktemp -d)
trap 'rm -rf "$backup"' EXIT
cp -p "$DIR"/* "$backup"/ 2>/dev/null || true

# The secrets, read with the node's role (never in this document, a log or the command line).
umask 077
fetch() {
  [ -n "$1" ] || return 0
  aws ssm get-parameter --name "$1" --with-decryption --query Parameter.Value --output text >"$DIR/$2.new"
}
fetch '{{ KeysParameter }}' __KEYS__
fetch '{{ CertificateParameter }}' __CERT__
fetch '{{ PrivateKeyParameter }}' __KEY__
b64 '{{ NginxConf }}' >"$DIR/__CONF__.new"
for file in __CONF__ __KEYS__ __CERT__ __KEY__; do
  if [ -e "$DIR/$file.new" ]; then mv -f "$DIR/$file.new" "$DIR/$file"; else rm -f "$DIR/$file"; fi
done
umask 022

restore() {
  rm -f "$DIR"/*
  cp -p "$backup"/* "$DIR"/ 2>/dev/null || true
}
# (docker ps filters, not --format: SSM reads double braces as its own parameters.)
if [ -n "$(docker ps --quiet --filter 'name=^__NAME__$' --filter "ancestor=$IMAGE")" ]; then
  # The same proxy: test the new files with it, then reload (streams in flight finish).
  if ! docker exec __NAME__ nginx -t -q -c __MOUNT__/__CONF__; then
    restore
    echo "proxy: the new configuration was refused; the previous files are back" >&2
    exit 1
  fi
  docker kill --signal=HUP __NAME__ >/dev/null
  echo "proxy: reloaded"
else
  docker pull "$IMAGE"
  docker rm --force __NAME__ >/dev/null 2>&1 || true
  docker run --detach --name=__NAME__ --restart=unless-stopped --network=host \
    --ulimit=nofile=__NOFILE__:__NOFILE__ --volume="$DIR":__MOUNT__:ro \
    "$IMAGE" nginx -c __MOUNT__/__CONF__ -g 'daemon off;'
  echo "proxy: started"
fi
deadline=$((SECONDS + 60))
until curl --silent --insecure --fail --max-time 2 -o /dev/null \
  '{{ Scheme }}://{{ NodeIp }}:{{ Port }}/nginx-health'; do
  if [ "$SECONDS" -ge "$deadline" ]; then echo "proxy: not answering" >&2; exit 1; fi
  sleep 1
done
"""


def run_script() -> str:
    return (
        _RUN.replace("__DIR__", CONF_DIR)
        .replace("__NAME__", CONTAINER_NAME)
        .replace("__MOUNT__", nginx.CONTAINER_CONF_DIR)
        .replace("__CONF__", nginx.CONF_FILE)
        .replace("__KEYS__", nginx.KEYS_FILE)
        .replace("__CERT__", nginx.TLS_CERTIFICATE_FILE)
        .replace("__KEY__", nginx.TLS_PRIVATE_KEY_FILE)
        .replace("__NOFILE__", str(nginx.WORKER_RLIMIT_NOFILE))
    )


def document() -> str:
    return command_document(
        "qwen-cluster: the node's proxy in front of vLLM: API keys, the route allowlist, TLS "
        "(qwen_cluster/render/proxy.py)",
        "nodeProxy",
        PARAMETERS,
        run_script(),
        RUN_TIMEOUT_SECONDS,
    )


# This node's vLLM alone (cache-aware routing): the router listener's and the health check's.
LOCAL_UPSTREAM = "qwen_local"


def router_listener(cluster: ClusterConfig, node_name: str) -> str:
    """With loadBalancer.routing cache-aware: where the router reaches this head's vLLM, on the
    node's address at the `router-worker` row (members only: scope cluster). No key (the router
    holds none, vLLM checks none) and no TLS (the router's worker URLs are http). Every path
    passes, to this node's vLLM only: the router sends the OpenAI routes, its health checks
    and, for the cache_aware policy, the scale-out render routes (render/vllm.py
    scale_out_flags); the same reach the router has to vLLM's port on bare metal. Never to the
    router: its workers are these listeners, so a request the router sent ends here."""
    node = next(node for node in cluster.nodes if node.name == node_name)
    timeout = f"{cluster.load_balancer.idle_timeout_seconds}s"
    return f"""
    # The router's way to this replica (docs/routing.md, "AWS"): members only, no key.
    upstream {LOCAL_UPSTREAM} {{
        server {vllm.LOOPBACK}:{cluster.model_port};
    }}

    server {{
        listen {node.ip}:{cluster.router_worker_port};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_buffering off;
        proxy_cache off;
        proxy_connect_timeout {nginx.CONNECT_TIMEOUT_SECONDS}s;
        proxy_read_timeout {timeout};
        proxy_send_timeout {timeout};
        location / {{
            proxy_pass http://{LOCAL_UPSTREAM};
        }}{_drain_location() if cluster.disaggregated else ""}
    }}
"""


# serving.mode disaggregated: while this file (in the proxy's directory) holds `return 503;`, the
# router's health checks of this replica fail and the router's own health checker takes it out
# of its choice (render/router.py, "P/D mode's run-time membership"). The model server's run
# writes and removes it and reloads the proxy (render/ssm.py). An include, read by nginx's master
# at a reload, not a file test at request time: the directory is root's alone (0700).
DRAIN_FILE = nginx.PROXY_DRAIN_FILE


def _drain_location() -> str:
    return f"""
        location = {vllm.HEALTH_PATH} {{
            # A mask: no file, nothing included (nginx core module, `include`).
            include {nginx.CONTAINER_CONF_DIR}/{DRAIN_FILE.replace(".conf", "*.conf")};
            proxy_pass http://{LOCAL_UPSTREAM};
            proxy_read_timeout 10s;
            access_log off;
        }}"""


def conf(cluster: ClusterConfig, node_name: str) -> str:
    """The proxy's nginx.conf on one head: the node address and the model port, in front of
    vLLM on loopback (one upstream: nothing to retry elsewhere). With loadBalancer.routing
    cache-aware the upstream's primary server is the router on the master and this vLLM its
    `backup` (render/nginx.py router_server: a dead router degrades this node to its own vLLM),
    and a second listener lets the router reach this vLLM (router_listener)."""
    node = next(node for node in cluster.nodes if node.name == node_name)
    port = cluster.model_port
    routed = cluster.router_worker_port is not None
    return nginx.render(
        [(vllm.LOOPBACK, port)],
        listen_port=port,
        listen_address=str(node.ip),
        idle_timeout_seconds=cluster.load_balancer.idle_timeout_seconds,
        api_keys=bool(cluster.access.api_keys),
        tls=cluster.load_balancer.tls is not None,
        router_at=router.api_address(cluster) if routed else None,
        extra=router_listener(cluster, node_name) if routed else "",
        # The NLB's health check asks this node's own vLLM, as without the router: a node whose
        # vLLM is down leaves the target group (its proxy's fallback is that vLLM), and the
        # rollout's `wait target-in-service` still means this replica serves.
        health_upstream=LOCAL_UPSTREAM if routed else None,
        disaggregated=cluster.disaggregated,
    )


def parameters(
    cluster: ClusterConfig,
    node_name: str,
    *,
    keys_parameter: str = "",
    certificate_parameter: str = "",
    private_key_parameter: str = "",
    secrets_version: object = "",
) -> dict[str, object]:
    """One head's association parameters; the parameter names and versions may be Outputs."""
    node = next(node for node in cluster.nodes if node.name == node_name)
    return {
        "Image": nginx.IMAGE,
        "NginxConf": base64.b64encode(conf(cluster, node_name).encode()).decode(),
        "NodeIp": str(node.ip),
        "Port": str(cluster.model_port),
        "Scheme": "https" if cluster.load_balancer.tls else "http",
        "Region": cluster.aws.region if cluster.aws else "",
        "KeysParameter": keys_parameter,
        "CertificateParameter": certificate_parameter,
        "PrivateKeyParameter": private_key_parameter,
        "SecretsVersion": secrets_version,
    }
