"""The rolling model upgrade on bare metal, as scripts the load-balancer host runs: take a
replica out of nginx and let its streams finish (drain), and once its new container answers
`/health`, put it back (ready). Pure: the chain itself is components/baremetal/rollout.py.

Signatures:
    fingerprint(specs: Iterable[Mapping]) -> str
        the digest of a replica's containers, in the scripts so that they change with them
    drain_script(server: tuple[str, int], *, replica: str, drain_timeout_seconds: int,
                 fingerprint: str, conf_dir: str = nginx.CONF_DIR, poll_seconds: int = 1) -> str
    ready_script(server, *, replica: str, health_timeout_seconds: int, fingerprint: str,
                 only_if_down: bool, conf_dir=..., poll_seconds: int = 2) -> str
    retire_script(server, *, replica: str, drain_timeout_seconds: int, conf_dir=...,
                  poll_seconds: int = 1) -> str
    Each also takes `routed: bool` (the router's admin routes) and `pd_worker_url: str | None`
    (serving.mode disaggregated: the router's health checks, below).

vLLM's router (loadBalancer.routing cache-aware, `routed`) follows the rollout: the drain first
takes the replica out of the router's worker set (POST /remove_worker) and the ready step puts it
back (POST /add_worker) after its health gate, through router.admin_function, at the address
nginx's install script leaves in nginx.ROUTER_FILE, read when the step runs. Without `routed`
the scripts are those of least_conn alone, to the byte (a drain runs when its text changes).
Without the file the calls do nothing; a router that is not running is passed over: nginx sends
to the replicas directly meanwhile, and a router that starts takes its workers from its command
line. The wait for streams in flight counts, with a router, its own count for the replica
(router.running_function) instead of its connections, which its client keeps open idle long
after the last request (measured with the 0.1.17 wheel: 90 s after /remove_worker).

With serving.mode disaggregated (`pd_worker_url`: the replica as the router names it) the router's
admin routes are not used: 0.1.17's P/D router cannot add a worker back. The drain writes the
replica's drain marker, which makes its worker listener answer the router's health checks 503,
and waits until the router calls it unhealthy (router.PD_HEALTH_WAIT_SECONDS at most); the
ready step removes it and waits until the router calls it healthy again, so the next replica
of the lane leaves only once this one is back (render/router.py, "P/D mode's run-time
membership"). Streams in flight are nginx's connections to the server alone: the router
reaches the replica through nginx (nginx.worker_listener), one connection per request.

A server is out of rotation when its line in nginx's upstream file ends in `down` (nginx
upstream module: `down` marks the server as permanently unavailable); a reload makes nginx
start new workers with the file as it is, and the old workers finish the requests they hold.
A stream in flight is an established TCP connection from this host to the server: upstream
`keepalive` is off (nginx.py), so nginx holds one connection per request. nginx is reached
through `nginx_ctl` (nginx.control_function).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from qwen_cluster.render import nginx, router
from qwen_cluster.render.shell import quote, script, sha256
from qwen_cluster.render.vllm import HEALTH_PATH

HEALTH_CONNECT_SECONDS = 5
# The rollout steps' resource names, `<head><suffix>` (components/baremetal/rollout.py registers
# them; the change plan and the lab recognise the steps by these).
DRAIN_SUFFIX = "-drain"
READY_SUFFIX = "-ready"
# How long a lane waits for another lane's mark (a file rewrite, `nginx -t` and a reload).
LOCK_WAIT_SECONDS = 120
# The shell variable holding rollout.healthTimeoutSeconds in the gate (the lab puts it on its
# clock: labkit/engine/substitutions.py).
HEALTH_TIMEOUT_VARIABLE = "health_timeout"


def fingerprint(specs: Iterable[Mapping]) -> str:
    return sha256(json.dumps(list(specs), sort_keys=True, default=str))


def _router_calls() -> str:
    """`router_leave` and `router_join`: the replica ($worker_url) out of and back into the
    router's workers."""
    return (
        f"""{router.admin_function('"$router_file"').rstrip()}
{router.running_function('"$router_file"').rstrip()}
"""
        + router.membership_function()
    )


def _pd_calls(conf_dir: str, ip: str) -> str:
    """`pd_leave` and `pd_join`: the replica ($worker_url) out of and back into the router's
    choice, through its drain marker and the router's own health checks (P/D mode)."""
    return f"""{router.worker_state_function('"$router_file"').strip()}
{router.wait_state_function().strip()}
marker={quote(nginx.drain_marker(conf_dir, ip))}
# Out of the router's choice before anything stops; a router that keeps sending to it leaves it
# as it was, and the step fails with the replica still serving.
# nginx's workers test the marker (user nginx): readable whatever the step's umask.
pd_leave() {{
  mkdir -p "${{marker%/*}}"
  chmod 0755 "${{marker%/*}}"
  install -m 0644 /dev/null "$marker"
  router_wait_state unhealthy || {{ rm -f "$marker"; return 1; }}
}}
pd_join() {{
  rm -f "$marker"
  router_wait_state healthy
}}
"""


def _helpers(server: tuple[str, int], conf_dir: str, routed: bool, pd_worker_url: str | None = None) -> str:
    ip, port = server
    routing = (
        f"""router_file={quote(conf_dir)}/{nginx.ROUTER_FILE}
worker_url={quote(pd_worker_url)}
{_pd_calls(conf_dir, ip).rstrip()}

"""
        if pd_worker_url
        else f"""router_file={quote(conf_dir)}/{nginx.ROUTER_FILE}
worker_url={quote(router.worker_url(ip, port))}
{_router_calls().rstrip()}

"""
        if routed
        else ""
    )
    return f"""{routing}server_ip={quote(ip)}
server_port={int(port)}
address="$server_ip:$server_port"
upstream={quote(conf_dir)}/{nginx.UPSTREAM_FILE}
{nginx.control_function().strip()}
{nginx.server_flag_function().strip()}

# Mark the server down (or up) in the upstream file; a rename, so nginx never reads half of it.
set_flag() {{
  awk -v server="$address" -v state="$1" '
    $1 == "server" && $2 == server {{
      sub(/ down;$/, ";")
      if (state == "down") sub(/;$/, " down;")
    }}
    {{ print }}
  ' "$upstream" >"$upstream.$$"
  mv -f "$upstream.$$" "$upstream"
}}

# Mark the server down or up and have nginx take it, or leave the upstream file as it was: a
# server is never marked down while nginx still sends it traffic (docker unreachable, a failed
# test or reload), so the container that follows is not replaced under live requests. The
# lanes of a rollout run at once on this host: one at a time in the file (flock), or two
# read-modify-writes would lose one server's mark.
mark() {{
  (
    flock -w {LOCK_WAIT_SECONDS} 9 || {{ echo "another rollout step holds $upstream.lock" >&2; exit 1; }}
    mark_locked "$1"
  ) 9>>"$upstream.lock"
}}

mark_locked() {{
  local status=0
  cp -p "$upstream" "$upstream.before.$$"
  set_flag "$1"
  nginx_ctl test || status=$?
  if [ "$status" = 0 ] && nginx_ctl reload; then
    rm -f "$upstream.before.$$"
    return 0
  fi
  if [ "$status" = 3 ]; then
    rm -f "$upstream.before.$$"
    echo "nginx: not running; it reads the upstream file when it starts"
    return 0
  fi
  mv -f "$upstream.before.$$" "$upstream"
  echo "nginx did not take $address $1 (see above); the upstream file is as it was" >&2
  return 1
}}

{_ROUTED_IN_FLIGHT if routed and not pd_worker_url else _IN_FLIGHT}"""


_JOIN = "router_join\n"
_IN_FLIGHT = """# Requests nginx has in flight to the server: its established connections from this host.
in_flight() {
  ss -Htn state established dst "$server_ip" dport = ":$server_port" | wc -l
}
"""
_ROUTED_IN_FLIGHT = """# Requests in flight to the server: nginx's established connections from this host, and
# the router's own count for the worker instead of its connections (router_running: its client keeps
# idle ones open well after the last request); the connections of every process but the router
# count (ss -p names the owner: `vllm-router`, the image's binary, or `vllm::router`, the wheel's
# process title). Without -p's names (not root) every connection counts: longer, never shorter.
# Without the router's file (nginx's install script has not named it yet): connections alone.
in_flight() {
  local others
  if [ ! -s "$router_file" ]; then
    ss -Htn state established dst "$server_ip" dport = ":$server_port" | wc -l
    return 0
  fi
  others=$(ss -Htnp state established dst "$server_ip" dport = ":$server_port" |
    grep -Evc 'users:\\(\\("vllm(::|-)router"' || true)
  echo $((others + $(router_running "$worker_url")))
}
"""


def _leave(routed: bool, pd_worker_url: str | None) -> str:
    return "pd_leave" if pd_worker_url else "router_leave" if routed else ""


def _wait_in_flight(replica: str, drain_timeout_seconds: int, poll_seconds: int) -> str:
    return f"""
# Wait for the streams in flight (new requests go elsewhere since the reload). Twice zero in a
# row: a request an old worker had read just before the reload may still connect.
deadline=$((SECONDS + {int(drain_timeout_seconds)}))
zeros=0
while :; do
  sleep {int(poll_seconds)}
  open=$(in_flight)
  if [ "$open" -eq 0 ]; then
    zeros=$((zeros + 1))
    [ "$zeros" -ge 2 ] && break
    continue
  fi
  zeros=0
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "drain: {replica} ($address) still has $open requests in flight after" \\
      "rollout.drainTimeoutSeconds={int(drain_timeout_seconds)}; they will be cut"
    break
  fi
done
echo "drain: {replica} ($address) is out of rotation with ${{open}} requests in flight"
"""


def drain_script(
    server: tuple[str, int],
    *,
    replica: str,
    drain_timeout_seconds: int,
    fingerprint: str,
    conf_dir: str = nginx.CONF_DIR,
    poll_seconds: int = 1,
    routed: bool = False,
    pd_worker_url: str | None = None,
) -> str:
    """Out of the router's workers (`routed`: loadBalancer.routing cache-aware; `pd_worker_url`:
    serving.mode disaggregated, out of its choice) and out of rotation, then wait (at most the
    drain timeout) for its requests in flight."""
    body = f"""
# {replica}: the containers it will run next: {fingerprint}
{_helpers(server, conf_dir, routed, pd_worker_url).strip()}
{_leave(routed, pd_worker_url)}
if server_flag "$address" "$upstream" any; then
  mark down
else
  echo "drain: $address is not in $upstream"
fi
{_wait_in_flight(replica, drain_timeout_seconds, poll_seconds).strip()}
"""
    return script(f"drain {replica} before its container is replaced", body)


def ready_script(
    server: tuple[str, int],
    *,
    replica: str,
    health_timeout_seconds: int,
    fingerprint: str,
    only_if_down: bool,
    conf_dir: str = nginx.CONF_DIR,
    poll_seconds: int = 2,
    routed: bool = False,
    pd_worker_url: str | None = None,
) -> str:
    """Wait until the server's /health answers 200 (at most the health timeout), then put it
    back in rotation. Fails, leaving it out, when it does not: the rollout stops there.
    `only_if_down`: do nothing for a server in rotation (a new cluster's servers start in)."""
    skip = (
        """
if ! server_flag "$address" "$upstream" down; then
  echo "ready: $address is in rotation"
  exit 0
fi
"""
        if only_if_down
        else ""
    )
    body = f"""
# {replica}: the containers it runs: {fingerprint}
{_helpers(server, conf_dir, routed, pd_worker_url).strip()}

# The status code of GET path, or nothing (bash's /dev/tcp: no curl needed on the host).
http_status() {{
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  timeout {HEALTH_CONNECT_SECONDS} bash -c '
    exec 3<>"/dev/tcp/$0/$1" || exit 1
    printf "GET %s HTTP/1.0\\r\\nHost: %s\\r\\nConnection: close\\r\\n\\r\\n" "$2" "$0" >&3
    IFS=" " read -r _ code _ <&3 && printf "%s\\n" "$code"
  ' "$server_ip" "$server_port" "$1" 2>/dev/null </dev/null || true
}}
{skip}
{HEALTH_TIMEOUT_VARIABLE}={int(health_timeout_seconds)}
deadline=$((SECONDS + {HEALTH_TIMEOUT_VARIABLE}))
until [ "$(http_status {HEALTH_PATH})" = 200 ]; do
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "ready: {replica} ($address) did not answer {HEALTH_PATH} with 200 within" \\
      "rollout.healthTimeoutSeconds=${HEALTH_TIMEOUT_VARIABLE}; it stays out of rotation and its" \\
      "lane stops here (the replicas not yet reached still serve the previous version)" >&2
    exit 1
  fi
  sleep {int(poll_seconds)}
done
echo "ready: {replica} ($address) answers {HEALTH_PATH} after ${{SECONDS}}s"
if server_flag "$address" "$upstream" down; then
  mark up
  echo "ready: {replica} ($address) is back in rotation"
fi
{"pd_join" + chr(10) if pd_worker_url else _JOIN if routed else ""}"""
    return script(f"wait for {replica}'s {HEALTH_PATH}, then put it back in rotation", body)


def retire_script(
    server: tuple[str, int],
    *,
    replica: str,
    drain_timeout_seconds: int,
    conf_dir: str = nginx.CONF_DIR,
    poll_seconds: int = 1,
    routed: bool = False,
    pd_worker_url: str | None = None,
) -> str:
    """A replica that leaves the cluster: out of rotation if it still is in (the load
    balancer's new upstream normally dropped it already), then its streams finish before its
    container goes (the engine deletes dependents first: this runs before the container's
    delete)."""
    body = f"""
{_helpers(server, conf_dir, routed, pd_worker_url).strip()}
{_leave(routed, pd_worker_url)}
if server_flag "$address" "$upstream" any && ! server_flag "$address" "$upstream" down; then
  mark down
fi
{_wait_in_flight(replica, drain_timeout_seconds, poll_seconds).strip()}
"""
    return script(f"drain {replica}, which leaves the cluster", body)
