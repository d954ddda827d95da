"""The model server on AWS as an SSM Run Command document plus per-node parameters (pure).

The document is applied to one node by one association (components/aws/nodes.py), so a change
to the image, the vLLM flags, the serving environment or sysctl changes only the association's
parameters, never the machine. Why SSM and not user data: docs/decisions.md, "AWS", and
docs/day2.md, "AWS".

What one run does on a node (idempotent, so re-running it on an unchanged node is harmless):
1. writes the sysctl drop-in and applies it (no restart needed);
2. if the running container already carries this configuration's hash, keeps it;
   otherwise pulls the image first (while the old server still serves; a no-op after the
   node's staging association, below), drains the replica from the NLB target group if a
   server ran on the node before (once no other registered target is out of service, `initial`
   or `unhealthy`, waiting at most healthTimeoutSeconds for them: a replica still loading after
   day 0 counts against rollout.maxUnavailable too; then deregister its head, wait at most
   drainTimeoutSeconds), stops
   the container within vLLM's own graceful shutdown and its margin (`docker stop --time`,
   vllm.stop_grace_seconds), replaces it and
3. on a replica head, waits for vLLM's /health (at most healthTimeoutSeconds) and for the NLB
   to call it healthy, when the replica served before this run or the cluster already serves
   (another target is healthy): that is the gate that holds the lane's next replica. On a new
   stack (day 0) nothing serves yet, so the run registers its target and returns at once: every
   replica loads at the same time and the NLB's health check admits each when it answers.
   Any failure fails the run, which fails the association, which stops `pulumi up` there with
   the replicas not yet reached untouched.
Pipeline members after the head (not LB targets) drain their replica's head before restarting
their headless `vllm serve` (or Ray worker, with model.distributedBackend ray), so the replica is
out of the load balancer before any of its members restarts; their replica head's run waits for
the replica's health. The hash is the replica's (config_hash): a change to any member restarts
them all, since a multi-node replica meets again at its head's `--master-port`.

Staging is a second document (`stage_document`), applied to each node by its own association
before the node's model-server association: it pulls the image and fetches the weights into the
host cache (qwen_cluster/render/weights.py stage_script) while the node still serves.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

from qwen_cluster import hostpaths, tags
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import collective, nginx, router, vllm, weights
from qwen_cluster.render.shell import INTERFACE_OF, interface_of_function
from qwen_cluster.render.sysctl import DROPIN_PATH, dropin

CONTAINER_NAME = tags.MODEL_SERVER_CONTAINER
CONFIG_LABEL = "qwen-cluster.config"
ENV_FILE = f"{hostpaths.CONFIG_DIR}/model-server.env"
SERVER_SCRIPT = f"{hostpaths.CONFIG_DIR}/model-server.sh"
# The node's Hugging Face cache: where bare metal keeps it by default (bareMetal.weightsCache).
HF_CACHE = hostpaths.WEIGHTS_CACHE
# The DLAMI installs libfabric and the aws-ofi-nccl plugin under /opt/amazon.
EFA_LIBRARY_PATH = "/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib"
# Pulling a ~10 GB vLLM image and starting the container, on top of drain and health.
PULL_MARGIN_SECONDS = 900
# The run's own limit (aws:runShellScript timeoutSeconds; default 3600): above the largest
# wait for the other targets (7200) + drain (3600) + health (7200) + pull margin the config allows.
RUN_TIMEOUT_SECONDS = 6 * 3600

_B64 = "^[A-Za-z0-9+/=]*$"
# The parameter whose value changes exactly when what the container runs does (the change plan
# tells a restarting run by it: tooling/changes/impact.py).
CONFIG_HASH_PARAMETER = "ConfigHash"
PARAMETERS: dict[str, tuple[str, str]] = {
    # name: (allowedPattern, description)
    "Image": ("^[A-Za-z0-9./:@_-]+$", "the pinned vLLM image"),
    "ServerScript": (_B64, "base64: the bash script the container runs (qwen_cluster/render/vllm.py)"),
    "Environment": (_B64, "base64: KEY=VALUE lines for the container"),
    "DockerOptions": (_B64, "base64: one `docker run` option per line"),
    "Sysctl": (_B64, "base64: the sysctl drop-in (tuning.sysctl)"),
    "NodeIp": ("^[0-9.]+$", "the node's static IP (finds the cluster interface)"),
    CONFIG_HASH_PARAMETER: ("^[0-9a-f]{64}$", "sha256 of what the container runs; equal means no restart"),
    "TargetGroupArn": ("^[A-Za-z0-9:/._-]*$", "the NLB target group"),
    "TargetId": ("^[A-Za-z0-9-]*$", "the replica head's instance id in the target group"),
    "Port": ("^[0-9]+$", "the model port"),
    "Region": ("^[a-z0-9-]+$", "the AWS region (for the aws CLI)"),
    "DrainSeconds": ("^[0-9]+$", "rollout.drainTimeoutSeconds"),
    "HealthSeconds": ("^[0-9]+$", "rollout.healthTimeoutSeconds"),
    "StopSeconds": ("^[0-9]+$", "how long `docker stop` waits: vLLM's shutdown timeout and a margin"),
    "RayTokenParameter": (
        "^[A-Za-z0-9/_.-]*$",
        "the SSM SecureString holding rayAuthToken (empty when the replica runs no Ray)",
    ),
    "RayTokenVersion": ("^[0-9]*$", "that parameter's version: a new token restarts the container"),
    "HealthUrl": (
        f"^(http://[0-9.]+:[0-9]+{re.escape(vllm.HEALTH_PATH)})?$",
        f"where the replica answers {vllm.HEALTH_PATH}",
    ),
}

# With loadBalancer.routing cache-aware (the document renders them only then, so a least-conn
# stack's document and config hash are what they were before routing existed).
ROUTED_PARAMETERS: dict[str, tuple[str, str]] = {
    "RouterAddress": ("^([0-9.]+:[0-9]+)?$", "vLLM's router's API on the master (host:port)"),
    "RouterWorker": ("^(http://[0-9.]+:[0-9]+)?$", "this replica as the router names it (its head's)"),
}


def parameter_specs(routed: bool = False) -> dict[str, tuple[str, str]]:
    return {**PARAMETERS, **(ROUTED_PARAMETERS if routed else {})}


_RUN = r"""#!/bin/bash
set -euo pipefail
b64() { printf '%s' "$1" | base64 -d; }
__INTERFACE_OF_FUNCTION__
NODE_IP='{{ NodeIp }}'
HASH='{{ ConfigHash }}'
RAY_TOKEN_VERSION='{{ RayTokenVersion }}'
if [ -n "$RAY_TOKEN_VERSION" ]; then HASH="$HASH-$RAY_TOKEN_VERSION"; fi  # a new Ray token restarts
RAY_TOKEN_PARAMETER='{{ RayTokenParameter }}'
IMAGE='{{ Image }}'
TG='{{ TargetGroupArn }}'
TARGET='{{ TargetId }}'
PORT='{{ Port }}'
export AWS_DEFAULT_REGION='{{ Region }}'

__ROUTER_FUNCTIONS__# 1. Kernel tuning: a drop-in, applied live (no restart needed).
install -d -m 0755 /etc/sysctl.d __CONFIG_DIR__ __HF_CACHE__
b64 '{{ Sysctl }}' > __DROPIN__.new && mv __DROPIN__.new __DROPIN__
sysctl --system >/dev/null

# 2. The container, replaced only when what it runs changed. SERVED: a server of ours was on
# this node before this run (it served, or was loading): its replica is drained first and
# must be healthy again before the run ends.
SERVED=''
if [ -n "$(docker ps --all --quiet --filter 'name=^__NAME__$')" ]; then SERVED=yes; fi
if [ -n "$(docker ps --quiet --filter 'name=^__NAME__$' --filter "label=__LABEL__=$HASH")" ]; then
  echo "model server already runs configuration $HASH"
else
  docker pull "$IMAGE"  # while the old server still serves
  IFACE=$(__INTERFACE_OF__ "$NODE_IP")
  if [ -z "$IFACE" ]; then echo "no interface holds $NODE_IP" >&2; exit 1; fi
  install -m 0600 /dev/null __ENV__  # it may hold the Ray token: root only
  {
    b64 '{{ Environment }}'; echo "NCCL_SOCKET_IFNAME==$IFACE"; echo "GLOO_SOCKET_IFNAME=$IFACE"
    if [ -n "$RAY_TOKEN_PARAMETER" ]; then
      # The token never travels in the document's parameters: read it here, decrypted, from
      # the SecureString the instance role may read (and nothing else).
      echo "RAY_AUTH_MODE=token"
      printf 'RAY_AUTH_TOKEN=%s\n' "$(aws ssm get-parameter --name "$RAY_TOKEN_PARAMETER" \
        --with-decryption --query Parameter.Value --output text)"
    fi
  } > __ENV__
  b64 '{{ ServerScript }}' > __SCRIPT__
  mapfile -t OPTIONS < <(b64 '{{ DockerOptions }}')
  # The replica leaves the load balancer before any of its members restarts (a pipeline
  # worker's run drains its head too; a second drain finds the target gone and returns).
  if [ -n "$TG" ] && [ -n "$SERVED" ]; then
    # But not while another registered target is out of service: one still `initial` (a
    # replica loading after a day 0 that did not wait for it) or `unhealthy` is out already, and
    # this drain would take one more out than the lanes allow. Another lane's replica in its
    # turn is `draining` or not registered, not waited for here.
    deadline=$((SECONDS + {{ HealthSeconds }}))
    while :; do
      OUT=$(aws elbv2 describe-target-health --target-group-arn "$TG" --output text --query \
        "join(' ', TargetHealthDescriptions[?Target.Id!='$TARGET' && (TargetHealth.State=='initial' \
        || TargetHealth.State=='unhealthy' || TargetHealth.State=='unhealthy.draining')].Target.Id)")
      if [ -z "$OUT" ]; then break; fi
      if [ "$SECONDS" -ge "$deadline" ]; then
        echo "targets $OUT still out of service after {{ HealthSeconds }} s (rollout.healthTimeoutSeconds):" \
          "draining this replica too would take more than rollout.maxUnavailable out; it keeps" \
          "serving and its lane stops here" >&2
        exit 1
      fi
      echo "waiting for $OUT to be in service before this replica drains"
      sleep 10
    done
__ROUTER_LEAVE__    aws elbv2 deregister-targets --target-group-arn "$TG" --targets "Id=$TARGET,Port=$PORT"
    timeout '{{ DrainSeconds }}' aws elbv2 wait target-deregistered \
      --target-group-arn "$TG" --targets "Id=$TARGET,Port=$PORT" || echo "drain timed out; replacing"
  fi
  # vLLM's own graceful shutdown finishes what is still in flight before SIGKILL.
  docker stop --time='{{ StopSeconds }}' __NAME__ >/dev/null 2>&1 || true
  docker rm --force __NAME__ >/dev/null 2>&1 || true
  docker run --detach --name=__NAME__ --label="__LABEL__=$HASH" --env-file=__ENV__ \
    --volume=__SCRIPT__:__SCRIPT__:ro "${OPTIONS[@]}" --entrypoint=/bin/bash "$IMAGE" __SCRIPT__
fi

# 3. A replica head: serving again before this run succeeds (and the lane's next replica
# starts), when it served before or the cluster serves; on a new stack, nothing to wait for.
URL='{{ HealthUrl }}'
if [ -n "$URL" ]; then
  HEALTHY=$(aws elbv2 describe-target-health --target-group-arn "$TG" \
    --query "length(TargetHealthDescriptions[?TargetHealth.State=='healthy'])" --output text)
  if [ -z "$SERVED" ] && [ "$HEALTHY" = 0 ]; then
    echo "nothing serves yet (a new stack): starting without waiting for $URL"
    aws elbv2 register-targets --target-group-arn "$TG" --targets "Id=$TARGET,Port=$PORT"
    exit 0
  fi
  deadline=$((SECONDS + {{ HealthSeconds }}))
  until curl --silent --fail --max-time 5 "$URL" >/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "$URL not healthy in {{ HealthSeconds }} s (rollout.healthTimeoutSeconds): it stays out of" \
        "the target group and its lane stops here" >&2
      exit 1
    fi
    sleep 10
  done
__ROUTER_JOIN__  aws elbv2 register-targets --target-group-arn "$TG" --targets "Id=$TARGET,Port=$PORT"
  aws elbv2 wait target-in-service --target-group-arn "$TG" --targets "Id=$TARGET,Port=$PORT"
fi
"""


# vLLM's router on the master: the bare-metal rollout's calls (router.admin_function,
# router.membership_function) at the address the parameters give.
_ROUTER_FUNCTIONS = """
# vLLM's router on the master (loadBalancer.routing cache-aware, docs/routing.md, "AWS"): the
# replica leaves its worker set before it leaves the target group, and rejoins after its
# health gate.
router_file=$(mktemp)
trap 'rm -f "$router_file"' EXIT
ROUTER_ADDRESS='{{ RouterAddress }}'
if [ -n "$ROUTER_ADDRESS" ]; then printf '%s\\n' "$ROUTER_ADDRESS" >"$router_file"; fi
worker_url='{{ RouterWorker }}'
__ADMIN__
__MEMBERSHIP__
# A router that does not accept a connection within 5 s (its node stopped, or being replaced)
# counts as one not running: each proxy sends to its own vLLM meanwhile, and a router that
# starts takes its workers from its command line.
router_step() {
  local api=''
  [ -s "$router_file" ] && read -r api _ <"$router_file"
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  if [ -n "$api" ] &&
    ! timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "${api%:*}" "${api##*:}" 2>/dev/null; then
    echo "router: $api does not answer (not running, or its node is gone); skipping ${1#router_}"
    return 0
  fi
  "$1"
}
"""


# serving.mode disaggregated: router_leave and router_join through this node's proxy and the
# router's own health checks, not its admin routes (0.1.17's P/D router cannot add a worker
# back: render/router.py, "P/D mode's run-time membership").
_PD_MEMBERSHIP = """
__STATE__
__WAIT__
drain_conf=__PROXY_DIR__/__DRAIN_FILE__
proxy_reload() { docker kill --signal=HUP __PROXY__ >/dev/null 2>&1 || true; }
router_leave() {
  install -d -m 0700 "${drain_conf%/*}"
  printf 'return 503;\\n' >"$drain_conf"
  proxy_reload
  router_wait_state unhealthy || { rm -f "$drain_conf"; proxy_reload; return 1; }
}
router_join() {
  rm -f "$drain_conf"
  proxy_reload
  router_wait_state healthy
}
"""


def _pd_membership() -> str:
    return (
        _PD_MEMBERSHIP.replace("__STATE__", router.worker_state_function('"$router_file"').strip())
        .replace("__WAIT__", router.wait_state_function().strip())
        .replace("__PROXY_DIR__", nginx.PROXY_CONF_DIR)
        .replace("__DRAIN_FILE__", nginx.PROXY_DRAIN_FILE)
        .replace("__PROXY__", nginx.PROXY_CONTAINER_NAME)
        .strip()
    )


def run_script(routed: bool = False, pd: bool = False) -> str:
    """`routed`: loadBalancer.routing cache-aware or serving.mode disaggregated (`pd`: the P/D
    router's membership, _PD_MEMBERSHIP)."""
    functions = (
        _ROUTER_FUNCTIONS.replace("__ADMIN__", router.admin_function('"$router_file"').strip())
        .replace("__MEMBERSHIP__", _pd_membership() if pd else router.membership_function().strip())
        if routed
        else ""
    )
    return (
        _RUN.replace("__ROUTER_FUNCTIONS__", functions.lstrip("\n") + "\n" if routed else "")
        .replace("__ROUTER_LEAVE__", "    router_step router_leave\n" if routed else "")
        .replace("__ROUTER_JOIN__", "  router_step router_join\n" if routed else "")
        .replace("__INTERFACE_OF_FUNCTION__", interface_of_function())
        .replace("__INTERFACE_OF__", INTERFACE_OF)
        .replace("__NAME__", CONTAINER_NAME)
        .replace("__LABEL__", CONFIG_LABEL)
        .replace("__ENV__", ENV_FILE)
        .replace("__SCRIPT__", SERVER_SCRIPT)
        .replace("__DROPIN__", DROPIN_PATH)
        .replace("__HF_CACHE__", HF_CACHE)
        .replace("__CONFIG_DIR__", hostpaths.CONFIG_DIR)
    )


def command_document(
    description: str, step: str, parameters: dict[str, tuple[str, str]], run: str, timeout_seconds: int
) -> str:
    """An SSM Command document (schemaVersion 2.2) of one aws:runShellScript step, as JSON
    text. Every parameter is a String, empty by default, held to its pattern."""
    return json.dumps(
        {
            "schemaVersion": "2.2",
            "description": description,
            "parameters": {
                name: {"type": "String", "default": "", "allowedPattern": pattern, "description": text}
                for name, (pattern, text) in parameters.items()
            },
            "mainSteps": [
                {
                    "action": "aws:runShellScript",
                    "name": step,
                    "inputs": {"runCommand": run.splitlines(), "timeoutSeconds": str(timeout_seconds)},
                }
            ],
        },
        indent=1,
    )


def document(routed: bool = False, pd: bool = False) -> str:
    """The model server's SSM Command document; `routed`: loadBalancer.routing cache-aware or
    serving.mode disaggregated (`pd`)."""
    return command_document(
        "qwen-cluster: run one node's model server (vLLM), draining and gating on health "
        "(qwen_cluster/render/ssm.py)",
        "modelServer",
        parameter_specs(routed),
        run_script(routed, pd),
        RUN_TIMEOUT_SECONDS,
    )


def _encode(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def docker_options(cluster: ClusterConfig) -> list[str]:
    options = [
        "--restart=unless-stopped",
        "--gpus=all",
        "--network=host",
        # host IPC, and with EFA the devices, memlock and IPC_LOCK (collective.py)
        *collective.docker_run_options(cluster),
        f"--volume={HF_CACHE}:{weights.CONTAINER_CACHE}",
    ]
    if cluster.aws and cluster.aws.efa:
        options.append("--volume=/opt/amazon:/opt/amazon:ro")
    return options


def environment(cluster: ClusterConfig, node_name: str) -> dict[str, str]:
    """The container's environment; the run adds the interface variables, found on the host by
    the one finder (collective.interface_environment's spelling)."""
    env = {
        **vllm.environment(cluster, node_name),
        **weights.server_environment(cluster),
        **collective.environment(cluster),
    }
    if cluster.aws and cluster.aws.efa:
        env["LD_LIBRARY_PATH"] = EFA_LIBRARY_PATH
    return env


def config_hash(cluster: ClusterConfig, node_name: str) -> str:
    """What the node's replica runs, hashed: for each member its image, command, environment,
    docker options and the document itself. Equal hash, no restart (sysctl and drain settings
    are not in it). The replica's, not the node's: a pipeline member that restarts leaves the
    head's torch.distributed world (or its Ray cluster), so the head restarts (and is gated)
    with it."""
    parts = []
    for member in cluster.topology.replica_of(node_name).members:
        parts += [
            cluster.model.image,
            vllm.server_script(cluster, member.name),
            json.dumps(environment(cluster, member.name), sort_keys=True),
            "\n".join(docker_options(cluster)),
            run_script(router.needs_router(cluster), cluster.disaggregated),
        ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def parameters(
    cluster: ClusterConfig,
    node_name: str,
    *,
    target_group_arn: Any = "",
    target_id: Any = "",
    ray_token_parameter: Any = "",
    ray_token_version: Any = "",
) -> dict[str, Any]:
    """The association parameters for one node. `target_group_arn` / `target_id` may be Pulumi
    Outputs (the component passes them); they are empty for pipeline workers. With Ray
    (cluster.runs_ray) `ray_token_parameter` names the SecureString holding rayAuthToken and
    `ray_token_version` is its version: the token itself is never a parameter."""
    topology = cluster.topology
    replica = topology.replica_of(node_name)
    node = next(member for member in replica.members if member.name == node_name)
    head = topology.is_head(node_name)
    env = "".join(f"{key}={value}\n" for key, value in environment(cluster, node_name).items())
    routing = (
        {
            "RouterAddress": "{}:{}".format(*router.api_address(cluster)),
            "RouterWorker": router.head_worker_url(cluster, node_name),
        }
        if router.needs_router(cluster)
        else {}
    )
    return {
        "Image": cluster.model.image,
        "ServerScript": _encode(vllm.server_script(cluster, node_name)),
        "Environment": _encode(env),
        "DockerOptions": _encode("\n".join(docker_options(cluster)) + "\n"),
        "Sysctl": _encode(dropin(cluster.tuning.sysctl)),
        "NodeIp": str(node.ip),
        CONFIG_HASH_PARAMETER: config_hash(cluster, node_name),
        # Every member: a pipeline worker drains its replica's head before it restarts.
        "TargetGroupArn": target_group_arn,
        "TargetId": target_id,
        "Port": str(topology.model_port),
        "Region": cluster.aws.region if cluster.aws else "",
        "DrainSeconds": str(cluster.rollout.drain_timeout_seconds),
        "HealthSeconds": str(cluster.rollout.health_timeout_seconds),
        "StopSeconds": str(vllm.stop_grace_seconds(cluster)),
        "RayTokenParameter": ray_token_parameter if cluster.runs_ray else "",
        "RayTokenVersion": ray_token_version if cluster.runs_ray else "",
        # vLLM's own /health where it listens (loopback, behind the node's proxy).
        "HealthUrl": (
            f"http://{vllm.listen_address(cluster, node_name)}:{topology.model_port}{vllm.HEALTH_PATH}"
            if head
            else ""
        ),
        **routing,
    }


# --- staging ---------------------------------------------------------------------------------
# A pull (~10 GB) and 65.6 GB of weights: minutes from S3 in the region, longer from the Hub.
STAGE_TIMEOUT_SECONDS = 2 * 3600
STAGE_PARAMETERS: dict[str, tuple[str, str]] = {
    "StageScript": (_B64, "base64: the script staging image and weights (qwen_cluster/render/weights.py)"),
}
# Two runs of this document can overlap on one node: on a new machine the stack-wide staging
# (by tag) and the node's own start together (components/aws/nodes.py). Each writes its own
# temporary file and renames it into place, so neither moves the other's half-written file away
# (a shared `.new` name made one run fail: `mv: cannot stat`, found by the AWS lab rehearsal).
# A run already reading the script keeps its file; the staging itself takes a lock.
_STAGE_RUN = """#!/bin/bash
set -euo pipefail
install -d -m 0755 __CONFIG_DIR__
STAGE_TMP=$(mktemp __CONFIG_DIR__/model-stage.sh.XXXXXX)
printf '%s' '{{ StageScript }}' | base64 -d > "$STAGE_TMP"
mv -f "$STAGE_TMP" __CONFIG_DIR__/model-stage.sh
bash __CONFIG_DIR__/model-stage.sh
"""


def stage_run_script() -> str:
    return _STAGE_RUN.replace("__CONFIG_DIR__", hostpaths.CONFIG_DIR)


def stage_document() -> str:
    """The staging SSM Command document: one node's image and weights, while it serves."""
    return command_document(
        "qwen-cluster: stage one node's model-server image and weights before any drain "
        "(qwen_cluster/render/weights.py)",
        "modelStage",
        STAGE_PARAMETERS,
        stage_run_script(),
        STAGE_TIMEOUT_SECONDS,
    )


def stage_parameters(cluster: ClusterConfig) -> dict[str, str]:
    """The staging association's parameters: the script alone, which changes exactly when the
    image or the weights do (so the association is replaced, and waited for, exactly then)."""
    return {"StageScript": _encode(weights.stage_script(cluster, HF_CACHE))}


def wait_seconds(cluster: ClusterConfig) -> int:
    """How long `pulumi up` waits for one association's run (wait_for_success_timeout_seconds):
    the other targets back in service (at most the health timeout), its drain, its health, the
    pull."""
    rollout = cluster.rollout
    return rollout.drain_timeout_seconds + 2 * rollout.health_timeout_seconds + PULL_MARGIN_SECONDS


def decoded(value: str) -> str:
    """A base64 parameter back as text (tests, the plan)."""
    return base64.b64decode(value).decode()


def shell_check_text(
    text: str | None = None, parameters: dict[str, tuple[str, str]] = PARAMETERS | ROUTED_PARAMETERS
) -> str:
    """A run script (the model server's by default) with parameters filled by harmless
    placeholders, for `bash -n` and shellcheck."""
    text = run_script() if text is None else text
    for name in parameters:
        text = text.replace("{{ " + name + " }}", "0")
    return text
