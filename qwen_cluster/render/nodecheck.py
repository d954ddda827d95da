"""What a node checks about itself, beyond the probe matrix: the causes in docs/monitoring.md's
table of "The ten failures" that only the node can see. A bash section of the verify
script (qwen_cluster/render/verify.py): `verify` runs it at deploy time, `doctor` any time.

Signatures:
    container_name(cluster, node_name) -> str   the model server's container on that node
    section(cluster, node_name) -> str          bash, run after verify's helpers are defined
    router_section(cluster, node_name) -> str   its part on the router's node (cache-aware)

It asks what the program's own scripts ask: `getent` for the node's name, the one NIC finder
and /sys for the interface and its MTU, `docker inspect` / `docker exec` / `docker logs` for
the running model server. A check that cannot run (no docker, no daemon, no model server
running, docker telling neither what is asked nor what stands for it) is a `container` finding:
nothing passes because it was not seen.

Each finding is one line on stdout, `qwen|finding|<check>|<node>|<peer or ->|<detail>`, and a
line for the people reading the log; each fact another doctor compares across a replica is
`qwen|fact|<key>|<node>|<value>` (mtu, image, model). tooling/doctor.py tells each check in the
guide's terms (its CHECKS table).
"""

from __future__ import annotations

from qwen_cluster import tags
from qwen_cluster.config import ClusterConfig
from qwen_cluster.render import collective, router, weights
from qwen_cluster.render.shell import INTERFACE_OF, interface_of_function, quote

# What NCCL's and its transports' logs say when a cause of the table happened (the lines are
# quoted in tests/data/doctor/ with their sources).
LOG_PATTERNS = {
    "transport": r"NCCL INFO Using network Socket|NET/Socket : Using",
    "efa-devices": r"fi_getinfo\(\) (call )?failed|NET/OFI .*Unable to find a (libfabric|protocol)",
    "memlock": r"ibv_reg_mr.*Cannot allocate memory|Cannot allocate memory.*ibv_reg_mr",
    "shm": r"Error while creating shared memory segment",
}
# docker inspect templates (Go text/template over the container's JSON).
MEMLOCK_FORMAT = '{{range .HostConfig.Ulimits}}{{if eq .Name "memlock"}}{{.Soft}}{{end}}{{end}}'
DEVICES_FORMAT = "{{range .HostConfig.Devices}}{{.PathOnHost}} {{end}}"
LOG_LINES = 20000  # of the model server's log, the latest: NCCL logs its transport at init


def container_name(cluster: ClusterConfig, node_name: str) -> str:
    """The model server's container name: one on every member, head or pipeline worker, on both
    targets (components/baremetal/serving.py and qwen_cluster/render/ssm.py name it so; the
    role is its label, tags.CONTAINER_ROLE_LABEL)."""
    return tags.MODEL_SERVER_CONTAINER


def router_section(cluster: ClusterConfig, node_name: str) -> str:
    """vLLM's router's container on its node (loadBalancer.routing cache-aware: the load-balancer
    node on bare metal, the master on AWS): a warning when it is not running, since nginx (bare
    metal) or every node's proxy (AWS) then sends to the replicas directly (a degradation, not an
    outage: the deploy goes on, doctor names it). Empty elsewhere."""
    where = cluster.router_node
    if where is None or where.name != node_name:
        return ""
    name = router.CONTAINER_NAME
    sender = "nginx on this node sends" if cluster.aws is None else "every node's proxy sends"
    fallback = (
        "nginx sends to the replicas directly" if cluster.aws is None else "each proxy sends to its own vLLM"
    )
    return f"""
# 5. vLLM's router, which {sender} to (docs/routing.md).
if ! router_state=$(docker inspect --type container -f '{{{{.State.Status}}}}' {name} 2>&1); then
  router_state="absent (${{router_state:0:120}})"
fi
if [ "$router_state" != running ]; then
  warn router "$node" - "vLLM's router ({name}) is $router_state: {fallback}"
fi
{_kv_events_check(cluster)}"""


def _kv_events_check(cluster: ClusterConfig) -> str:
    """kv-aware: every replica head's KV-event publisher accepts a connection from the router's
    node. The router's subscriber connects and waits without a word when nothing listens (ZMQ),
    and its metrics name no source (vllm-router 0.1.17: `vllm_router_kv_placement_lookups_total`
    by result only), so a publisher that is not bound (vLLM connects instead for an endpoint
    without a wildcard: render/vllm.py kv_events_endpoint) or a rule that drops the port shows
    nowhere else: the router places that replica's prompts as if it held nothing."""
    if cluster.kv_events_port is None:
        return ""
    heads = " ".join(str(head.ip) for head in cluster.topology.heads)
    port = cluster.kv_events_port
    return f"""
# 6. Each replica head's KV-event publisher, from this node (loadBalancer.routing kv-aware).
for head in {heads}; do
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  if ! timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$head" {port} 2>/dev/null; then
    warn kv-events "$node" "$head" "the KV-event publisher at $head:{port} does not accept a \
connection: vLLM's router gets no events from that replica and places its prompts by load"
  fi
done
"""


def section(cluster: ClusterConfig, node_name: str) -> str:
    node = next(n for n in cluster.nodes if n.name == node_name)
    net = collective.transport(cluster)
    fast = net != collective.NET_SOCKET
    patterns = "\n".join(f"{check}|{pattern}" for check, pattern in LOG_PATTERNS.items())
    return f"""
# ---- the node itself (qwen_cluster/render/nodecheck.py)
node={quote(node_name)}
node_ip={quote(str(node.ip))}
container={quote(container_name(cluster, node_name))}
want_net={quote(net)}
want_model={quote(weights.model_path(cluster))}
want_image={quote(cluster.model.image)}
fast={"yes" if fast else "no"}
min_shm_kb={collective.MIN_SHM_BYTES // 1024}
# A check that could not run: a finding, so that nothing passes unseen.
unchecked() {{ report container "$node" - "$1"; }}
fact() {{ echo "qwen|fact|$1|$node|$2"; }}
{interface_of_function()}

# 1. The node's name resolves to its cluster address, not loopback (what Gloo, Ray and torch
# fall back to when no interface or address is given). A warning for verify: the program gives
# every member GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME and its address, which take precedence.
name=$(hostname)
resolved=$(getent ahostsv4 "$name" 2>/dev/null | awk 'NR == 1 {{print $1}}' || true)
case "$resolved" in
  "$node_ip") echo "hostname $name resolves to $resolved: ok" ;;
  "") warn hostname "$node" - "the hostname $name does not resolve (getent ahostsv4 $name)" ;;
  127.*) warn hostname "$node" - "the hostname $name resolves to loopback $resolved, not $node_ip" ;;
  *) warn hostname "$node" - "the hostname $name resolves to $resolved, not the node address $node_ip" ;;
esac

# 2. The interface holding the node address, and its MTU (doctor compares it across members).
iface=$({INTERFACE_OF} "$node_ip")
if [ -z "$iface" ]; then
  report interface "$node" - "no interface holds the node address $node_ip"
else
  mtu=$(cat "/sys/class/net/$iface/mtu")
  echo "cluster interface $iface, MTU $mtu"
  fact mtu "$mtu"
  fact interface "$iface"
  # Who else is on the segment: the neighbour table (doctor names the non-members, and leaves
  # out the default gateway). FAILED and INCOMPLETE entries never answered.
  neighbours=$(ip -4 neigh show dev "$iface" 2>/dev/null \\
    | awk '$NF != "FAILED" && $NF != "INCOMPLETE" {{print $1}}' | tr '\n' ' ' || true)
  fact neighbours "$neighbours"
  fact gateway "$(ip -4 route show default 2>/dev/null | awk '{{print $3; exit}}' || true)"
fi

# 3. The model server as it runs: what docker says about it.
inspect() {{ docker inspect --type container -f "$1" "$container" 2>/dev/null || true; }}
memlock_format={quote(MEMLOCK_FORMAT)}
devices_format={quote(DEVICES_FORMAT)}
if ! command -v docker >/dev/null; then
  unchecked "no docker CLI on this node: the model server's checks cannot run"
elif ! running=$(docker inspect --type container -f '{{{{.State.Running}}}}' "$container" 2>&1); then
  unchecked "docker inspect $container: ${{running:0:200}}"
elif [ "$running" != true ]; then
  state=$(inspect '{{{{.State.Status}}}} (exit {{{{.State.ExitCode}}}})')
  unchecked "$container is not running here: ${{state:-?}} (docker inspect)"
else
  # What docker's inspect tells of the configuration (empty: it tells nothing, e.g. a stand-in).
  network=$(inspect '{{{{.HostConfig.NetworkMode}}}}')
  image=$(inspect '{{{{.Config.Image}}}} {{{{.Image}}}}')
  if [ -n "$image" ]; then
    fact image "$image"
    # The image as the container was given it (what the program gives every member: model.image).
    if [ "${{image%% *}}" != "$want_image" ]; then
      report image "$node" - "$container runs ${{image%% *}}, not model.image $want_image"
    fi
  else
    unchecked "docker tells not which image $container runs"
  fi
  # The process's own environment (what the entry script exported), else the container's.
  env_text=$(docker exec "$container" cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n') || env_text=''
  if [ -z "$env_text" ]; then env_text=$(inspect '{{{{range .Config.Env}}}}{{{{println .}}}}{{{{end}}}}'); fi
  if [ -z "$env_text" ]; then
    unchecked "docker tells neither $container's process environment nor its configuration"
  else
    value() {{ sed -n "s/^$1=//p" <<<"$env_text" | tail -n1; }}
    host_ip=$(value VLLM_HOST_IP)
    if [ "$host_ip" != "$node_ip" ]; then
      report node-address "$node" - \\
        "VLLM_HOST_IP is '${{host_ip}}' in $container, not the node address $node_ip"
    fi
    for var in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
      got=$(value "$var")
      if [ -z "$got" ]; then
        report interface-env "$node" - "$var is not set in $container"
      elif [ -n "$iface" ] && [ "${{got#=}}" != "$iface" ]; then
        report interface-env "$node" - "$var is '$got' in $container, but $node_ip is on $iface"
      fi
    done
    got=$(value NCCL_NET)
    if [ "$got" != "$want_net" ]; then
      report transport-pin "$node" - "NCCL_NET is '${{got}}' in $container, not '$want_net'"
    fi
    model=$(docker inspect --type container -f '{{{{join .Config.Cmd " "}}}}' "$container" 2>/dev/null \\
      | grep -o -- "vllm serve [^ ]*" | awk '{{print $3}}' || true)
    if [ -n "$model" ]; then
      fact model "$model"
      if [ "$model" != "$want_model" ]; then
        report model-path "$node" - "$container serves $model, not $want_model"
      fi
    fi
  fi
  # /dev/shm and memlock inside the container (causes 5 and 6).
  shm_kb=$(docker exec "$container" df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {{print $2}}') || shm_kb=''
  ipc=$(inspect '{{{{.HostConfig.IpcMode}}}}')
  if [ -n "$shm_kb" ]; then
    if [ "$shm_kb" -lt "$min_shm_kb" ]; then
      report shm "$node" - \\
        "/dev/shm in $container is $((shm_kb / 1024)) MiB (ipc ${{ipc:-?}}), below $((min_shm_kb / 1024)) MiB"
    fi
  elif [ -n "$ipc" ] && [ "$ipc" != host ]; then
    shm_bytes=$(inspect '{{{{.HostConfig.ShmSize}}}}')
    if [ "${{shm_bytes:-0}}" -lt $((min_shm_kb * 1024)) ]; then
      report shm "$node" - \\
        "$container runs with ipc $ipc and a ${{shm_bytes:-default}}-byte /dev/shm, not the host's"
    fi
  elif [ -z "$ipc" ]; then
    unchecked "docker tells neither /dev/shm's size in $container nor its IPC mode"
  fi
  if [ "$fast" = yes ]; then
    memlock=$(docker exec "$container" sh -c 'ulimit -l' 2>/dev/null) || memlock=''
    if [ -z "$memlock" ]; then
      memlock=$(inspect "$memlock_format")
      if [ "$memlock" = -1 ]; then memlock=unlimited; fi
    fi
    if [ -z "$memlock" ] && [ -n "$network" ]; then
      report memlock "$node" - "$container has no memlock ulimit: dockerd's default limit applies"
    elif [ -z "$memlock" ]; then
      unchecked "docker tells no memlock limit for $container"
    elif [ "$memlock" != unlimited ]; then
      report memlock "$node" - "memlock in $container is $memlock KiB, not unlimited"
    fi
    devices=$(docker exec "$container" ls /dev/infiniband 2>/dev/null) || devices=''
    if [ -z "$devices" ]; then
      if [ -z "$network" ]; then
        unchecked "docker tells neither /dev/infiniband in $container nor its devices"
      elif ! inspect "$devices_format" | grep -q /dev/infiniband; then
        report efa-devices "$node" - "$container has no /dev/infiniband: NCCL cannot open the RDMA devices"
      fi
    fi
  fi
  # 4. What NCCL says it did (the transport it chose, and the errors of the table).
  if log=$(docker logs --tail {LOG_LINES} "$container" 2>&1); then
    while IFS='|' read -r check pattern; do
      line=$(grep -E -m1 -- "$pattern" <<<"$log" || true)
      if [ -n "$line" ] && {{ [ "$check" != transport ] || [ "$fast" = yes ]; }}; then
        report "$check" "$node" - "$container logged: ${{line:0:200}}"
      fi
    done <<'QWEN_PATTERNS_EOF'
{patterns}
QWEN_PATTERNS_EOF
  else
    unchecked "docker logs $container: ${{log:0:200}}"
  fi
fi
{router_section(cluster, node_name)}"""
