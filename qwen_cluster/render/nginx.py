"""nginx.conf for the bare-metal load balancer, done right for streamed LLM responses.

Signatures:
    upstream_servers(cluster: ClusterConfig) -> list[tuple[str, int]]   replica heads' model port
    render(servers: list[tuple[str, int]], *, listen_port: int, idle_timeout_seconds: int,
           runtime_dir: str = "/var/cache/nginx", log_dir: str = "/var/log/nginx",
           pid_file: str = "/var/run/nginx.pid", user: str | None = "nginx",
           upstream_file: str | None = None) -> str
    for_cluster(cluster: ClusterConfig, **paths) -> str
    upstream_conf(servers, down=frozenset()) -> str       the `server` lines of UPSTREAM_FILE
    control_function() -> str          bash `nginx_ctl test|reload` (exit 3: nginx is not running)
    install_script(conf: str, servers, *, conf_dir: str = CONF_DIR) -> str
        writes nginx.conf and the upstream file on the host, tests, reloads; a server that is
        marked down stays down, and a new one enters down when there was a file before

The file is self-contained (no includes), so `nginx -t -p <dir> -c <dir>/nginx.conf` checks
it anywhere. Relative `runtime_dir`/`log_dir`/`pid_file` resolve against nginx's prefix (`-p`),
which lets a lab run it unprivileged in a namespace; `user=None` leaves the directive out.

On bare metal the files live on the load-balancer host in CONF_DIR, which the nginx container
mounts read-only at CONTAINER_CONF_DIR: a membership change rewrites UPSTREAM_FILE and reloads
nginx (streams in flight finish on the old workers) instead of making a new container. An
`upload` would: kreuzwerker/terraform-provider-docker v4.5.0 resource_docker_container.go marks
`upload` ForceNew. The directory is mounted, not the files: a file bind mount keeps the inode
it was given, and the atomic rename that replaces the file would never reach the container.
"""

from __future__ import annotations

from collections.abc import Iterable

from qwen_cluster.render.shell import container_state_function, quote, script
from qwen_cluster.render.vllm import HEALTH_PATH

MAX_FAILS = 3
FAIL_TIMEOUT_SECONDS = 30
CONNECT_TIMEOUT_SECONDS = 5
# On the load-balancer host, and where the container sees it (read-only).
CONF_DIR = "/etc/qwen-cluster/nginx"
CONTAINER_CONF_DIR = "/etc/nginx/qwen"
CONF_FILE = "nginx.conf"
# Relative: nginx resolves an include against the directory of the -c file, so the same
# nginx.conf finds it in the container and wherever a lab keeps the files.
UPSTREAM_FILE = "upstream.conf"
CONTAINER_NAME = "qwen-nginx"
WORKER_CONNECTIONS = 4096
# A proxied request holds two descriptors (client and upstream connection), and worker_connections
# counts both, plus log and temp files: twice worker_connections per worker (gixy-ng's
# worker_rlimit_nofile_vs_connections). The container's nofile ulimit must allow it too
# (qwen_cluster/baremetal/serving.py): without CAP_SYS_RESOURCE nginx cannot raise its hard limit.
WORKER_RLIMIT_NOFILE = 2 * WORKER_CONNECTIONS


def upstream_servers(cluster) -> list[tuple[str, int]]:
    return [(head.ip, cluster.model_port) for head in cluster.topology.heads]


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
) -> str:
    if not servers:
        raise ValueError("nginx needs at least one upstream server")
    if upstream_file is None:
        upstream = "\n".join(f"        {line}" for line in upstream_conf(servers).splitlines()[1:])
    else:
        # The servers live in their own file, rewritten on a membership change and by the
        # rollout's drain (rollout.py): this file changes only with the listener or timeouts.
        upstream = f"        include {upstream_file};"
    user_line = f"user {user};\n" if user else ""
    timeout = f"{idle_timeout_seconds}s"
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

    upstream qwen_model {{
        # A generation holds its connection for its whole length: balance on open requests.
        least_conn;
{upstream}
        # No upstream `keepalive`: a request sent on a kept-alive connection to a node whose
        # link died waits for proxy_read_timeout (an hour) instead of failing over after
        # proxy_connect_timeout; nginx cannot tell a dead link from a thinking pause
        # (found by the lab's link-cut test). A handshake per generation costs nothing.
    }}

    server {{
        listen {listen_port};

        location / {{
            proxy_pass http://qwen_model;
            # HTTP/1.1: vLLM streams with chunked transfer encoding.
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
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
            # nginx never retries once the response has started streaming.
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries {min(len(servers), 3)};
        }}

        # Healthy when at least one replica's vLLM answers its own /health.
        location = {HEALTH_PATH} {{
            proxy_pass http://qwen_model{HEALTH_PATH};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_connect_timeout {CONNECT_TIMEOUT_SECONDS}s;
            proxy_read_timeout 10s;
            proxy_next_upstream error timeout http_502 http_503;
            access_log off;
        }}

        # nginx itself is up (for liveness probes that must not depend on the model).
        location = /nginx-health {{
            access_log off;
            return 200 "ok\\n";
        }}
    }}
}}
"""


def _server_line(ip: str, port: int, down: bool = False) -> str:
    flag = " down" if down else ""
    return f"server {ip}:{port} max_fails={MAX_FAILS} fail_timeout={FAIL_TIMEOUT_SECONDS}s{flag};"


def upstream_conf(servers: Iterable[tuple[str, int]], down: frozenset[str] = frozenset()) -> str:
    """The upstream's `server` lines; `down` holds "ip:port" of servers out of rotation."""
    lines = [_server_line(ip, port, f"{ip}:{port}" in down) for ip, port in servers]
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


def install_script(conf: str, servers: list[tuple[str, int]], *, conf_dir: str = CONF_DIR) -> str:
    """Write the load balancer's files on its host, test them with the running nginx and reload
    it (a config nginx refuses is rolled back and fails the step). Before nginx runs (day 0)
    the files are written only; the container reads them when it starts."""
    wanted = "\n".join(f"{ip}:{port}" for ip, port in servers)
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
for file in {CONF_FILE} {UPSTREAM_FILE}; do
  [ -e "$conf_dir/$file" ] && cp -p "$conf_dir/$file" "$backup/$file"
done

# The upstream: a server drained by an unfinished rollout stays down (its rollout step puts it
# back once healthy); a server that is new while nginx already serves enters down, and its
# rollout step puts it in once its /health answers. The first time, every server is in.
is_down() {{ server_flag "$1" "$backup/{UPSTREAM_FILE}" down; }}
is_known() {{ server_flag "$1" "$backup/{UPSTREAM_FILE}" any; }}
{{
  echo "# Managed by qwen-cluster: the replica heads (a drained one is marked down)."
  while IFS= read -r server; do
    [ -n "$server" ] || continue
    flag=""
    if is_down "$server" || {{ [ "$had_upstream" = yes ] && ! is_known "$server"; }}; then
      flag=" down"
    fi
    echo "server $server max_fails={MAX_FAILS} fail_timeout={FAIL_TIMEOUT_SECONDS}s$flag;"
  done <<'QWEN_SERVERS_EOF'
{wanted}
QWEN_SERVERS_EOF
}} >"$upstream.new"
cat >"$conf_dir/{CONF_FILE}.new" <<'QWEN_NGINX_CONF_EOF'
{conf.rstrip(chr(10))}
QWEN_NGINX_CONF_EOF
# Renames, so nginx never reads a half-written file.
mv -f "$upstream.new" "$upstream"
mv -f "$conf_dir/{CONF_FILE}.new" "$conf_dir/{CONF_FILE}"
cat "$upstream"

status=0
nginx_ctl test || status=$?
if [ "$status" = 3 ]; then
  echo "nginx: not running yet; it reads these files when it starts"
  exit 0
elif [ "$status" != 0 ]; then
  echo "nginx: the new configuration was not taken (its test failed, or docker did not" \\
    "answer: see above); the previous files are back" >&2
  for file in {CONF_FILE} {UPSTREAM_FILE}; do
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


def for_cluster(cluster, **paths) -> str:
    return render(
        upstream_servers(cluster),
        listen_port=cluster.load_balancer.port,
        idle_timeout_seconds=cluster.load_balancer.idle_timeout_seconds,
        **paths,
    )
