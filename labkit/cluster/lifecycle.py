"""Build, check and tear down a lab from a LabPlan.

Everything the lab makes is named with the plan's prefix (`qcl-<label>-`): namespaces,
their /etc/netns/<ns>/ directories, and the state directory under /run. `down` finds it
all again by that prefix, so it also cleans up after a crash. Nothing is created in the
host's network namespace: the bridge lives in the switch namespace and every member's
only link is a veth into it; no namespace has a route off the lab.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.cluster import endpoint, probes, renderers
from labkit.cluster.blueprint import (
    BRIDGE,
    MEMBER_IF,
    PREFIX,
    REGISTRY_IP,
    REGISTRY_PORT,
    STATE_ROOT,
    LabPlan,
    Member,
    namespace_prefix,
)
from labkit.engine import executor, substitutions
from labkit.engine.executor import StepResult
from labkit.hosts import dockerd, netns, sshd
from labkit.hosts.registry import Registry, start_registry
from labkit.images import standins
from labkit.models import realvllm
from qwen_cluster.config import NAMESPACE
from qwen_cluster.ports import Vantage
from qwen_cluster.render.vllm import HEALTH_PATH
from tooling.offline import Render

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Per-node copies of the host's files that the rendered scripts write to. `ip netns exec`
# bind-mounts /etc/netns/<ns>/<entry> over /etc/<entry>, so ufw's rules, /etc/default/ufw,
# the sysctl drop-in and nftables.conf land in the node's copy and the host's /etc stays as it was.
ETC_ENTRIES = ("sysctl.d", "ufw", "default", "nftables.conf")
ETC_MARKER = Path(STATE_ROOT) / "created-etc-netns"
# What every lab on this machine shares (the lab's users and sudo rule, /etc/netns, the state
# root) is created by the first lab up and removed by the last one down; labs may come and go
# at the same time (two test workers, two shells), so those steps hold this lock.
SHARED_LOCK = Path(f"{STATE_ROOT}.lock")
IPERF_PORT = 5201
# The guide's trap: nginx cuts an upstream that stays silent for proxy_read_timeout, 60 s
# by default. A thinking pause just past it must pass through.
NGINX_DEFAULT_READ_TIMEOUT = 60
THINKING_PAUSE = NGINX_DEFAULT_READ_TIMEOUT + 1
# The lab's clock: 1/30 turns the 61 s pause into about 2 s, and scales the load balancer's
# idle timeout alike, so the check keeps the ratio the stack promises without waiting minutes.
DEFAULT_CLOCK_SCALE = 1 / 30


# Each node's Docker engine (labkit/hosts/dockerd.py): its images and containers on disk, its sockets
# under /run (short: a unix socket path ends at 108 bytes). Both per lab label; `down` removes them.
DOCKER_DATA_ROOT = Path("/var/lib/qwen-cluster-lab")
DOCKER_RUN_ROOT = Path("/run/qcl-docker")
# Registries the lab's dockerds reach over plain HTTP besides the mirror: NGC (dcgm-exporter's
# image), mapped to the lab's registry in each daemon's /etc/hosts.
LAB_REGISTRY_HOSTS = ("nvcr.io",)
# In a node's engine root while a fault test holds its dockerd down.
DAEMON_DOWN = "down"


# vLLM loads Qwen3-32B's weights for minutes before /health answers; the stand-in takes this
# long (on the lab clock: 2 s at 1/30), refusing connections meanwhile, as vLLM does.
MODEL_LOAD_SECONDS = 60.0


@dataclass
class Options:
    clock_scale: float = DEFAULT_CLOCK_SCALE
    token_delay: float = 0.005
    workers: int = 8
    model_load_seconds: float = MODEL_LOAD_SECONDS
    # The user the stack's commands log in as (labkit/hosts/sshd.py): the sudo user, or one without
    # sudo to see preflight refuse it.
    ssh_user: str = sshd.DEPLOY_USER
    # Host keys pinned in place of the ones the lab's sshd's hold (a wrong one must be refused).
    host_key_overrides: dict[str, str] = field(default_factory=dict)
    # The real vLLM (its CPU build serving the tiny Qwen3 model, labkit/models/realvllm.py) in the
    # lab's vLLM images instead of the stand-in (`lab.py up --real-model`).
    real_model: bool = False
    # The real vLLM's KV cache in bytes (None: realvllm.KV_CACHE_BYTES); the routing benchmark's.
    kv_cache_bytes: int | None = None
    # Each replica head's real vLLM engine on a core of its own (round robin over the machine's
    # cores) instead of vLLM's choice (core 0 for every engine on a 2-core machine). Left to
    # vLLM, a two-replica lab's engines shared core 0 while core 1 idled (all 46 worker threads
    # of each bound there), and whichever replica got going starved the other: every policy,
    # least-conn too, sent 93-94 of 96 shared-prefix requests to one replica through the endpoint.
    engine_cores: bool = True


@dataclass
class UpReport:
    steps: list[StepResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the lab's stack substitutions
    applied: executor.Applied | None = None

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)


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


def _hosts_file(member: Member) -> None:
    """The node's /etc/hosts, as a host of the cluster has it: its name (this machine's, which
    every namespace shares) on its own address, never on loopback (docs/monitoring.md, "The ten
    failures", row 1). Written in place, so a fault test's rewrite reaches processes that already
    run."""
    path = netns.NETNS_ETC / member.namespace / "hosts"
    path.write_text(f"127.0.0.1 localhost\n{member.ip} {socket.gethostname()} {member.node}\n")


# ---------------------------------------------------------------- where things run


def node_etc(member: Member) -> str:
    return str(netns.NETNS_ETC / member.namespace)


def node_state(plan: LabPlan, member: Member) -> str:
    return str(state_dir(plan) / member.node)


def bin_dir(plan: LabPlan) -> Path:
    return state_dir(plan) / "bin"


def ssh_dir(plan: LabPlan) -> Path:
    return state_dir(plan) / "ssh"


def ssh_keys(plan: LabPlan) -> sshd.Keys:
    return sshd.Keys(ssh_dir(plan))


def ssh_identity(plan: LabPlan, options: Options) -> substitutions.SshIdentity:
    keys = ssh_keys(plan)
    pinned = {member.node: keys.public_host_key(member.node) for member in plan.nodes}
    return substitutions.SshIdentity(
        user=options.ssh_user,
        private_key=keys.private_key(),
        host_keys={**pinned, **options.host_key_overrides},
    )


def endpoint_identity(plan: LabPlan) -> endpoint.Identity:
    """The lab's API keys and its CA's certificate for the load balancer, made once per lab."""
    return endpoint.ensure(state_dir(plan) / "endpoint", plan.load_balancer.ip)


def client_access(plan: LabPlan, key_index: int | None = 0) -> probes.ClientAccess:
    """How the lab's clients reach its load balancer: the lab's key `key_index` (None: no key;
    an open endpoint takes none) over TLS from the lab's CA."""
    access = plan.cluster.access
    index = None if access.open_endpoint else key_index
    return endpoint_identity(plan).client(index)


def ssh_client(plan: LabPlan) -> sshd.Client:
    """The deployer: in the admin vantage, the address access.adminCidrs lets reach SSH."""
    deployer = next((member for member in plan.vantages if member.vantage is Vantage.ADMIN), None)
    if deployer is None:
        raise netns.NetnsError("the lab reaches its nodes over SSH from access.adminCidrs: set one")
    return sshd.Client(deployer.namespace, ssh_keys(plan).client)


def session_env(node_host: standins.Host) -> dict[str, str]:
    """What a node's sshd gives every session (SetEnv): the shims first on PATH, the lab hooks,
    the node's own Docker engine as DOCKER_HOST."""
    return {
        "PATH": f"{node_host.bin_dir}:{standins.BASE_PATH}",
        "LANG": "C.UTF-8",
        "DOCKER_HOST": node_host.docker_host,
        **node_host.lab_env,
    }


def ssh_daemons(plan: LabPlan, options: Options) -> list[StepResult]:
    """Each node's own sshd in its namespace, its host key generated once per lab."""
    missing = sshd.missing_requirements()
    if missing:
        raise netns.NetnsError("; ".join(missing))
    with shared_lock():  # two labs coming up at once would both `useradd`
        sshd.ensure_users()
    keys = sshd.ensure_keys(ssh_dir(plan), [member.node for member in plan.nodes])
    steps = []
    for member in plan.nodes:
        node_dir = ssh_dir(plan) / member.node
        text = sshd.sshd_config(
            ip=member.ip,
            host_key=keys.host_key(member.node),
            pid_file=node_dir / "sshd.pid",
            authorized_keys=keys.authorized_keys,
            env=session_env(host(plan, member, options)),
        )
        detail = sshd.start(member.namespace, node_dir, text, mark=mark(plan, member, "sshd"))
        steps.append(StepResult(member.node, "sshd", True, detail, op="fixture"))
    return steps


def state_file(plan: LabPlan) -> Path:
    """The last applied render (and the config it came from): what the next apply diffs against."""
    return state_file_for(plan.label)


def state_file_for(label: str) -> Path:
    return Path(STATE_ROOT) / label / "applied.json"


# --------------------------------------------------------------- the lab's size


def size_file_for(label: str) -> Path:
    """How many nodes the lab `label` was built with, written before its machines are made (so a
    lab whose `up` stopped half-way knows it too) and removed with the rest by `down`."""
    return Path(STATE_ROOT) / label / "size.json"


def record_size(plan: LabPlan) -> None:
    path = size_file_for(plan.label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"nodes": [member.node for member in plan.nodes]}))


def recorded_nodes(label: str) -> int | None:
    """The node count of the lab `label` as it is (None: no lab of that label): its size record,
    else the config it last applied."""
    path = size_file_for(label)
    if path.exists():
        return len(json.loads(path.read_text())["nodes"])
    applied = state_file_for(label)
    if applied.exists():
        return len(json.loads(applied.read_text())["config"].get(f"{NAMESPACE}:nodes") or [])
    return None


class SizeError(ValueError):
    """A command given a node count other than the lab's own."""


def nodes_for(label: str, given: int | None) -> int | None:
    """The node count a lab command works with: `given` (--nodes) for a lab that is not up, the
    lab's own otherwise (None: neither, the stack file's). A lab is never checked, applied or
    upgraded as a cluster of another size than the one it is: SizeError, in one line."""
    recorded = recorded_nodes(label)
    if recorded is not None and given is not None and given != recorded:
        raise SizeError(
            f"lab {label} is up with {recorded} nodes, not --nodes {given}: leave --nodes out, "
            f"or `lab.py down` it first"
        )
    return given if given is not None else recorded


def mark(plan: LabPlan, member: Member | None, what: str) -> str:
    """The cgroup mark of a lab process (netns.kill_marked): <label>/<node>/<what>."""
    return f"{plan.label}/{member.node if member else 'lab'}/{what}"


def registry(plan: LabPlan) -> Registry:
    """The lab's registry: in the switch namespace, on the bridge (every node has an on-link
    route to it), storing beside the lab's Docker engines. Its own storage, not one shared by
    every lab: the images carry the lab's knobs (clock, node names, the real vLLM or the
    stand-in) under the program's names, so two labs at once sharing tags would pull each
    other's `vllm/vllm-openai:v0.33.0`. The built images themselves stay cached (images/)."""
    return Registry(
        namespace=plan.switch,
        address=REGISTRY_IP,
        port=REGISTRY_PORT,
        root=DOCKER_DATA_ROOT / plan.label / "registry",
        run_dir=state_dir(plan) / "registry",
        mark=mark(plan, None, "registry"),
    )


def daemon(plan: LabPlan, member: Member) -> dockerd.Daemon:
    """The node's Docker engine, pulling through the lab's registry."""
    return dockerd.Daemon(
        name=member.node or member.namespace,
        namespace=member.namespace,
        root=DOCKER_DATA_ROOT / plan.label / str(member.node),
        run_dir=DOCKER_RUN_ROOT / plan.label / str(member.node),
        mirror=f"http://{REGISTRY_IP}:{REGISTRY_PORT}",
        insecure=LAB_REGISTRY_HOSTS,
        hosts={name: REGISTRY_IP for name in LAB_REGISTRY_HOSTS},
        mark=mark(plan, member, "docker"),
    )


def host(plan: LabPlan, member: Member, options: Options) -> standins.Host:
    state = node_state(plan, member)
    return standins.Host(
        node=member.node,
        namespace=member.namespace,
        ip=member.ip,
        etc_root=node_etc(member),
        state_dir=state,
        bin_dir=str(bin_dir(plan)),
        lab_env={
            "QCL_LAB_STATE": str(state_dir(plan)),
            "QCL_LAB_NODE": member.node,
            "QCL_LAB_NAMESPACE": member.namespace,
            "QCL_LAB_NODE_IP": member.ip,
            "QCL_LAB_NODE_STATE": state,
            "QCL_LAB_ETC": node_etc(member),
            "QCL_LAB_BIN": str(bin_dir(plan)),
            "QCL_LAB_CLOCK": f"{options.clock_scale:g}",
            # The model server's stop grace (destroy_grace_seconds) is its --shutdown-timeout and a
            # margin: on the lab clock with the stand-in, which puts its shutdown on it
            # (labkit/images/imagebin.py), never with the real vLLM, whose shutdown runs at real
            # speed (scaled to 30 s, a loaded P/D bump SIGKILLed it mid-shutdown and dockerd gave
            # up waiting for the exit: "did not receive an exit event").
            "QCL_LAB_STOP_CLOCK": "1" if options.real_model else f"{options.clock_scale:g}",
            "QCL_LAB_TOKEN_DELAY": f"{options.token_delay:g}",
            "QCL_LAB_LOAD_DELAY": f"{options.model_load_seconds * options.clock_scale:.3f}",
            **substitutions.environment(node_etc(member), state, str(bin_dir(plan))),
        },
        docker_host=daemon(plan, member).host,
    )


def hosts(plan: LabPlan, options: Options) -> dict[str, standins.Host]:
    return {member.ip: host(plan, member, options) for member in plan.nodes}


def plan_from_config(config: dict[str, Any], label: str) -> LabPlan:
    from labkit.cluster import blueprint

    return blueprint.from_stack_config(config, label)


def stack_config(plan: LabPlan) -> dict[str, Any]:
    """The `config:` map the lab renders: the stack file's when the plan came from one."""
    if plan.stack_config is not None:
        return plan.stack_config
    dumped = plan.cluster.model_dump(by_alias=True, mode="json", exclude_none=True)
    return {f"{NAMESPACE}:{key}": value for key, value in dumped.items()}


# ---------------------------------------------------------------- the machines


def _start(plan: LabPlan, member: Member, name: str, argv: list[str]) -> StepResult:
    pidfile = state_dir(plan) / f"{member.node}.{name}.pid"
    argfile = pidfile.with_suffix(".argv")
    if _alive(pidfile, member.namespace):
        if not argfile.exists() or argfile.read_text() == json.dumps(argv):
            return StepResult(member.node, name, True, "running", op="fixture")
        os.kill(int(pidfile.read_text()), signal.SIGKILL)  # started with other arguments
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(pidfile, member.namespace):
            time.sleep(0.02)
    process = netns.spawn(
        member.namespace,
        argv,
        state_dir(plan) / f"{member.node}.{name}.log",
        env={"PYTHONPATH": str(PROJECT_ROOT)},
        mark=mark(plan, member, name),
    )
    pidfile.write_text(str(process.pid))
    argfile.write_text(json.dumps(argv))
    return StepResult(member.node, name, True, f"started pid {process.pid}", op="fixture")


def _alive(pidfile: Path, namespace: str) -> bool:
    try:
        pid = int(pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return False
    return pid in netns.pids(namespace)


def served_ports(rendered: Render, member: Member) -> set[int]:
    """Ports a container of the program serves on this node (the holder leaves them alone)."""
    served = set()
    for resource in rendered.of_type(executor.CONTAINER):
        provider = (resource.provider or "").split("::")[-2] if "::" in (resource.provider or "") else ""
        owner = next((r for r in rendered.resources if r.name == provider), None)
        if owner is None or not str(executor.plain(owner.inputs).get("host", "")).endswith(f"@{member.ip}"):
            continue
        container = standins.Container.from_inputs(resource.name, executor.plain(resource.inputs))
        served |= set(standins.serves(container))
    return served


def holder(plan: LabPlan, member: Member, rendered: Render) -> StepResult:
    """A listener on every probed port no container serves, so that a probe that fails was
    refused by the firewall, not by an empty port. SSH is the node's own sshd."""
    served = served_ports(rendered, member) | {sshd.SSH_PORT}
    hold = [port for port in plan.probe_ports(member.node) if port not in served]
    argv = [sys.executable, "-m", "labkit.models.modelserver", "--node", member.node]
    argv += ["--hold", ",".join(map(str, hold))]
    return _start(plan, member, "holder", argv)


@contextlib.contextmanager
def shared_lock():
    """Held while a lab joins or leaves what every lab on this machine shares (SHARED_LOCK)."""
    with open(SHARED_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def join_machine(lab_state: Path) -> None:
    """A lab's state dir made, and /etc/netns if missing, under the shared lock: once the state
    dir exists, another lab's `down` keeps what the labs share."""
    with shared_lock():
        lab_state.mkdir(parents=True, exist_ok=True)
        if not netns.NETNS_ETC.exists():
            # Remembered so that `down` removes /etc/netns only if the lab made it.
            netns.NETNS_ETC.mkdir()
            ETC_MARKER.touch()


def machines(plan: LabPlan, options: Options) -> list[StepResult]:
    """The hosts the program is applied to: namespaces on the lab switch, their /etc copies
    and state dirs, the shims, an iperf3 server each. Idempotent."""
    missing = netns.missing_requirements()
    if missing:
        raise netns.NetnsError("; ".join(missing))
    join_machine(state_dir(plan))
    netns.add(plan.switch)
    if netns.run(["ip", "-n", plan.switch, "link", "show", BRIDGE], check=False).returncode != 0:
        netns.run(["ip", "-n", plan.switch, "link", "add", BRIDGE, "type", "bridge"])
    netns.run(["ip", "-n", plan.switch, "link", "set", BRIDGE, "up"])
    substitutions.install_shims(bin_dir(plan), PROJECT_ROOT)
    with ThreadPoolExecutor(max_workers=options.workers) as pool:
        list(pool.map(lambda member: _member_link(plan, member), plan.members))
    steps = []
    for member in plan.nodes:
        _etc_copy(member.namespace)
        _hosts_file(member)
        Path(node_state(plan, member), substitutions.NODE_LOCK_DIR).mkdir(parents=True, exist_ok=True)
        steps.append(_start(plan, member, "iperf3", ["iperf3", "-s", "-p", str(IPERF_PORT)]))
    return steps + docker_engines(plan, options) + ssh_daemons(plan, options)


def docker_engines(plan: LabPlan, options: Options, daemon_of=None) -> list[StepResult]:
    """The lab's registry on the switch's bridge (labkit/hosts/registry.py), and a Docker engine
    in every node's namespace pulling through it (labkit/hosts/dockerd.py). Idempotent.
    `daemon_of(member)`: the node's engine, when it is not `daemon(plan, member)` (the AWS lab
    starts it in the node's own disk)."""
    daemon_of = daemon_of or (lambda member: daemon(plan, member))
    netns.run(["ip", "-n", plan.switch, "addr", "replace", f"{REGISTRY_IP}/32", "dev", BRIDGE])
    for member in plan.nodes:
        netns.run(["ip", "-n", plan.switch, "route", "replace", f"{member.ip}/32", "dev", BRIDGE])
        netns.run(["ip", "-n", member.namespace, "route", "replace", f"{REGISTRY_IP}/32", "dev", MEMBER_IF])
    lab_registry = registry(plan)
    steps = [StepResult("-", "registry", True, start_registry(lab_registry), op="fixture")]

    def start(member: Member) -> StepResult:
        engine = daemon(plan, member)
        if (engine.root / DAEMON_DOWN).exists():
            # A fault test stopped it: a later apply finds the host's docker down, as on a host.
            return StepResult(member.node, "dockerd", True, "left down (docker_daemon_down)", op="fixture")
        try:
            return StepResult(member.node, "dockerd", True, dockerd.start(daemon_of(member)), op="fixture")
        except dockerd.DockerdError as error:
            return StepResult(member.node, "dockerd", False, str(error), op="fixture")

    with ThreadPoolExecutor(max_workers=options.workers) as pool:
        steps += list(pool.map(start, plan.nodes))
    return steps


def publish_images(
    plan: LabPlan, options: Options, rendered: Render, images: list[str] | None = None
) -> list[str]:
    """Every image the render pulls or runs (`images`: these instead, for a program whose nodes
    pull with the docker CLI), built (cached) and published to the lab's registry under its own
    name; the vLLM stand-in's lab layer carries the lab's clock and node names."""
    if images is None:
        images = [str(executor.plain(r.inputs).get("name")) for r in rendered.of_type(executor.IMAGE)]
        images += [str(executor.plain(r.inputs).get("image")) for r in rendered.of_type(executor.CONTAINER)]
    knobs = lab_knobs(plan, options)
    return standins.publish(registry(plan), [image for image in images if image and image != "None"], knobs)


def lab_knobs(plan: LabPlan, options: Options) -> standins.LabKnobs:
    """What the lab's images carry of the lab (its clock, its nodes), for every tag published."""
    trees = realvllm.image_trees(standins.APP_DIR) if options.real_model else realvllm.ImageTrees((), ())
    return standins.LabKnobs(
        token_delay=options.token_delay,
        load_delay=round(options.model_load_seconds * options.clock_scale, 3),
        clock=options.clock_scale,
        nodes={member.ip: str(member.node) for member in plan.nodes},
        environment_trees=trees.environment,
        top_trees=trees.top,
        kv_cache_bytes=options.kv_cache_bytes,
        engine_cores=engine_cores(plan, options),
    )


def engine_cores(plan: LabPlan, options: Options) -> dict[str, int]:
    """Replica head IP -> the core its real vLLM engine binds: round robin over this machine's
    cores (Options.engine_cores says why); none with the stand-in, which binds nothing."""
    if not (options.engine_cores and options.real_model):
        return {}
    return {str(head.ip): index % (os.cpu_count() or 1) for index, head in enumerate(plan.heads)}


def _prune(plan: LabPlan) -> list[str]:
    """Namespaces of nodes that left the stack (after their resources were deleted)."""
    keep = set(plan.namespaces)
    gone = [name for name in lab_namespaces(plan.label) if name not in keep]
    for name in gone:
        netns.delete(name)
    return gone


# ---------------------------------------------------------------- applying the program


def apply(
    plan: LabPlan,
    options: Options,
    *,
    config: dict[str, Any] | None = None,
    rerun: bool = False,
    on_step=None,
) -> UpReport:
    """`pulumi up` of `config` (default: the plan's) onto the lab: the program rendered under
    mocks, then what it registered executed in the namespaces, from the last applied render
    (none: day 0) to this one. The machines come first; nodes that left go last."""
    record_size(plan)
    report = UpReport(steps=machines(plan, options))
    config = stack_config(plan) if config is None else config
    real_notes: list[str] = []
    if options.real_model:
        config, real_notes = substitutions.real_vllm_config(config)
    rendered, report.notes = executor.render(
        config, plan.label, options.clock_scale, ssh_identity(plan, options), endpoint_identity(plan)
    )
    report.notes += real_notes
    report.notes += [f"docker: {what} ({why})" for what, why in substitutions.DOCKER.items()]
    published = publish_images(plan, options, rendered)
    report.steps.append(StepResult("-", "images", True, "; ".join(published), op="fixture"))
    for member in plan.nodes:
        report.steps.append(holder(plan, member, rendered))
    previous = executor.load_state(state_file(plan))
    old = previous.render if previous else None
    # A node that leaves is still there while its resources are deleted.
    where = hosts(plan_from_config(previous.config, plan.label), options) if previous else {}
    engine = executor.Executor(
        {**where, **hosts(plan, options)},
        workers=options.workers,
        log_dir=state_dir(plan) / "scripts",
        on_step=on_step,
        outputs=previous.outputs if previous else None,
        ssh=ssh_client(plan),
    )
    applied = engine.apply(old, rendered, rerun=rerun)
    executor.save_state(
        state_file(plan), config, executor.state_render(plan.label, applied.state, rendered), engine.outputs
    )
    report.steps += applied.steps
    report.applied = applied
    if applied.ok:
        _prune(plan)
        report.steps.append(wait_until_serving(plan, options))
    return report


def up(plan: LabPlan, options: Options | None = None, *, rerun: bool = False) -> UpReport:
    """Build the lab and apply the stack. A later `up` applies only what changed since the
    last; `rerun` runs every command again (in place) and restarts no container whose
    inputs are unchanged (the lab's idempotency check)."""
    return apply(plan, options or Options(), rerun=rerun)


def wait_until_serving(plan: LabPlan, options: Options) -> StepResult:
    """Every replica head answers /health (the stand-in loads for model_load_seconds on the
    lab clock), asked from the load-balancer node as nginx would."""
    from labkit.cluster import probes

    started = time.monotonic()
    # Bounded by the stack's own health gate (what a rollout would wait for a replica): a real
    # speed wait, never on the lab clock (substitutions.CLOCK_KEYS). A busy machine slows it,
    # nothing hangs it.
    limit = float(plan.cluster.rollout.health_timeout_seconds)
    lb = plan.load_balancer.namespace
    waiting = list(plan.heads)
    while waiting and time.monotonic() - started < limit:
        waiting = [
            head
            for head in waiting
            if netns.call_in(lb, probes.get, head.ip, plan.cluster.model_port, HEALTH_PATH, timeout=1).status
            != 200
        ]
        if waiting:
            time.sleep(0.1)
    seconds = time.monotonic() - started
    if waiting:
        names = ", ".join(head.node for head in waiting)
        return StepResult(
            plan.load_balancer.node,
            "serving",
            False,
            f"no {HEALTH_PATH} 200 from {names} in {seconds:.1f} s "
            f"(rollout.healthTimeoutSeconds={plan.cluster.rollout.health_timeout_seconds})",
        )
    return StepResult(
        plan.load_balancer.node, "serving", True, f"every replica healthy after {seconds:.2f} s", op="fixture"
    )


# ---------------------------------------------------------------- containers, for fault tests


def containers(plan: LabPlan, member: Member, kind: str | None = None) -> dict[str, dict[str, Any]]:
    """The containers on a node's Docker engine (as root, over its socket): name -> its
    `docker inspect` State, Id and Image (the reference it was created from); `kind`: only
    those of that stand-in kind ("model", "nginx", ...)."""
    engine = daemon(plan, member)
    listed = dockerd.docker(engine, "ps", "-aq", check=False).stdout.split()
    if not listed:
        return {}
    shown = json.loads(dockerd.docker(engine, "inspect", *listed).stdout or "[]")
    found = {}
    for entry in shown:
        image = entry["Config"]["Image"]
        try:
            entry_kind = standins.stand_in_for_image(image).kind
        except standins.StandInError:
            entry_kind = None
        if kind is None or entry_kind == kind:
            found[entry["Name"].lstrip("/")] = {"State": entry["State"], "Id": entry["Id"], "Image": image}
    return found


def _container(plan: LabPlan, member: Member, kind: str) -> str:
    found = containers(plan, member, kind)
    if not found:
        raise standins.StandInError(f"no {kind} container on {member.node}")
    return sorted(found)[0]


def stop_model_server(plan: LabPlan, member: Member) -> None:
    """The model container dies (SIGKILL, as a crash): `docker kill` on the node's engine."""
    dockerd.docker(daemon(plan, member), "kill", _container(plan, member, "model"))


def start_model_server(plan: LabPlan, member: Member, options: Options) -> StepResult:
    """The same container started again (`docker start`, or its restart policy)."""
    try:
        name = _container(plan, member, "model")
        dockerd.docker(daemon(plan, member), "start", name)
        return StepResult(member.node, "model", True, f"docker start {name}")
    except (standins.StandInError, dockerd.DockerdError) as error:
        return StepResult(member.node, "model", False, str(error))


def delivered_nginx_conf(plan: LabPlan) -> str:
    """The nginx.conf the load balancer runs: read inside its container, at the path its
    command gives with `-c` (else the image's default)."""
    engine = daemon(plan, plan.load_balancer)
    name = _container(plan, plan.load_balancer, "nginx")
    shown = json.loads(dockerd.docker(engine, "inspect", name).stdout)[0]
    words = [*(shown["Config"].get("Entrypoint") or []), *(shown["Config"].get("Cmd") or [])]
    conf = next((words[i + 1] for i, word in enumerate(words[:-1]) if word == "-c"), "/etc/nginx/nginx.conf")
    return dockerd.docker(engine, "exec", name, "cat", conf).stdout


def docker_daemon_down(plan: LabPlan, member: Member) -> str:
    """The node's dockerd stops (a fault test): killed, as a crash; its containers keep running,
    and `up`/`upgrade` leave it down until `docker_daemon_up`."""
    engine = daemon(plan, member)
    (engine.root / DAEMON_DOWN).touch()
    return dockerd.stop(engine, kill=True)


def docker_daemon_up(plan: LabPlan, member: Member) -> str:
    """The node's dockerd back. Seen on this machine: a dockerd killed with its containerd
    comes back with its running containers exited ("cleaning up after shim disconnected") and
    does not restart the `unless-stopped` ones; a host's boot would. So the lab starts every
    container whose restart policy says it should run (`docker start`), and says so."""
    engine = daemon(plan, member)
    (engine.root / DAEMON_DOWN).unlink(missing_ok=True)
    done = [dockerd.start(engine)]
    for name, shown in containers(plan, member).items():
        inspect = json.loads(dockerd.docker(engine, "inspect", name).stdout)[0]
        policy = inspect["HostConfig"]["RestartPolicy"]["Name"]
        if not shown["State"]["Running"] and policy in ("always", "unless-stopped"):
            dockerd.docker(engine, "start", name)
            done.append(f"started {name} again ({policy})")
    return "; ".join(done)


# ---------------------------------------------------------------- a rule set of the test's own


def _script(plan: LabPlan, member: Member, step: str, text: str) -> StepResult:
    path = state_dir(plan) / f"{member.node}.{step}.sh"
    path.write_text(text)
    done = netns.exec_in(member.namespace, ["bash", str(path)], check=False, timeout=120)
    output = (done.stdout + done.stderr).strip()
    return StepResult(member.node, step, done.returncode == 0, output[-2000:])


def firewall(plan: LabPlan, member: Member, flavour: str | None = None, rules=None) -> StepResult:
    """A firewall the fault tests choose (another flavour, the guide's strict rules), rendered
    by the project's renderer with the lab's paths; the program's own runs through `apply`."""
    text = renderers.firewall_script(
        plan.cluster,
        member.node,
        etc_root=node_etc(member),
        state_dir=node_state(plan, member),
        flavour=flavour,
        rules=rules,
    )
    return _script(plan, member, "firewall", text)


def lab_namespaces(label: str | None = None) -> list[str]:
    prefix = namespace_prefix(label) if label else PREFIX
    return [name for name in netns.listed() if name.startswith(prefix)]


def down(label: str | None = None) -> list[str]:
    """Remove everything of the lab `label` (every lab when None): its processes first, found by
    their cgroup mark even when the namespaces were deleted from outside (dockerd, containerd,
    the containers, sshd, the registry, iperf3, the holder), then the namespaces, their /etc/netns
    dirs, the Docker engines' data and sockets, and the state directory. Works from names alone,
    so also after a crash."""
    netns.kill_marked(label or "")
    removed = lab_namespaces(label)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(netns.delete, removed))
    prefix = namespace_prefix(label) if label else PREFIX
    if netns.NETNS_ETC.exists():
        for leftover in netns.NETNS_ETC.iterdir():
            if leftover.name.startswith(prefix):
                shutil.rmtree(leftover, ignore_errors=True)
    # Each engine's data apart, at once: a real-vLLM node holds 2.5 GB in ~60,000 files, and one
    # tree's delete waits on the disk more than on the CPU (11 s each here).
    engines = [base / label if label else base for base in (DOCKER_DATA_ROOT, DOCKER_RUN_ROOT)]
    trees = [tree for engine in engines if engine.is_dir() for tree in engine.iterdir()]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda tree: shutil.rmtree(tree, ignore_errors=True), trees))
    for engine in engines:
        shutil.rmtree(engine, ignore_errors=True)
    root = Path(STATE_ROOT)
    if label:
        shutil.rmtree(root / label, ignore_errors=True)
    elif root.exists():
        for entry in root.iterdir():
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
    with shared_lock():
        created = ETC_MARKER.exists()
        remaining = [entry for entry in root.iterdir() if entry.is_dir()] if root.exists() else []
        if not remaining:
            sshd.remove_users()  # the lab's users and their sudo rule go with the last lab
            netns.remove_etc_root_if_empty(created)
            ETC_MARKER.unlink(missing_ok=True)
            if root.exists() and not any(root.iterdir()):
                root.rmdir()
    return removed
