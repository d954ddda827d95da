"""nginx.conf for the bare-metal load balancer, done right for streamed LLM responses.

Signatures:
    upstream_servers(cluster: ClusterConfig) -> list[tuple[str, int]]   replica heads' model port
    render(servers: list[tuple[str, int]], *, listen_port: int, idle_timeout_seconds: int,
           runtime_dir: str = "/var/cache/nginx", log_dir: str = "/var/log/nginx",
           pid_file: str = "/var/run/nginx.pid", user: str | None = "nginx") -> str
    for_cluster(cluster: ClusterConfig, **paths) -> str

The file is self-contained (no includes), so `nginx -t -p <dir> -c <dir>/nginx.conf` checks
it anywhere. Relative `runtime_dir`/`log_dir`/`pid_file` resolve against nginx's prefix (`-p`),
which lets a lab run it unprivileged in a namespace; `user=None` leaves the directive out.
"""

from __future__ import annotations

MAX_FAILS = 3
FAIL_TIMEOUT_SECONDS = 30
CONNECT_TIMEOUT_SECONDS = 5
WORKER_CONNECTIONS = 4096
# A proxied request holds two descriptors (client and upstream connection), and worker_connections
# counts both, plus log and temp files: twice worker_connections per worker (gixy-ng's
# worker_rlimit_nofile_vs_connections). The container's nofile ulimit must allow it too
# (components/baremetal/serving.py): without CAP_SYS_RESOURCE nginx cannot raise its hard limit.
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
) -> str:
    if not servers:
        raise ValueError("nginx needs at least one upstream server")
    upstream = "\n".join(
        f"        server {ip}:{port} max_fails={MAX_FAILS} fail_timeout={FAIL_TIMEOUT_SECONDS}s;"
        for ip, port in servers
    )
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
        location = /health {{
            proxy_pass http://qwen_model/health;
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


def for_cluster(cluster, **paths) -> str:
    return render(
        upstream_servers(cluster),
        listen_port=cluster.load_balancer.port,
        idle_timeout_seconds=cluster.load_balancer.idle_timeout_seconds,
        **paths,
    )
