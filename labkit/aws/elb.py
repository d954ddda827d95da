"""The NLB in the lab: HAProxy (Debian's) holds the listener and health-checks the targets; this
module is the ELBv2 target group in front of it: RegisterTargets, DeregisterTargets and
DescribeTargetHealth answer as the NLB does, from what HAProxy sees.

moto's ELBv2 would answer every target `healthy` at once and forget a deregistered one at once;
the rollout's gates (qwen_cluster/render/ssm.py) wait on exactly those two transitions, so they
are followed here (ELB User Guide for Network Load Balancers, "Target health status",
"Deregistration delay"):
- registered: `initial` (Elb.RegistrationInProgress) until HAProxy has seen `healthyThreshold`
  checks pass, then `healthy`; after `unhealthyThreshold` failures `unhealthy`
  (Target.FailedHealthChecks). HAProxy sends it connections only once it is up: a server
  leaving maintenance starts UP in HAProxy ("UP 1/3", going down after `fall` failed checks), so
  registration takes it through drain and a forced `health down` first; then it rises as a new
  NLB target does, after `rise` passed checks (measured with HAProxy 2.6: without this a target
  registered before its server listens gets connections for `fall` intervals, an NLB none).
- a node added to the stack: its server is added at run time (`add server`, as the NLB takes a
  new instance without a restart), in maintenance, with the same check.
- deregistered: `draining` (Target.DeregistrationInProgress) for the deregistration delay: no
  new connections, open ones go on (HAProxy `drain`); then gone (`maint`), and asked for by id it
  is `unused` (Target.NotRegistered), which is what `aws elbv2 wait target-deregistered` waits for.
The health check's protocol, path, interval, timeout and thresholds are the target group's, on
the lab's clock.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from labkit.aws.model import TargetGroup

UNUSED, INITIAL, HEALTHY, UNHEALTHY, DRAINING = "unused", "initial", "healthy", "unhealthy", "draining"
REASONS = {
    UNUSED: ("Target.NotRegistered", "Target is not registered to the target group"),
    INITIAL: ("Elb.RegistrationInProgress", "Target registration is in progress"),
    UNHEALTHY: ("Target.FailedHealthChecks", "Health checks failed"),
    DRAINING: ("Target.DeregistrationInProgress", "Target deregistration is in progress"),
}
BACKEND = "targets"


def haproxy_config(
    group: TargetGroup,
    servers: dict[str, str],
    *,
    listen: str,
    port: int,
    client_cidrs: list[str],
    idle_timeout: float,
    clock: float,
    socket_path: str,
    pid_file: str,
) -> str:
    """HAProxy as the NLB: a TCP listener, the load balancer SG's client CIDRs, and one server per
    possible target (by instance id), in maintenance until registered."""
    check = group.health_check
    _, timeout = _check_times(group, clock)
    https = str(check.get("protocol", "TCP")).upper() == "HTTPS"
    http = https or str(check.get("protocol", "TCP")).upper() == "HTTP"
    lines = [
        "global",
        f"  stats socket {socket_path} mode 600 level admin",
        f"  pidfile {pid_file}",
        "  maxconn 4096",
        "defaults",
        "  mode tcp",
        "  timeout connect 5s",
        f"  timeout client {idle_timeout:g}s",
        f"  timeout server {idle_timeout:g}s",
        f"  timeout check {timeout}ms",
        "frontend listener",
        f"  bind {listen}:{port}",
        # The NLB's security group: clientCidrs only (components/aws/security.py).
        f"  tcp-request connection reject unless {{ src {' '.join(client_cidrs) or '0.0.0.0/32'} }}",
        f"  default_backend {BACKEND}",
        f"backend {BACKEND}",
        "  balance roundrobin",
    ]
    if http:
        lines += [
            f"  option httpchk GET {check.get('path', '/')}",
            f"  http-check expect status {check.get('matcher', '200')}",
        ]
    for target_id, address in sorted(servers.items()):
        lines.append(f"  server {server_args(group, target_id, address, clock)} disabled")
    return "\n".join(lines) + "\n"


def _check_times(group: TargetGroup, clock: float) -> tuple[int, int]:
    """The health check's interval and timeout in ms on the lab's clock, with floors a loaded
    2-core machine keeps (a TLS handshake to a busy namespace can take a few hundred ms)."""
    check = group.health_check
    interval = max(1000, round(float(check.get("interval", 30)) * clock * 1000))
    return interval, max(800, min(interval, round(float(check.get("timeout", 10)) * clock * 1000)))


def server_args(group: TargetGroup, target_id: str, address: str, clock: float) -> str:
    """One target as a HAProxy server (its check as the target group's), for the config file
    and for `add server`."""
    check = group.health_check
    interval, _ = _check_times(group, clock)
    https = str(check.get("protocol", "TCP")).upper() == "HTTPS"
    ssl = " check-ssl verify none" if https else ""  # an NLB does not verify a target's certificate
    rise, fall = int(float(check.get("healthyThreshold", 3))), int(float(check.get("unhealthyThreshold", 3)))
    return f"{target_id} {address}:{group.port} check{ssl} inter {interval}ms rise {rise} fall {fall}"


def add_server(socket_path: str, group: TargetGroup, target_id: str, address: str, clock: float) -> str:
    """A new instance's server on the running HAProxy, in maintenance until registered, its
    health check on (dynamic servers start in maintenance with checks off)."""
    if target_id in haproxy_status(socket_path):
        return f"{target_id}: already a server"
    answer = runtime(socket_path, f"add server {BACKEND}/{server_args(group, target_id, address, clock)}")
    if "New server registered" not in answer:
        raise RuntimeError(f"haproxy add server {target_id}: {answer.strip()}")
    runtime(socket_path, f"enable health {BACKEND}/{target_id}")
    return f"{target_id}: server added"


def runtime(socket_path: str, command: str) -> str:
    """One command on HAProxy's runtime API (its stats socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(socket_path)
        sock.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode()


def haproxy_status(socket_path: str) -> dict[str, str]:
    """Server name -> HAProxy's status (UP, DOWN, MAINT, DRAIN, "UP 1/3", ...)."""
    text = runtime(socket_path, "show stat")
    header, *rows = [line for line in text.splitlines() if line.strip()]
    names = header.lstrip("# ").split(",")
    found = {}
    for row in rows:
        values = dict(zip(names, row.split(","), strict=False))
        if values.get("pxname") == BACKEND and values.get("svname") not in ("BACKEND", "FRONTEND"):
            found[values["svname"]] = values.get("status", "")
    return found


@dataclass
class Target:
    state: str = UNUSED
    registered_at: float = 0.0
    seen_up: bool = False
    drain_until: float = 0.0


@dataclass
class TargetGroupStandIn:
    group: TargetGroup
    socket_path: str
    delay: float  # the deregistration delay on the lab's clock
    targets: dict[str, Target] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    log: list[tuple[float, str, str]] = field(default_factory=list)  # (time, target, event)

    def register(self, target_id: str) -> None:
        with self.lock:
            target = self.targets.setdefault(target_id, Target())
            if target.state in (UNUSED, DRAINING):
                target.state, target.registered_at, target.seen_up = INITIAL, time.time(), False
                server = f"{BACKEND}/{target_id}"
                # Down until `rise` checks pass (module docstring); drain first: a server in
                # maintenance ignores `health`, one draining gets no new connections meanwhile.
                commands = (f"set server {server} state drain", f"set server {server} health down",
                            f"set server {server} state ready")  # fmt: skip
                runtime(self.socket_path, "; ".join(commands))
                self.log.append((time.time(), target_id, "registered"))

    def deregister(self, target_id: str) -> None:
        with self.lock:
            target = self.targets.get(target_id)
            if target is None or target.state in (UNUSED, DRAINING):
                return
            target.state, target.drain_until = DRAINING, time.time() + self.delay
            runtime(self.socket_path, f"set server {BACKEND}/{target_id} state drain")
            self.log.append((time.time(), target_id, "deregistered"))

    def tick(self) -> None:
        """Follow HAProxy's checks and the deregistration delay."""
        with self.lock:
            status = haproxy_status(self.socket_path)
            now = time.time()
            for target_id, target in self.targets.items():
                seen = status.get(target_id, "")
                if target.state == DRAINING:
                    if now >= target.drain_until:
                        runtime(self.socket_path, f"set server {BACKEND}/{target_id} state maint")
                        target.state = UNUSED
                        self.log.append((now, target_id, "removed"))
                    continue
                if target.state == UNUSED:
                    continue
                if seen.startswith("UP") and not seen.startswith("UP "):
                    target.seen_up, target.state = True, HEALTHY
                elif seen.startswith("DOWN") and not seen.startswith("DOWN "):
                    # Down after it served: failed its checks. Never up yet: still registering.
                    target.state = UNHEALTHY if target.seen_up else INITIAL

    def describe(self, wanted: list[str] | None) -> list[tuple[str, str]]:
        """(target id, state): the wanted ones (unknown ones `unused`), or every registered one."""
        with self.lock:
            if wanted:
                return [(t, self.targets.get(t, Target()).state) for t in wanted]
            return [(t, target.state) for t, target in sorted(self.targets.items()) if target.state != UNUSED]
