"""Build, check and tear down a lab from a LabPlan.

Everything the lab makes is named with the plan's prefix (`qcl-<label>-`): namespaces,
their /etc/netns/<ns>/ directories, and the state directory under /run. `down` finds it
all again by that prefix, so it also cleans up after a crash. Nothing is created in the
host's network namespace: the bridge lives in the switch namespace and every member's
only link is a veth into it; no namespace has a route off the lab.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from components.config import ClusterConfig
from scripts.labkit import netns, renderers
from scripts.labkit.plan import BRIDGE, MEMBER_IF, PREFIX, STATE_ROOT, LabPlan, Member, namespace_prefix

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Per-node copies of the host's files that the rendered scripts write to. `ip netns exec`
# bind-mounts /etc/netns/<ns>/<entry> over /etc/<entry>, so ufw's rules, /etc/default/ufw,
# the sysctl drop-in and nftables.conf land in the node's copy and the host's /etc stays as it was.
ETC_ENTRIES = ("sysctl.d", "ufw", "default", "nftables.conf")
ETC_MARKER = Path(STATE_ROOT) / "created-etc-netns"
IPERF_PORT = 5201
# The guide's trap: nginx cuts an upstream that stays silent for proxy_read_timeout, 60 s
# by default. A thinking pause just past it must pass through.
NGINX_DEFAULT_READ_TIMEOUT = 60
THINKING_PAUSE = NGINX_DEFAULT_READ_TIMEOUT + 1
# The lab's clock: 1/30 turns the 61 s pause into about 2 s, and scales the load balancer's
# idle timeout alike, so the check keeps the ratio the stack promises without waiting minutes.
DEFAULT_CLOCK_SCALE = 1 / 30


@dataclass
class Options:
    clock_scale: float = DEFAULT_CLOCK_SCALE
    token_delay: float = 0.005
    workers: int = 8


@dataclass
class StepResult:
    node: str
    step: str
    ok: bool
    detail: str = ""


@dataclass
class UpReport:
    steps: list[StepResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)


def scaled_cluster(cluster: ClusterConfig, scale: float) -> ClusterConfig:
    """The stack with its load-balancer idle timeout on the lab's clock."""
    seconds = max(1, round(cluster.load_balancer.idle_timeout_seconds * scale))
    load_balancer = cluster.load_balancer.model_copy(update={"idle_timeout_seconds": seconds})
    return cluster.model_copy(update={"load_balancer": load_balancer})


def state_dir(plan: LabPlan) -> Path:
    return Path(plan.state_dir)


# ---------------------------------------------------------------- topology


def _member_link(plan: LabPlan, member: Member) -> None:
    ns = member.namespace
    netns.add(ns)
    have = netns.run(["ip", "-n", plan.switch, "link", "show", member.switch_port], check=False)
    if have.returncode != 0:
        # Created in the switch namespace, the peer moved straight into the member: no
        # interface of the lab ever exists in the host's namespace.
        netns.run(
            ["ip", "-n", plan.switch, "link", "add", member.switch_port, "type", "veth"]
            + ["peer", "name", MEMBER_IF, "netns", ns]
        )
    netns.run(["ip", "-n", plan.switch, "link", "set", member.switch_port, "master", BRIDGE, "up"])
    netns.run(["ip", "-n", ns, "addr", "replace", f"{member.ip}/{member.prefixlen}", "dev", MEMBER_IF])
    netns.run(["ip", "-n", ns, "link", "set", MEMBER_IF, "up"])
    # On-link host routes to every other lab address and nothing else: no default route.
    for other in plan.members:
        if other.ip != member.ip:
            netns.run(["ip", "-n", ns, "route", "replace", f"{other.ip}/32", "dev", MEMBER_IF])


def _etc_copy(namespace: str) -> None:
    target = netns.NETNS_ETC / namespace
    target.mkdir(parents=True, exist_ok=True)
    for entry in ETC_ENTRIES:
        source, copy = Path("/etc") / entry, target / entry
        if copy.exists() or copy.is_symlink():
            continue
        if source.is_dir():
            shutil.copytree(source, copy, symlinks=True)
        elif source.exists():
            shutil.copy2(source, copy)
        # An entry the host lacks cannot be bind-mounted; the scripts would write to /etc.
        # Create it so that the write lands in the node's copy.
        elif entry.endswith(".d") or entry in ("ufw", "default"):
            copy.mkdir()
        else:
            copy.touch()


# ---------------------------------------------------------------- per-node setup


def _script(plan: LabPlan, member: Member, step: str, text: str | None) -> StepResult:
    if text is None:
        return StepResult(member.node, step, True, "not meaningful in a namespace (skipped)")
    path = state_dir(plan) / f"{member.node}.{step}.sh"
    path.write_text(text)
    done = netns.exec_in(member.namespace, ["bash", str(path)], check=False, timeout=120)
    output = (done.stdout + done.stderr).strip()
    return StepResult(member.node, step, done.returncode == 0, output[-2000:])


def _alive(pidfile: Path, namespace: str) -> bool:
    try:
        pid = int(pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return False
    return pid in netns.pids(namespace)


def _start(plan: LabPlan, member: Member, name: str, argv: list[str]) -> StepResult:
    pidfile = state_dir(plan) / f"{member.node}.{name}.pid"
    if _alive(pidfile, member.namespace):
        return StepResult(member.node, name, True, "running")
    process = netns.spawn(
        member.namespace,
        argv,
        state_dir(plan) / f"{member.node}.{name}.log",
        env={"PYTHONPATH": str(PROJECT_ROOT)},
    )
    pidfile.write_text(str(process.pid))
    return StepResult(member.node, name, True, f"started pid {process.pid}")


def model_server_argv(plan: LabPlan, member: Member, options: Options) -> list[str]:
    """The stand-in on the model port (heads), holding every other probed port open."""
    cluster = plan.cluster
    port = cluster.model_port
    served = {port}
    if member == plan.load_balancer:
        served.add(cluster.load_balancer.port)  # nginx's
    hold = [p for p in plan.probe_ports(member.node) if p not in served]
    argv = [sys.executable, "-m", "scripts.labkit.modelserver", "--node", member.node]
    argv += ["--port", str(port), "--hold", ",".join(map(str, hold))]
    argv += ["--model", cluster.model.name, "--token-delay", str(options.token_delay)]
    return argv


def start_model_server(plan: LabPlan, member: Member, options: Options) -> StepResult:
    result = _start(plan, member, "model", model_server_argv(plan, member, options))
    deadline = time.monotonic() + 10
    from scripts.labkit import probes

    while time.monotonic() < deadline:
        if netns.call_in(
            member.namespace, probes.tcp_connect, "127.0.0.1", plan.cluster.model_port, 0.5
        ).open:
            return result
        time.sleep(0.1)
    return StepResult(member.node, "model", False, "model stand-in did not start listening within 10 s")


def stop_model_server(plan: LabPlan, member: Member) -> None:
    pidfile = state_dir(plan) / f"{member.node}.model.pid"
    if _alive(pidfile, member.namespace):
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and pid in netns.pids(member.namespace):
            time.sleep(0.05)
    pidfile.unlink(missing_ok=True)


def node_etc(member: Member) -> str:
    return str(netns.NETNS_ETC / member.namespace)


def node_state(plan: LabPlan, member: Member) -> str:
    return str(state_dir(plan) / member.node)


def firewall(plan: LabPlan, member: Member, flavour: str | None = None, rules=None) -> StepResult:
    text = renderers.firewall_script(
        plan.cluster,
        member.node,
        etc_root=node_etc(member),
        state_dir=node_state(plan, member),
        flavour=flavour,
        rules=rules,
    )
    return _script(plan, member, "firewall", text)


def setup_node(plan: LabPlan, member: Member, options: Options) -> list[StepResult]:
    _etc_copy(member.namespace)
    Path(node_state(plan, member)).mkdir(parents=True, exist_ok=True)
    cluster = plan.cluster
    steps = [
        _script(plan, member, "preflight", renderers.preflight_script(cluster, member.node)),
        _script(plan, member, "sysctl", renderers.sysctl_script(cluster)),
        firewall(plan, member),
        start_model_server(plan, member, options),
        _start(plan, member, "iperf3", ["iperf3", "-s", "-p", str(IPERF_PORT)]),
    ]
    return steps


def nginx_site(plan: LabPlan, options: Options) -> str:
    """The rendered nginx.conf, on the lab's clock (idle timeout scaled), paths in the state dir."""
    return renderers.nginx_conf(
        scaled_cluster(plan.cluster, options.clock_scale), state_dir=str(state_dir(plan))
    )


def start_nginx(plan: LabPlan, options: Options) -> StepResult:
    member = plan.load_balancer
    state = state_dir(plan)
    (state / "nginx-temp").mkdir(parents=True, exist_ok=True)
    main = state / "nginx.conf"
    main.write_text(nginx_site(plan, options))
    test = netns.exec_in(
        member.namespace, ["nginx", "-t", "-q", "-p", str(state), "-c", str(main)], check=False
    )
    if test.returncode != 0:
        return StepResult(member.node, "nginx", False, (test.stderr or test.stdout).strip())
    pidfile = state / f"{member.node}.nginx.pid"
    if _alive(pidfile, member.namespace):
        os.kill(int(pidfile.read_text()), signal.SIGHUP)  # reload the (maybe changed) config
        return StepResult(member.node, "nginx", True, "reloaded")
    # Foreground (daemon off) so that the pid we record is nginx's master.
    result = _start(plan, member, "nginx", ["nginx", "-p", str(state), "-c", str(main), "-g", "daemon off;"])
    from scripts.labkit import probes

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if netns.call_in(
            member.namespace, probes.tcp_connect, member.ip, plan.cluster.load_balancer.port, 0.5
        ).open:
            return result
        time.sleep(0.1)
    return StepResult(member.node, "nginx", False, "nginx did not listen within 10 s")


def up(plan: LabPlan, options: Options | None = None) -> UpReport:
    """Build (or re-apply) the lab. Idempotent: existing namespaces and links are kept,
    addresses and routes replaced, scripts re-run, running servers left running."""
    options = options or Options()
    missing = netns.missing_requirements()
    if missing:
        raise netns.NetnsError("; ".join(missing))
    state_dir(plan).mkdir(parents=True, exist_ok=True)
    if not netns.NETNS_ETC.exists():
        # Remembered so that `down` removes /etc/netns only if the lab made it.
        netns.NETNS_ETC.mkdir()
        ETC_MARKER.touch()
    netns.add(plan.switch)
    if netns.run(["ip", "-n", plan.switch, "link", "show", BRIDGE], check=False).returncode != 0:
        netns.run(["ip", "-n", plan.switch, "link", "add", BRIDGE, "type", "bridge"])
    netns.run(["ip", "-n", plan.switch, "link", "set", BRIDGE, "up"])
    report = UpReport()
    with ThreadPoolExecutor(max_workers=options.workers) as pool:
        list(pool.map(lambda member: _member_link(plan, member), plan.members))
        for steps in pool.map(lambda member: setup_node(plan, member, options), plan.nodes):
            report.steps += steps
    report.steps.append(start_nginx(plan, options))
    return report


def lab_namespaces(label: str | None = None) -> list[str]:
    prefix = namespace_prefix(label) if label else PREFIX
    return [name for name in netns.listed() if name.startswith(prefix)]


def down(label: str | None = None) -> list[str]:
    """Remove every namespace (and its processes and /etc/netns dir) of the lab `label`,
    or of every lab when label is None. Works from names alone, so also after a crash."""
    removed = lab_namespaces(label)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(netns.delete, removed))
    prefix = namespace_prefix(label) if label else PREFIX
    if netns.NETNS_ETC.exists():
        for leftover in netns.NETNS_ETC.iterdir():
            if leftover.name.startswith(prefix):
                shutil.rmtree(leftover, ignore_errors=True)
    root = Path(STATE_ROOT)
    if label:
        shutil.rmtree(root / label, ignore_errors=True)
    elif root.exists():
        for entry in root.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
    created = ETC_MARKER.exists()
    remaining = [entry for entry in root.iterdir() if entry.is_dir()] if root.exists() else []
    if not remaining:
        netns.remove_etc_root_if_empty(created)
        ETC_MARKER.unlink(missing_ok=True)
        if root.exists() and not any(root.iterdir()):
            root.rmdir()
    return removed
