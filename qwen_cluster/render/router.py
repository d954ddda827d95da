"""vLLM's router (`vllm-router`, vllm-project/router) for loadBalancer.routing cache-aware and
kv-aware: its pinned image, its command line, the balance thresholds it gets for the replica count,
and the admin calls the rollout makes to it. Pure: text and data.

Signatures:
    balance_thresholds(replicas: int) -> tuple[int, float]   (--balance-abs, --balance-rel)
    worker_url(ip: str, port: int) -> str
    worker_urls(cluster: ClusterConfig) -> list[str]           the replica heads, as the router names them
    listen_address(cluster: ClusterConfig) -> str              where the router binds
    kv_event_sources(cluster: ClusterConfig) -> list[str]      kv-aware: WORKER_URL=tcp://HEAD:PORT per head
    policy_flags(cluster: ClusterConfig) -> list[str]          --policy and its own flags
    command(cluster: ClusterConfig) -> list[str]               the container's command, argv[0] first
    pool_urls(cluster: ClusterConfig, pool: str) -> list[str]  serving.mode disaggregated: a pool's workers
    pd_listener(cluster, node_name) -> tuple[str, int]          P/D: where the router reaches a replica
    worker_state_function(address_file: str) -> str            bash `router_worker_state URL` (P/D)
    wait_state_function() -> str                               bash `router_wait_state STATE` (P/D)
    admin_function(address_file: str) -> str                   bash `router_ctl add|remove URL`
    running_function(address_file: str) -> str                 bash `router_running URL`
    address_line(api: tuple[str, int]) -> str                  nginx.ROUTER_FILE's line

Every flag rendered here exists in both of the release's command lines, checked in its own source
(0.1.17, PyPI of Nov 2026): the wheel's console script `vllm-router` is the Python launcher
(vllm_router/launch_router.py, flags in vllm_router/router_args.py RouterArgs.add_cli_args), and the
published image's `vllm-router` is the Rust binary (Dockerfile.router copies
target/release/vllm-router; flags in src/main.rs CliArgs, clap). The two sets differ elsewhere (the
Rust `--eviction-interval` is the wheel's `--eviction-interval-secs`), so nothing outside the
common set is rendered. Exception: the kv_aware policy's flags (--kv-event-source,
--kv-event-block-size, --kv-event-model) are read in the wheel's launcher and run with its router;
the Rust CLI's src/main.rs at 0.1.17 was not at hand to check (the source stored here predates
kv_aware), so the published image's acceptance of them is unverified.
"""

from __future__ import annotations

import ipaddress

from qwen_cluster import ports as port_table
from qwen_cluster.render.vllm import HEALTH_PATH

VERSION = "0.1.17"
# What a real deploy pulls: the project's published image. Its release pipeline pushes
# `vllm/vllm-router:v${VERSION}` (multi-arch) and `latest` to Docker Hub
# (vllm-project/router .buildkite/scripts/publish-release-images.sh), built from Dockerfile.router
# (python:3.12-slim plus the Rust binary at /usr/local/bin/vllm-router; no ENTRYPOINT, so the
# container's command is the whole argv). Pinned: `latest` would move the router on the next
# `pulumi up`. The lab builds the same tag from the PyPI wheel vllm-router==VERSION.
IMAGE = f"vllm/vllm-router:v{VERSION}"
CONTAINER_NAME = "qwen-router"
LOOPBACK = "127.0.0.1"
# The policy per loadBalancer.routing. cache_aware: a prefix tree per worker of what it was sent
# (src/policies/cache_aware.rs); a prompt goes to the worker with the longest match when the match
# ratio exceeds --cache-threshold, unless the load is imbalanced (below): then to the least loaded.
# The source's header says a miss goes to the worker with the smallest tree; 0.1.17 measured in the
# lab keys the tree by token ids (from the replicas' render routes: vllm.scale_out_flags) and sent
# misses by load (ties: the first). kv_aware: an index of the blocks each worker really holds, fed
# by the workers' own KV-cache events (BlockStored/BlockRemoved over ZMQ, vllm.kv_events_flags),
# the prompt's token ids again from the render routes, hashed in blocks of --kv-event-block-size
# (the 0.1.17 wheel: src/kv_index/, src/policies/kv_aware.rs; `vllm_router_kv_placement_lookups_total`
# counts its hits and misses).
POLICIES = {"cache-aware": "cache_aware", "kv-aware": "kv_aware"}
# The router's own default (router_args.py RouterArgs.cache_threshold, main.rs default 0.3).
CACHE_THRESHOLD = 0.3
# How often the router checks each worker's /health (both CLIs: --health-check-interval-secs,
# default 60 s). A replica that dies between the rollout's calls is found within this much;
# 60 s of requests to a dead worker is too long, nginx's own fail window is 30 s.
HEALTH_CHECK_INTERVAL_SECONDS = 5
# How long an admin call may take. /add_worker waits for the worker's health up to
# --worker-startup-timeout-secs before it answers (measured with the 0.1.17 wheel: a dead worker
# answered 400 "Timeout 20s waiting for worker ... to become healthy" after 30 s; a healthy one in
# 0.01 s), and the ready step calls it only after the replica answered /health.
ADMIN_TIMEOUT_SECONDS = 60
# The router's relative threshold for the load guard: the bound on the busiest replica
# (at most 1.25x the mean) taken as the ratio of the busiest to the least busy worker's
# in-flight requests. The defaults (64, 1.5: router_args.py) are sized for dozens of busy
# workers.
BALANCE_REL_THRESHOLD = 1.25


def balance_thresholds(replicas: int) -> tuple[int, float]:
    """(--balance-abs-threshold, --balance-rel-threshold) for `replicas` workers.

    The router counts each worker's load as its own requests in flight (Worker::load, raised
    when it routes a request and lowered when the response ends) and calls the load
    imbalanced when max - min > abs AND max > min x rel (cache_aware.rs
    select_worker_cache_aware_with_decision); only then does it give up the prefix match and
    pick the least loaded worker. With 2-4 replicas the in-flight counts stay in the tens, so
    the default abs of 64 never fires and affinity alone decides: HAProxy hashing measured that
    on this very model (up to 83 % of the requests on one replica).

    abs = the replica count, at least 2: one request over is the normal state just after any
    decision; with R replicas, a burst of R requests that share one prefix (one per replica's
    worth of work) may all land on the replica that holds it before the router spreads the
    next ones. rel = BALANCE_REL_THRESHOLD. Both are measured by the routing benchmark
    (docs/routing.md) and move only with its figures."""
    if replicas < 1:
        raise ValueError(f"replicas {replicas} must be at least 1")
    return max(2, replicas), BALANCE_REL_THRESHOLD


def worker_url(ip: str, port: int) -> str:
    """How the router names a worker: the URL it was given (the admin routes take it as `url`)."""
    return f"http://{ip}:{int(port)}"


def worker_port(cluster) -> int:
    """The port the router reaches each replica at: vLLM's own on bare metal; on AWS the head's
    proxy listener for the router (`router-worker` row, render/proxy.py), since vLLM binds loopback
    there and the proxies' client listeners send to the router (a loop)."""
    return cluster.router_worker_port or cluster.model_port


def worker_urls(cluster) -> list[str]:
    return [worker_url(str(head.ip), worker_port(cluster)) for head in cluster.topology.heads]


def head_worker_url(cluster, node_name: str) -> str:
    """The router's URL for the replica `node_name` belongs to (its head's)."""
    head = cluster.topology.replica_of(node_name).head
    return worker_url(str(head.ip), worker_port(cluster))


def listen_address(cluster) -> str:
    """Loopback on the load-balancer host (bare metal), where nginx and the rollout's scripts run:
    nothing else needs the router. AWS: the master's address, for every node's proxy and every
    node's drain (members only: the `router` row's scope is cluster)."""
    if cluster.aws is not None:
        return str(cluster.master.ip)
    return LOOPBACK


def api_address(cluster) -> tuple[str, int]:
    """Where the router's API (and admin routes) answer: (address, port)."""
    return listen_address(cluster), int(cluster.router_port)


# P/D mode's run-time membership (serving.mode disaggregated). Measured with the 0.1.17 wheel and
# stand-in workers: /remove_worker takes a P/D worker out, but nothing puts one back: /add_worker
# and POST /workers answer 400 "PD router requires specific add_prefill_server or
# add_decode_server methods" (pd_router.rs has those methods; no route reaches them without
# --enable-igw). What does work is the router's own health checker: a worker whose /health fails
# --health-failure-threshold (3) checks in a row gets no requests, and gets its share again
# after --health-success-threshold (2) passes (measured: a prefill worker answering 503 got none,
# then its share). And a prefill worker's 500 reaches the client (measured: not retried), so a
# replica must be out of the router's choice before vLLM's own shutdown answers 500 to new
# requests (its /health still 200: render/vllm.py). So the router reaches each replica through
# a listener that answers its health checks 503 while the replica's drain marker exists
# (nginx.worker_listener): on bare metal nginx on the load-balancer host, at a loopback alias
# per replica (LOOPBACK_ALIAS_BASE + the replica's index, the model port: 127/8 is the host's
# own, so the alias needs no interface and no row of the table; vLLM binds the node address);
# on AWS each node's proxy, at the `router-worker` row (render/proxy.py). The rollout writes and
# removes the marker and waits for the router to see it (render/rollout.py).
LOOPBACK_ALIAS_BASE = ipaddress.ip_address("127.1.0.1")
HEALTH_FAILURES = 3  # --health-failure-threshold, the default of both CLIs (rendered)
HEALTH_SUCCESSES = 2  # --health-success-threshold, the same
HEALTH_CHECK_TIMEOUT_SECONDS = 5  # --health-check-timeout-secs, the same
# How long the rollout waits for the router to take a marked replica out or a healthy one back.
PD_HEALTH_WAIT_SECONDS = (HEALTH_FAILURES + 1) * (
    HEALTH_CHECK_INTERVAL_SECONDS + HEALTH_CHECK_TIMEOUT_SECONDS
)


def pd_listener(cluster, node_name: str) -> tuple[str, int]:
    """Where the router reaches the replica `node_name` heads in P/D mode (see above)."""
    replica = cluster.topology.replica_of(node_name)
    if cluster.aws is not None:
        return str(replica.head.ip), worker_port(cluster)
    return str(LOOPBACK_ALIAS_BASE + replica.index), cluster.model_port


def pool_urls(cluster, pool: str) -> list[str]:
    """The router's URLs of one pool's replicas (serving.mode disaggregated), in node order."""
    section = getattr(cluster.serving, pool)
    names = set(section.nodes) if section is not None else set()
    heads = [head for head in cluster.topology.heads if head.name in names]
    return [worker_url(*pd_listener(cluster, head.name)) for head in heads]


# serving.mode disaggregated: the router's P/D mode with NIXL, as both CLIs of 0.1.17 take it
# (read in the wheel's vllm_router/router_args.py and the Rust src/main.rs):
# `--vllm-pd-disaggregation`; `--prefill URL` once per prefill worker (the Python launcher's
# `nargs="+", action="append"`, the Rust split_prefill_args_from_others: a URL, then an optional
# bootstrap port); `--decode URL` once per decode worker (`nargs=1, action="append"` /
# `ArgAction::Append`); `--kv-connector nixl` (choices nixl, mooncake, moriio / KvConnector).
# No bootstrap port: it is SGLang's and Mooncake's handshake (the router injects bootstrap_host
# and bootstrap_port into the request, pd_router.rs inject_bootstrap_into_value); NIXL's decode
# side learns the prefill side's side channel from vLLM's own kv_transfer_params
# (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, render/kvtransfer.py). Measured with the 0.1.17 wheel: P/D
# workers without a port, /workers lists them as prefill (bootstrap_port null) and decode.
KV_CONNECTOR = "nixl"


def pd_worker_flags(prefill: list[str], decode: list[str]) -> list[str]:
    """`--vllm-pd-disaggregation --prefill URL ... --decode URL ... --kv-connector nixl` for the
    given worker URLs (the lab's P/D rehearsal passes its own, labkit/cluster/pdlab.py)."""
    prefill_flags = [arg for url in prefill for arg in ("--prefill", url)]
    decode_flags = [arg for url in decode for arg in ("--decode", url)]
    return ["--vllm-pd-disaggregation", *prefill_flags, *decode_flags, "--kv-connector", KV_CONNECTOR]


def _pd_workers(cluster) -> list[str]:
    """The two pools' replicas as the router's P/D workers (pd_worker_flags)."""
    return pd_worker_flags(pool_urls(cluster, "prefill"), pool_urls(cluster, "decode"))


def kv_event_sources(cluster) -> list[str]:
    """`--kv-event-source` values, one per replica head: `WORKER_URL=tcp://HEAD:PORT`, the worker
    named as in --worker-urls (the router keys its index by that URL) and the head's publisher at
    the `kv-events` row (vllm.kv_events_endpoint binds every interface of the head)."""
    return [
        f"{worker_url(str(head.ip), worker_port(cluster))}=tcp://{head.ip}:{int(cluster.kv_events_port)}"
        for head in cluster.topology.heads
    ]


def policy_flags(cluster) -> list[str]:
    """The policy and its own flags for loadBalancer.routing.

    cache-aware: the threshold and the load bound (balance_thresholds).

    kv-aware: one static event source per replica head, the replicas' block size
    (cluster.kv_block_size, rendered on the replicas too: with another size the router's hashes
    match nothing, measured) and a model identity. The 0.1.17 router refuses static sources
    without `--kv-event-model` ("static KV event sources require worker URLs and model identity");
    the name is the served model's (any one name shared by the sources did the same, measured).
    Flags of the wheel's launcher (vllm_router/router_args.py: --kv-event-source,
    --kv-event-block-size, --kv-event-model); the rest stays at the release's defaults
    (--router-temperature 0: the lowest cost wins)."""
    if cluster.load_balancer.routing == "kv-aware":
        sources = [word for source in kv_event_sources(cluster) for word in ("--kv-event-source", source)]
        return [
            "--policy",
            POLICIES["kv-aware"],
            *sources,
            "--kv-event-block-size",
            str(cluster.kv_block_size),
            "--kv-event-model",
            cluster.model.name,
        ]
    absolute, relative = balance_thresholds(len(cluster.topology.heads))
    return [
        "--policy",
        POLICIES["cache-aware"],
        "--cache-threshold",
        str(CACHE_THRESHOLD),
        "--balance-abs-threshold",
        str(absolute),
        "--balance-rel-threshold",
        str(relative),
    ]


def command(cluster) -> list[str]:
    """The router's argv (pure). Workers are the replica heads' vLLM; no key is sent to them
    (`--api-key` is the key the router sends workers, and vLLM has none here: nginx keeps the
    client keys), and the router checks none (`--api-key-validation-urls` unset). With
    serving.mode disaggregated the workers are the two pools (`_pd_workers`) and the policy is
    loadBalancer.routing's as without it: it picks the prefill and the decode worker alike
    (router_args.py: "In PD mode, prefill and decode inherit this policy unless overridden")."""
    workers = _pd_workers(cluster) if cluster.disaggregated else ["--worker-urls", *worker_urls(cluster)]
    return [
        "vllm-router",
        "--host",
        listen_address(cluster),
        "--port",
        str(cluster.router_port),
        *workers,
        *policy_flags(cluster),
        # Loopback only, read by the node's monitoring endpoint (source `router`).
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(port_table.ROUTER_METRICS_PORT),
        "--health-check-endpoint",
        HEALTH_PATH,
        "--health-check-interval-secs",
        str(HEALTH_CHECK_INTERVAL_SECONDS),
        *(
            [
                "--health-failure-threshold",
                str(HEALTH_FAILURES),
                "--health-success-threshold",
                str(HEALTH_SUCCESSES),
                "--health-check-timeout-secs",
                str(HEALTH_CHECK_TIMEOUT_SECONDS),
            ]
            if cluster.disaggregated
            else []
        ),
        # The router waits this long for its workers at start (both CLIs,
        # --worker-startup-timeout-secs, default 600 s): as long as the rollout waits for a
        # replica's health, since Qwen3-32B's weights can take longer than 10 minutes to load.
        "--worker-startup-timeout-secs",
        str(cluster.rollout.health_timeout_seconds),
        # Generations can run as long as a client connection may stay silent, and longer: the
        # router's default request timeout (1800 s) must not end what nginx lets run.
        "--request-timeout-secs",
        str(max(1800, cluster.load_balancer.idle_timeout_seconds)),
        "--log-level",
        "info",
    ]


def admin_function(address_file: str) -> str:
    """bash `router_ctl add|remove URL`: the router's admin routes (src/server.rs build_app
    `admin_routes`: POST /add_worker?url=, POST /remove_worker?url=, on the API listener), at the
    `host:port` written first in `address_file` (a shell word, e.g. "$router_file"; nginx.install_script
    writes it with cache-aware routing and removes it without). Exit 4: no router configured (no
    file); 3: nothing listens (the router is not running: nginx sends to the replicas directly,
    and a router that starts takes its workers from its command line). /remove_worker answers
    200 whether or not it knew the worker; /add_worker answers 400 with the reason when it
    cannot add it ("already exists" counts as done here). bash's /dev/tcp, no curl on the host."""
    return f"""
router_ctl() {{
  local path reply code api host port
  case "$1" in
    add) path=/add_worker ;;
    remove) path=/remove_worker ;;
    *) echo "router_ctl: add or remove, not $1" >&2; return 2 ;;
  esac
  [ -s {address_file} ] || return 4
  read -r api _ <{address_file}
  host=${{api%:*}}
  port=${{api##*:}}
  local status=0
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  reply=$(timeout {ADMIN_TIMEOUT_SECONDS} bash -c '
    exec 3<>"/dev/tcp/$0/$1" || exit 3
    printf "POST %s?url=%s HTTP/1.0\\r\\nHost: %s\\r\\nContent-Length: 0\\r\\n\\r\\n" \\
      "$2" "$3" "$0" >&3
    cat <&3
  ' "$host" "$port" "$path" "$2" 2>/dev/null </dev/null) || status=$?
  if [ "$status" = 3 ]; then
    return 3
  elif [ "$status" != 0 ]; then
    echo "router: $1 $2: no answer from $host:$port within {ADMIN_TIMEOUT_SECONDS} s" >&2
    return 1
  fi
  code=$(printf '%s\\n' "$reply" | head -n 1 | cut -d ' ' -f 2)
  if [ "$code" = 200 ] || {{ [ "$1" = add ] && printf '%s' "$reply" | grep -q 'already exists'; }}; then
    echo "router: $1 $2: ok"
    return 0
  fi
  echo "router: $1 $2 answered ${{code:-nothing}}: $(printf '%s' "$reply" | tail -n 1)" >&2
  return 1
}}
"""


def membership_function() -> str:
    """bash `router_leave` / `router_join`: `$worker_url` out of and back into the router's
    workers, through router_ctl (admin_function, defined before it). Shared by the bare-metal
    rollout (render/rollout.py) and the AWS model-server run (render/ssm.py)."""
    return """
# The replica in the router's worker set (vLLM's router on this host, when nginx's files name
# one). No router configured (4): nothing to do. Not running (3): nginx sends to the replicas
# directly meanwhile, and the router takes its workers from its command line when it starts.
# Any other failure stops the step: the replica is never stopped while the router may still
# send it requests.
router_call() {
  local status=0
  router_ctl "$1" "$worker_url" || status=$?
  case "$status" in
    0 | 4) return 0 ;;
    3) echo "router: not running; nothing to $1"; return 0 ;;
  esac
  return "$status"
}
router_leave() { router_call remove; }
router_join() { router_call add; }
"""


def running_function(address_file: str) -> str:
    """bash `router_running URL`: how many requests the router has in flight to the worker URL,
    from its own gauge (src/metrics.rs `vllm_router_running_requests{worker}`; measured with the
    0.1.17 wheel: 1 during a stream, also after /remove_worker took the worker out, 0 once it
    ended), read from its metrics listener named second in `address_file`. 0 without a router
    or an answer: a router that does not answer holds no stream. The drain counts this instead
    of the router's connections, which its client keeps open idle for a while after the last
    request (measured: the last one closed 90 s after /remove_worker)."""
    return f"""
router_running() {{
  local metrics
  [ -s {address_file} ] || {{ echo 0; return 0; }}
  read -r _ metrics <{address_file}
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  timeout 5 bash -c '
    exec 3<>"/dev/tcp/$0/$1" || exit 0
    printf "GET /metrics HTTP/1.0\\r\\nHost: %s\\r\\n\\r\\n" "$0" >&3
    cat <&3
  ' "${{metrics%:*}}" "${{metrics##*:}}" 2>/dev/null </dev/null |
    awk -v series="vllm_router_running_requests{{worker=\\"$1\\"}}" '
      $1 == series {{ found = $2 + 0 }}
      END {{ printf "%d\\n", found + 0 }}
    '
}}
"""


def address_line(api: tuple[str, int]) -> str:
    """What nginx's install script writes in its ROUTER_FILE: the API and the metrics listener."""
    return f"{api[0]}:{int(api[1])} {LOOPBACK}:{port_table.ROUTER_METRICS_PORT}"


def needs_router(cluster) -> bool:
    return cluster.router_port is not None


def worker_state_function(address_file: str) -> str:
    """bash `router_worker_state URL`: what the router thinks of the worker URL, from its worker
    list (GET /workers, src/server.rs list_workers_rest: `{"workers": [{"url": ..., "is_healthy":
    true|false, ...}]}`): prints healthy, unhealthy or absent. Exit 4: no router configured (no
    file); 3: nothing listens. bash's /dev/tcp, no curl on the host."""
    return f"""
router_worker_state() {{
  local api host port reply entry status=0
  [ -s {address_file} ] || return 4
  read -r api _ <{address_file}
  host=${{api%:*}}
  port=${{api##*:}}
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  reply=$(timeout 10 bash -c '
    exec 3<>"/dev/tcp/$0/$1" || exit 3
    printf "GET /workers HTTP/1.0\\r\\nHost: %s\\r\\n\\r\\n" "$0" >&3
    cat <&3
  ' "$host" "$port" 2>/dev/null </dev/null) || status=$?
  [ "$status" = 0 ] || return 3
  entry=$(printf '%s' "$reply" | grep -o "\\"url\\":\\"$1\\"[^}}]*" | head -n 1 || true)
  case "$entry" in
    "") echo absent ;;
    *'"is_healthy":true'*) echo healthy ;;
    *) echo unhealthy ;;
  esac
}}
"""


def wait_state_function() -> str:
    """bash `router_wait_state healthy|unhealthy`: wait until the router calls `$worker_url` that,
    at most PD_HEALTH_WAIT_SECONDS (worker_state_function defined before it). No router configured
    or running: nothing to wait for (nginx, or each node's proxy, sends to the replicas meanwhile,
    and a router that starts checks their health itself). A worker the router does not list is
    neither sent to nor waited for."""
    wait = PD_HEALTH_WAIT_SECONDS
    return f"""
router_wait_state() {{
  local deadline=$((SECONDS + {wait})) state status
  while :; do
    status=0
    state=$(router_worker_state "$worker_url") || status=$?
    case "$status" in 3 | 4) echo "router: not running; nothing to wait for"; return 0 ;; esac
    if [ "$state" = "$1" ] || [ "$state" = absent ]; then
      echo "router: $worker_url is $state"
      return 0
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "router: $worker_url is still $state after {wait} s (wanted $1)" >&2
      return 1
    fi
    sleep 1
  done
}}
"""
