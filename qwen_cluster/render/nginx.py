"""nginx.conf for the client endpoint, done right for streamed LLM responses: the bare-metal
load balancer, and (server_block, the same text) each AWS node's proxy. The endpoint is locked:
the API key check (access.apiKeys), the route allowlist (API_ROUTES and /health, nothing else of
vLLM) and TLS (loadBalancer.tls: 1.2 and 1.3, Mozilla's intermediate ciphers).

Signatures:
    upstream_servers(cluster: ClusterConfig) -> list[tuple[str, int]]   replica heads' model port
                                                                         (P/D: the decode pool's)
    render(servers: list[tuple[str, int]], *, listen_port: int, idle_timeout_seconds: int,
           runtime_dir: str = "/var/cache/nginx", log_dir: str = "/var/log/nginx",
           pid_file: str = "/var/run/nginx.pid", user: str | None = "nginx",
           upstream_file: str | None = None, api_keys: bool = False, tls: bool = False,
           secrets_dir: str = CONTAINER_CONF_DIR, ..., disaggregated=False) -> str
    server_block(*, listen, upstream, idle_timeout_seconds, tries, api_keys, tls, secrets_dir,
                 health_upstream, disaggregated) -> str
    api_routes(cluster: ClusterConfig) -> tuple[Route, ...]   what the endpoint serves (P/D: no
                                                               stored responses; served_routes)
    keys_conf(api_keys) -> str         the map entries of KEYS_FILE (a secret)
    secrets_bundle(api_keys, tls_certificate, tls_private_key) -> str   install_script's stdin
    for_cluster(cluster: ClusterConfig, **paths) -> str
    upstream_conf(servers, down=frozenset(), router_at=None) -> str   the `server` lines of UPSTREAM_FILE
    router_server(cluster: ClusterConfig) -> tuple[str, int] | None  vLLM's router, with cache-aware
    control_function() -> str          bash `nginx_ctl test|reload` (exit 3: nginx is not running)
    install_script(conf: str, servers, *, conf_dir: str = CONF_DIR, router_at=None) -> str
        writes nginx.conf and the upstream file on the host, tests, reloads; a server that is
        marked down stays down, and a new one enters down when there was a file before

The file includes only files beside it (the upstream, the keys), so `nginx -t -p <dir> -c
<dir>/nginx.conf` checks it anywhere they are. Relative `runtime_dir`/`log_dir`/`pid_file`
resolve against nginx's prefix (`-p`), which lets a lab run it unprivileged in a namespace;
`user=None` leaves the directive out.

On bare metal the files live on the load-balancer host in CONF_DIR, which the nginx container
mounts read-only at CONTAINER_CONF_DIR: a membership change rewrites UPSTREAM_FILE and reloads
nginx (streams in flight finish on the old workers) instead of making a new container. An
`upload` would: kreuzwerker/terraform-provider-docker v4.5.0 resource_docker_container.go marks
`upload` ForceNew. The directory is mounted, not the files: a file bind mount keeps the inode
it was given, and the atomic rename that replaces the file would never reach the container.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from dataclasses import dataclass

from qwen_cluster import hostpaths
from qwen_cluster.render import router
from qwen_cluster.render.shell import container_state_function, quote, script
from qwen_cluster.render.vllm import HEALTH_PATH

# Pinned: a moving tag would change the load balancer (and every AWS node's proxy) on the next
# `pulumi up`. 1.30 is nginx's stable line (1.31 mainline); 1.27 and 1.28 get no more fixes.
# gixy-ng checks the rendered config against its CVE table for this version
# (tests/test_render_nginx.py).
IMAGE = "nginx:1.30.6"
MAX_FAILS = 3
FAIL_TIMEOUT_SECONDS = 30
CONNECT_TIMEOUT_SECONDS = 5
# On the load-balancer host, and where the container sees it (read-only).
CONF_DIR = f"{hostpaths.CONFIG_DIR}/nginx"
CONTAINER_CONF_DIR = "/etc/nginx/qwen"
CONF_FILE = "nginx.conf"
# Relative: nginx resolves an include against the directory of the -c file, so the same
# nginx.conf finds it in the container and wherever a lab keeps the files.
UPSTREAM_FILE = "upstream.conf"
# `host:port host:port`: vLLM's router on this host, its API and its metrics listener
# (loadBalancer.routing cache-aware; router.address_line), absent without one: the rollout's
# scripts read it when they run (render/rollout.py), so that their text, and whether a replica
# drains, does not depend on the routing.
ROUTER_FILE = "router.addr"
CONTAINER_NAME = "qwen-nginx"
WORKER_CONNECTIONS = 4096
# A proxied request holds two descriptors (client and upstream connection), and worker_connections
# counts both, plus log and temp files: twice worker_connections per worker (gixy-ng's
# worker_rlimit_nofile_vs_connections). The container's nofile ulimit must allow it too
# (components/baremetal/serving.py): without CAP_SYS_RESOURCE nginx cannot raise its hard limit.
WORKER_RLIMIT_NOFILE = 2 * WORKER_CONNECTIONS


def upstream_servers(cluster) -> list[tuple[str, int]]:
    """The replica heads nginx sends to (with a router: its backups). serving.mode disaggregated:
    the decode pool only. A request that reaches a decode replica without the router's
    kv_transfer_params is prefilled and decoded there (vLLM's NIXL connector pulls only for a
    request that asks for it, `do_remote_prefill`): a dead router degrades to aggregated serving
    on the decode pool. The prefill pool stays out: its replicas would take long decodes that hold
    their batch and KV for minutes, and the prompts the router sends them when it is back would
    wait behind those."""
    heads = cluster.topology.heads
    if cluster.disaggregated and cluster.serving.decode is not None:
        decode = set(cluster.serving.decode.nodes)
        heads = tuple(head for head in heads if head.name in decode)
    return [(head.ip, cluster.model_port) for head in heads]


def router_server(cluster) -> tuple[str, int] | None:
    """vLLM's router on this host (loadBalancer.routing cache-aware), else None. With it the
    upstream's one primary server is the router and the replica heads are `backup` servers:
    nginx upstream module, `backup` ("marks the server as a backup server. It will be passed
    requests when the primary servers are unavailable"), which least_conn allows (only hash,
    ip_hash and random refuse it). A router that refuses, fails or answers 502/503 sends the
    request on to a replica (proxy_next_upstream), and after MAX_FAILS it is left alone for
    FAIL_TIMEOUT_SECONDS: a dead router degrades to least_conn over the replicas."""
    if cluster.router_port is None:
        return None
    return (router.listen_address(cluster), cluster.router_port)


@dataclass(frozen=True)
class Route:
    """A route clients may reach through the load balancer: its method and path (`{id}`: one
    path segment of letters, digits, `_` and `-`)."""

    method: str
    path: str

    @property
    def location(self) -> str:
        if "{id}" not in self.path:
            return f"= {self.path}"
        return "~ ^" + self.path.replace("{id}", "[A-Za-z0-9_-]+") + "$"

    @property
    def upstream_uri(self) -> str:
        """The path sent on. A fixed route sends its own path, never the client's spelling of
        it (nginx matched the normalised one). A route with `{id}` sends the request as the
        client wrote it (proxy_pass without a URI): nginx's normalised path matched the route,
        and a spelling that normalises to it but differs (`%2F..%2F`) reaches vLLM's router
        undecoded-dot-segments and matches no route there (a path parameter holds no `/`)."""
        return "" if "{id}" in self.path else self.path


# What a client reaches through the load balancer: the OpenAI routes vLLM serves for a generative
# model, listed one by one, and HEALTH_PATH. Everything else vLLM serves (/metrics, /tokenize,
# /detokenize, /invocations, /pooling, /score, /rerank, /ping, /load, /version, /server_info,
# /reset_prefix_cache, /sleep, /wake_up, /collective_rpc, /pause, /resume, /start_profile, ...) and
# /v1 routes that are not inference (/v1/load_lora_adapter, /v1/unload_lora_adapter,
# /v1/chat/completions/render, /v1/messages) is refused by nginx with 404 before any model server.
# From vLLM's own routers (vllm-project/vllm): vllm/entrypoints/openai/api_server.py of the
# v0.11 line holds them all in one file (`@router.get("/v1/models")`, `@router.post(
# "/v1/chat/completions")`, `@router.post("/v1/completions")`, `@router.post("/v1/responses")`,
# `@router.get("/v1/responses/{response_id}")`, `@router.post("/v1/responses/{response_id}/cancel")`);
# later releases split them into vllm/entrypoints/openai/{models,chat_completion,completion,
# responses}/api_router.py with the same paths, registered for the "generate" task by
# vllm/entrypoints/generate/api_router.py (0.33.0). A method other than the route's is 403.
API_ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/models"),
    Route("POST", "/v1/chat/completions"),
    Route("POST", "/v1/completions"),
    Route("POST", "/v1/responses"),
    Route("GET", "/v1/responses/{id}"),
    Route("POST", "/v1/responses/{id}/cancel"),
)
# What vLLM's router in P/D mode does not serve of API_ROUTES: a stored response lives on the one
# server that answered, and a disaggregated request has two. The router 0.1.17 answers them 501
# ("Responses retrieve endpoint not implemented for PD router", "Responses cancel endpoint not
# implemented for PD router", measured through its P/D mode on the lab); POST /v1/responses
# itself is served disaggregated (the KV crossed over NIXL, measured likewise). A disaggregated
# endpoint answers them itself, 501 with an error body that says why (server_block).
STORED_RESPONSE_ROUTES: tuple[Route, ...] = API_ROUTES[-2:]
NOT_SERVED_DISAGGREGATED_ERROR = (
    '{"error": {"message": "stored responses are not served by a disaggregated deployment (serving.mode '
    'disaggregated: the vLLM router in P/D mode does not retrieve or cancel them)", '
    '"type": "not_implemented", "code": 501}}'
)


# serving.mode disaggregated: vLLM's router in P/D mode answers 500 when the prefill or decode
# server it chose fails before answering ("Transparent proxy request failed", vllm_pd_router.rs;
# it does not try another worker), and keeps choosing a dead one until its own health checks call
# it unhealthy (--health-failure-threshold x --health-check-interval-secs: 15 s here). Measured on
# the lab: the prefill node's vLLM killed under load, 4 of 6 requests HTTP 500 within 3 s. nginx
# retries that 500 on its next server, the decode pool served whole (backup): the request
# succeeds without the KV split. A KV load that failed under loadFailurePolicy `fail` is a 500
# too and is retried the same way (QwenKvTransferFailed and QwenKvRecomputed say it happened).
P_D_RETRY = """
        # Disaggregated: the router's 500 (a prefill or decode server failed under it) is
        # retried on the next server, the decode pool (nginx.P_D_RETRY)."""


def served_routes(disaggregated: bool) -> tuple[Route, ...]:
    """What an endpoint serves of API_ROUTES: all of them, but the stored-response routes when
    serving.mode is disaggregated (STORED_RESPONSE_ROUTES)."""
    if not disaggregated:
        return API_ROUTES
    return tuple(route for route in API_ROUTES if route not in STORED_RESPONSE_ROUTES)


def api_routes(cluster) -> tuple[Route, ...]:
    """What the endpoint of `cluster` serves (served_routes)."""
    return served_routes(cluster.disaggregated)


# The client keys, as nginx map entries (keys_conf), beside nginx.conf; TLS files likewise.
KEYS_FILE = "keys.conf"
TLS_CERTIFICATE_FILE = "tls-certificate.pem"
TLS_PRIVATE_KEY_FILE = "tls-private-key.pem"
SECRET_FILES = (KEYS_FILE, TLS_CERTIFICATE_FILE, TLS_PRIVATE_KEY_FILE)
# Mozilla's intermediate configuration (ssl-config.mozilla.org, "Intermediate", guideline 5.7):
# TLS 1.2 and 1.3; for 1.2 only AEAD suites with forward secrecy. The DHE suites of the profile
# are left out: they need an ssl_dhparam file and no current client needs them.
TLS_PROTOCOLS = "TLSv1.2 TLSv1.3"
TLS_CIPHERS = ":".join(
    (
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305",
        "ECDHE-RSA-CHACHA20-POLY1305",
    )
)
# The JSON bodies of nginx's own refusals, shaped like vLLM's errors.
AUTH_ERROR = (
    '{"error": {"message": "a valid API key is required", "type": "authentication_error", "code": 401}}'
)
NOT_FOUND_ERROR = '{"error": {"message": "not found", "type": "not_found", "code": 404}}'
# Mozilla's intermediate profile: HSTS for two years once a client has seen HTTPS here.
HSTS = """
        add_header Strict-Transport-Security "max-age=63072000" always;"""
WWW_AUTHENTICATE = """
        add_header WWW-Authenticate $qwen_www_authenticate always;"""
# The map variable that is 1 when the request carries a configured key.
KEY_VARIABLE = "$qwen_client_key"


def keys_conf(api_keys: Iterable[str]) -> str:
    """The `map` entries of KEYS_FILE: the whole Authorization header, compared case-sensitively
    (a `~` regex; plain map strings are compared ignoring case). Keys hold only characters of
    config.secrets.API_KEY_PATTERN, of which `.` and `+` need escaping. The text is a secret:
    it is rendered only inside an Output.apply of the keys, and never logged."""
    lines = ["# Managed by qwen-cluster: the client API keys (a secret; mode 0600)."]
    for key in api_keys:
        escaped = re.sub(r"([.+])", r"\\\1", key)
        lines.append(f'"~^Bearer {escaped}$" 1;')
    return "\n".join(lines) + "\n"


def _auth_map() -> str:
    return f"""
    # Client keys (access.apiKeys): {KEY_VARIABLE} is 1 for `Authorization: Bearer <a key>`. The
    # keys are a file of their own, rewritten and reloaded when they change (no model server
    # restarts).
    map $http_authorization {KEY_VARIABLE} {{
        default 0;
        include {KEYS_FILE};
    }}
    # RFC 6750: a 401 names the scheme it wants (an empty value sends no header).
    map {KEY_VARIABLE} $qwen_www_authenticate {{
        0 "Bearer";
        default "";
    }}
"""


def _tls_directives(secrets_dir: str) -> str:
    return f"""
        ssl_certificate {secrets_dir}/{TLS_CERTIFICATE_FILE};
        ssl_certificate_key {secrets_dir}/{TLS_PRIVATE_KEY_FILE};
        ssl_protocols {TLS_PROTOCOLS};
        ssl_ciphers {TLS_CIPHERS};
        ssl_prefer_server_ciphers off;
        ssl_session_timeout 1d;
        ssl_session_cache shared:QwenTLS:10m;
        ssl_session_tickets off;
        # Streamed tokens are small: TLS records of at most 4 KB go out as they fill, not at
        # 16 KB (nginx docs, ssl_buffer_size: smaller values minimise time to first byte).
        ssl_buffer_size 4k;
"""


def _api_location(route: Route, *, upstream: str | None, auth: bool) -> str:
    """`route`'s location: proxied to `upstream`, or with None answered 501 here (not served by
    this deployment: NOT_SERVED_DISAGGREGATED_ERROR), after the method and key checks alike."""
    check = (
        f"""
            if ({KEY_VARIABLE} = 0) {{
                return 401 '{AUTH_ERROR}';
            }}"""
        if auth
        else ""
    )
    uri = route.upstream_uri + "$is_args$args" if route.upstream_uri else ""
    answer = f"return 501 '{NOT_SERVED_DISAGGREGATED_ERROR}';" if upstream is None else f"proxy_pass http://{upstream}{uri};"
    return f"""
        location {route.location} {{
            limit_except {route.method} {{
                deny all;
            }}{check}
            {answer}
        }}
"""


def server_block(
    *,
    listen: str,
    upstream: str,
    idle_timeout_seconds: int,
    tries: int,
    api_keys: bool,
    tls: bool,
    secrets_dir: str = CONTAINER_CONF_DIR,
    health_upstream: str | None = None,
    disaggregated: bool = False,
) -> str:
    """The client-facing `server`, shared by the bare-metal load balancer and each AWS node's
    proxy: TLS (optional), the API key check, the route allowlist, streaming-safe proxying.
    The proxy settings are the server's, inherited by every location. `health_upstream`: where
    HEALTH_PATH goes, when not `upstream` (an AWS proxy behind the router: its own vLLM).
    `disaggregated`: serving.mode disaggregated: what is not served there (served_routes) is
    answered 501, and the router's 500 is retried on the next server (P/D_RETRY)."""
    timeout = f"{idle_timeout_seconds}s"
    routes = served_routes(disaggregated)
    retried = "error timeout http_502 http_503" + (" http_500" if disaggregated else "")
    locations = "".join(
        _api_location(route, upstream=upstream if route in routes else None, auth=api_keys)
        for route in API_ROUTES
    )
    return f"""
    server {{
        listen {listen}{" ssl" if tls else ""};
{_tls_directives(secrets_dir) if tls else ""}
        # HTTP/1.1: vLLM streams with chunked transfer encoding.
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Real-IP $remote_addr;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto $scheme;
        # The client's key stops here: no model server sees (or logs) it.
        proxy_set_header Authorization "";{WWW_AUTHENTICATE if api_keys else ""}{HSTS if tls else ""}
        # Streamed tokens go to the client as they come, not when a buffer fills.
        proxy_buffering off;
        # Request bodies stay buffered (the default): nginx can replay a prompt on another
        # replica only if it has not started streaming the body to the one that died
        # (nginx docs, proxy_request_buffering; found by the lab's kill-under-load test).
        proxy_cache off;
        # Qwen3's thinking mode can stay silent for minutes (loadBalancer.idleTimeoutSeconds).
        proxy_connect_timeout {CONNECT_TIMEOUT_SECONDS}s;
        proxy_read_timeout {timeout};
        proxy_send_timeout {timeout};
        # Inference is stateless: a POST that failed before any byte reached the client
        # can be replayed on another replica without side effects, hence non_idempotent.
        # nginx never retries once the response has started streaming.{P_D_RETRY if disaggregated else ""}
        proxy_next_upstream {retried} non_idempotent;
        proxy_next_upstream_tries {tries};

        # The OpenAI routes (API_ROUTES), each behind the key check when keys are configured.{locations}
        # Healthy when at least one replica's vLLM answers its own /health. No key: load
        # balancer health checks send none, and the answer says only up or down.
        location = {HEALTH_PATH} {{
            limit_except GET {{
                deny all;
            }}
            proxy_pass http://{health_upstream or upstream}{HEALTH_PATH};
            proxy_read_timeout 10s;
            proxy_next_upstream error timeout http_502 http_503;
            access_log off;
        }}

        # nginx itself is up (for liveness probes that must not depend on the model).
        location = /nginx-health {{
            access_log off;
            return 200 "ok\\n";
        }}

        # Every other route of vLLM (metrics, tokenizer, admin and control routes) and every
        # other spelling: refused here, never proxied.
        location / {{
            return 404 '{NOT_FOUND_ERROR}';
        }}
    }}
"""


def render(
    servers: list[tuple[str, int]],
    *,
    listen_port: int,
    idle_timeout_seconds: int,
    runtime_dir: str = "/var/cache/nginx",
    log_dir: str = "/var/log/nginx",
    pid_file: str = "/var/run/nginx.pid",
    user: str | None = "nginx",
    upstream_file: str | None = None,
    api_keys: bool = False,
    tls: bool = False,
    secrets_dir: str = CONTAINER_CONF_DIR,
    listen_address: str | None = None,
    router_at: tuple[str, int] | None = None,
    extra: str = "",
    health_upstream: str | None = None,
    disaggregated: bool = False,
) -> str:
    """`api_keys`: check the client keys of KEYS_FILE (beside nginx.conf); `tls`: serve HTTPS with
    the certificate and key in `secrets_dir` (where the container sees CONF_DIR);
    `listen_address`: one address instead of every one (an AWS node's proxy); `router_at`:
    vLLM's router as the primary server, the replicas its backups (router_server); `extra`:
    more of the `http` block after the client-facing server (an AWS proxy's router listener);
    `health_upstream`: an upstream of `extra` that answers HEALTH_PATH instead; `disaggregated`:
    serving.mode disaggregated (server_block)."""
    if not servers:
        raise ValueError("nginx needs at least one upstream server")
    if upstream_file is None:
        lines = upstream_conf(servers, router_at=router_at).splitlines()[1:]
        upstream = "\n".join(f"        {line}" for line in lines)
    else:
        # The servers live in their own file, rewritten on a membership change and by the
        # rollout's drain (rollout.py): this file changes only with the listener or timeouts.
        upstream = f"        include {upstream_file};"
    user_line = f"user {user};\n" if user else ""
    server = server_block(
        listen=f"{listen_address}:{listen_port}" if listen_address else str(listen_port),
        upstream="qwen_model",
        idle_timeout_seconds=idle_timeout_seconds,
        # With the router: it, then up to three replicas directly.
        tries=min(len(servers), 3) + (1 if router_at else 0),
        api_keys=api_keys,
        tls=tls,
        secrets_dir=secrets_dir,
        health_upstream=health_upstream,
        disaggregated=disaggregated,
    )
    return f"""# Managed by qwen-cluster: load balancer over the replica heads' model port.
{user_line}worker_processes auto;
worker_rlimit_nofile {WORKER_RLIMIT_NOFILE};
pid {pid_file};
error_log {log_dir}/error.log warn;

events {{
    worker_connections {WORKER_CONNECTIONS};
}}

http {{
    default_type application/json;
    access_log {log_dir}/access.log;
    client_body_temp_path {runtime_dir}/client_body;
    proxy_temp_path {runtime_dir}/proxy;
    fastcgi_temp_path {runtime_dir}/fastcgi;
    uwsgi_temp_path {runtime_dir}/uwsgi;
    scgi_temp_path {runtime_dir}/scgi;
    server_tokens off;
    # Prompts with long contexts are large request bodies.
    client_max_body_size 64m;
{_auth_map() if api_keys else ""}
    upstream qwen_model {{
        # A generation holds its connection for its whole length: balance on open requests.
        least_conn;
{upstream}
        # No upstream `keepalive`: a request sent on a kept-alive connection to a node whose
        # link died waits for proxy_read_timeout (an hour) instead of failing over after
        # proxy_connect_timeout; nginx cannot tell a dead link from a thinking pause
        # (found by the lab's link-cut test). A handshake per generation costs nothing.
    }}
{server}{extra}}}
"""


def _server_line(ip: str, port: int, down: bool = False, backup: bool = False) -> str:
    flag = (" backup" if backup else "") + (" down" if down else "")
    return f"server {ip}:{port} max_fails={MAX_FAILS} fail_timeout={FAIL_TIMEOUT_SECONDS}s{flag};"


def upstream_conf(
    servers: Iterable[tuple[str, int]],
    down: frozenset[str] = frozenset(),
    router_at: tuple[str, int] | None = None,
) -> str:
    """The upstream's `server` lines; `down` holds "ip:port" of servers out of rotation. With
    `router_at` the router's line comes first and the replicas are its backups."""
    lines = [_server_line(*router_at)] if router_at else []
    lines += [_server_line(ip, port, f"{ip}:{port}" in down, backup=bool(router_at)) for ip, port in servers]
    return (
        "# Managed by qwen-cluster: the replica heads (a drained one is marked down).\n"
        + "\n".join(lines)
        + "\n"
    )


def control_function() -> str:
    """`nginx_ctl test|reload`, through the nginx container (nginx is its PID 1, so HUP reloads
    it). Exit 3: the container is absent or stopped (nginx reads the files when it starts); any
    other failure, docker's included (permission denied, no daemon), is an error."""
    conf = f"{CONTAINER_CONF_DIR}/{CONF_FILE}"
    return f"""{container_state_function().rstrip()}

nginx_ctl() {{
  local state
  state=$(container_state {CONTAINER_NAME}) || return 1
  if [ "$state" != running ]; then
    return 3
  fi
  case "$1" in
    test) docker exec {CONTAINER_NAME} nginx -t -q -c {conf} ;;
    reload) docker kill --signal=HUP {CONTAINER_NAME} >/dev/null ;;
    *) echo "nginx_ctl: test or reload, not $1" >&2; return 2 ;;
  esac
}}
"""


def server_flag_function() -> str:
    """`server_flag ADDRESS FILE down|any`: is `server ADDRESS` in the upstream file (and down)?"""
    return """
server_flag() {
  [ -e "$2" ] || return 1
  awk -v server="$1" -v want="$3" '
    $1 == "server" && $2 == server { found = 1; if ($NF == "down;") down = 1 }
    END { exit !(found && (want == "any" || down)) }
  ' "$2"
}
"""


def secrets_bundle(
    api_keys: Iterable[str] | None, tls_certificate: str | None, tls_private_key: str | None
) -> str:
    """What the install script reads on its standard input: one line `<file> <base64>` per
    secret file (KEYS_FILE, the TLS pair). Called inside an Output.apply of the secrets: the
    text is a secret, handed to the command as its `stdin` (a secret input), never its script,
    and so never in a process list, a log or the plan."""
    files = []
    if api_keys:
        files.append((KEYS_FILE, keys_conf(api_keys)))
    if tls_certificate and tls_private_key:
        files += [(TLS_CERTIFICATE_FILE, tls_certificate), (TLS_PRIVATE_KEY_FILE, tls_private_key)]
    return "".join(f"{name} {base64.b64encode(text.encode()).decode()}\n" for name, text in files)


def install_script(
    conf: str,
    servers: list[tuple[str, int]],
    *,
    conf_dir: str = CONF_DIR,
    router_at: tuple[str, int] | None = None,
) -> str:
    """Write the load balancer's files on its host, test them with the running nginx and reload
    it (a config nginx refuses is rolled back and fails the step). Before nginx runs (day 0)
    the files are written only; the container reads them when it starts.

    The secret files (keys, TLS) come on standard input (secrets_bundle), mode 0600: a key added
    or removed re-runs this script alone, and nginx reloads; no model server restarts. A secret
    file the bundle does not name is removed.

    With `router_at` (router_server) its line comes first, always in rotation, and the replicas'
    lines carry `backup`; the rollout's `down` marks work on them alike."""
    wanted = "\n".join(f"{ip}:{port}" for ip, port in servers)
    # Without a router the script is the one of least_conn alone, to the byte: a program that
    # learned routing changes nothing on a host that does not use it.
    kept = " ".join((CONF_FILE, UPSTREAM_FILE, *((ROUTER_FILE,) if router_at else ()), *SECRET_FILES))
    router_line = f"\n  echo {quote(_server_line(*router_at))}" if router_at else ""
    backup = " backup" if router_at else ""
    mark_down = 'flag="$flag down"' if router_at else 'flag=" down"'
    router_file = (
        f"printf '%s\\n' {quote(router.address_line(router_at))} >\"$conf_dir/{ROUTER_FILE}.new\"\n"
        if router_at
        else ""
    )
    router_rename = (
        f"""# The router's addresses, for the rollout's scripts.
mv -f "$conf_dir/{ROUTER_FILE}.new" "$conf_dir/{ROUTER_FILE}"
"""
        if router_at
        else ""
    )
    body = f"""
conf_dir={quote(conf_dir)}
upstream="$conf_dir/{UPSTREAM_FILE}"
{control_function().strip()}
{server_flag_function().strip()}

mkdir -p "$conf_dir"
had_upstream=no
[ -e "$upstream" ] && had_upstream=yes
backup=$(mktemp -d)
trap 'rm -rf "$backup"' EXIT
for file in {kept}; do
  [ -e "$conf_dir/$file" ] && cp -p "$conf_dir/$file" "$backup/$file"
done

# The secrets, from standard input (never echoed): written beside nginx.conf, root's, 0600.
umask 077
given=" "
while read -r name value; do
  case "$name" in
    {"|".join(SECRET_FILES)}) ;;
    *) echo "nginx: unknown secret file on stdin" >&2; exit 1 ;;
  esac
  printf '%s' "$value" | base64 -d >"$conf_dir/$name.new"
  given="$given$name "
done
umask 022

# The upstream: a server drained by an unfinished rollout stays down (its rollout step puts it
# back once healthy); a server that is new while nginx already serves enters down, and its
# rollout step puts it in once its /health answers. The first time, every server is in.
is_down() {{ server_flag "$1" "$backup/{UPSTREAM_FILE}" down; }}
is_known() {{ server_flag "$1" "$backup/{UPSTREAM_FILE}" any; }}
{{
  echo "# Managed by qwen-cluster: the replica heads (a drained one is marked down)."{router_line}
  while IFS= read -r server; do
    [ -n "$server" ] || continue
    flag="{backup}"
    if is_down "$server" || {{ [ "$had_upstream" = yes ] && ! is_known "$server"; }}; then
      {mark_down}
    fi
    echo "server $server max_fails={MAX_FAILS} fail_timeout={FAIL_TIMEOUT_SECONDS}s$flag;"
  done <<'QWEN_SERVERS_EOF'
{wanted}
QWEN_SERVERS_EOF
}} >"$upstream.new"
cat >"$conf_dir/{CONF_FILE}.new" <<'QWEN_NGINX_CONF_EOF'
{conf.rstrip(chr(10))}
QWEN_NGINX_CONF_EOF
{router_file}# Renames, so nginx never reads a half-written file.
mv -f "$upstream.new" "$upstream"
for file in {" ".join(SECRET_FILES)}; do
  case "$given" in
    *" $file "*) mv -f "$conf_dir/$file.new" "$conf_dir/$file" ;;
    *) rm -f "$conf_dir/$file" ;;
  esac
done
mv -f "$conf_dir/{CONF_FILE}.new" "$conf_dir/{CONF_FILE}"
{router_rename}cat "$upstream"
echo "nginx: secret files: ${{given# }}"

status=0
nginx_ctl test || status=$?
if [ "$status" = 3 ]; then
  echo "nginx: not running yet; it reads these files when it starts"
  exit 0
elif [ "$status" != 0 ]; then
  echo "nginx: the new configuration was not taken (its test failed, or docker did not" \\
    "answer: see above); the previous files are back" >&2
  for file in {kept}; do
    if [ -e "$backup/$file" ]; then cp -p "$backup/$file" "$conf_dir/$file"; else rm -f "$conf_dir/$file"; fi
  done
  exit 1
fi
nginx_ctl reload
echo "nginx: reloaded (streams in flight finish on the old workers)"
"""
    return script("the load balancer's nginx.conf and upstream on its host, tested and reloaded", body)


def remove_script(*, conf_dir: str = CONF_DIR) -> str:
    return script("remove the load balancer's files", f"rm -rf {quote(conf_dir)}")


# Each AWS node's proxy (render/proxy.py): its container and directory, and the file in it that
# turns the router's health checks of the node to 503 (proxy.DRAIN_FILE). Here, not in proxy.py,
# because the model server's run (render/ssm.py, which proxy.py imports) writes that file.
PROXY_CONTAINER_NAME = "qwen-proxy"
PROXY_CONF_DIR = f"{hostpaths.CONFIG_DIR}/proxy"
PROXY_DRAIN_FILE = "drain.conf"

# A replica's drain marker (serving.mode disaggregated): a file named by the replica's address in
# this directory of the nginx files (CONF_DIR on the host, CONTAINER_CONF_DIR in the container),
# written by the rollout's drain and removed by its ready step (render/rollout.py); while it
# exists the replica's worker_listener answers the router's health checks 503.
DRAIN_DIR = "drain"


def drain_marker(conf_dir: str, ip: str) -> str:
    return f"{conf_dir}/{DRAIN_DIR}/{ip}"


def worker_listener(
    *, listen: str, upstream: str, server: tuple[str, int], marker: str, idle_timeout_seconds: int
) -> str:
    """Where vLLM's router reaches one replica in P/D mode (render/router.py, "P/D mode's
    run-time membership"): every path to the replica, HEALTH_PATH answered 503 while `marker`
    (the path nginx sees) exists, so the router's own health checker takes the replica out of its
    choice before it stops, and back once the marker is gone. No key, no TLS (the router holds no
    key; the listener is on loopback or members-only), streaming-safe as the client server, no
    upstream keepalive: one connection per request, which the drain counts."""
    timeout = f"{idle_timeout_seconds}s"
    return f"""
    upstream {upstream} {{
        server {server[0]}:{int(server[1])};
    }}

    server {{
        listen {listen};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_buffering off;
        proxy_cache off;
        proxy_connect_timeout {CONNECT_TIMEOUT_SECONDS}s;
        proxy_read_timeout {timeout};
        proxy_send_timeout {timeout};
        location = {HEALTH_PATH} {{
            if (-f {marker}) {{
                return 503;
            }}
            proxy_pass http://{upstream};
            proxy_read_timeout 10s;
            access_log off;
        }}
        location / {{
            proxy_pass http://{upstream};
        }}
    }}
"""


def pd_worker_listeners(cluster) -> str:
    """Bare metal, serving.mode disaggregated: one worker_listener per replica at its loopback
    alias (router.pd_listener), for the router on this host."""
    blocks = []
    for head in cluster.topology.heads:
        blocks.append(
            worker_listener(
                listen="{}:{}".format(*router.pd_listener(cluster, head.name)),
                upstream=f"qwen_replica_{cluster.topology.replica_of(head.name).index}",
                server=(str(head.ip), cluster.model_port),
                marker=drain_marker(CONTAINER_CONF_DIR, str(head.ip)),
                idle_timeout_seconds=cluster.load_balancer.idle_timeout_seconds,
            )
        )
    return "\n    # vLLM's router reaches each replica here (P/D mode: render/router.py).".join(["", *blocks])


def for_cluster(cluster, **paths) -> str:
    return render(
        upstream_servers(cluster),
        listen_port=cluster.load_balancer.port,
        idle_timeout_seconds=cluster.load_balancer.idle_timeout_seconds,
        api_keys=bool(cluster.access.api_keys),
        tls=cluster.load_balancer.tls is not None,
        router_at=router_server(cluster),
        extra=pd_worker_listeners(cluster) if cluster.disaggregated else "",
        disaggregated=cluster.disaggregated,
        **paths,
    )
