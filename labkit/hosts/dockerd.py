"""A real Docker engine in a network namespace: one dockerd per lab node, as on a host.

Standalone: it needs root, `ip`, `unshare` and Debian's `docker.io` (scripts/setup-system.sh
installs it); it imports nothing else of the lab but `netns`. The images it pulls come from the
lab's registry (labkit/hosts/registry.py), built by labkit/images/build.py.

    from labkit.hosts import dockerd

    daemon = dockerd.Daemon(name="worker-1", namespace="qcl-x-worker-1",
                            root=Path("/var/lib/qwen-cluster-lab/x/worker-1"),   # data (disk)
                            run_dir=Path("/run/qcl-docker/x/worker-1"),          # sockets (short)
                            mirror=lab_registry.url,                            # registry.py
                            mark="x/worker-1/docker")
    dockerd.start(daemon)                 # returns once /_ping answers (fails if dockerd dies)
    dockerd.docker(daemon, "pull", "vllm/vllm-openai:v0.33.0")   # the CLI, as root
    daemon.host                           # "unix:///run/qcl-docker/x/worker-1/docker.sock"
    dockerd.stop(daemon, kill=True)       # a crash: its containers keep running meanwhile
    dockerd.kill_marked("x")              # every process of the lab, found by its cgroup

What this machine needs (docs/lab.md, "Where the lab departs from a host"), all applied here:
- `ip netns exec` mounts a fresh sysfs, so /sys/fs/cgroup is empty and dockerd dies with
  `Devices cgroup isn't mounted`: the start script re-creates the host's cgroup mounts in the
  daemon's own private mount namespace before it execs dockerd.
- `--iptables=false --ip6tables=false --bridge=none --ip-forward=false`: host networking only
  (the program runs every container with network_mode host), and no node becomes a router.
- Root lacks CAP_SYS_RESOURCE here: `clamp_ulimits` is the one place a container's ulimits are
  lowered to what this machine allows (the caller decides whether to use it).
- No NVIDIA toolkit: with `gpu_stub=True` a stand-in `nvidia-container-runtime-hook` that exits 0
  sits first on dockerd's PATH, so `--gpus all` is accepted (dockerd looks the hook up on PATH:
  moby daemon/nvidia_linux.go).

Marking: every process a daemon starts (dockerd, its containerd, the shims, the containers, via
`--cgroup-parent`) lives under one cgroup of the v1 `pids` hierarchy, `<MARK_ROOT>/<mark>`, so
`kill_marked` finds them without the namespace (which may already be gone).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit.hosts import netns

DOCKERD = "dockerd"
GPU_HOOK = "nvidia-container-runtime-hook"
# This machine's hard limits for root without CAP_SYS_RESOURCE (docs/lab.md, "Where the lab
# departs from a host").
HARD_LIMITS = {"memlock": 8 * 1024 * 1024, "nofile": 20000}
START_SECONDS = 120.0  # upper bound; a start ends as soon as the daemon answers or dies


class DockerdError(RuntimeError):
    pass


# Marks live in netns.py (every long-lived lab process carries one); here for the API's sake.
mark_dir, mark_shell, marked_pids, kill_marked = (
    netns.mark_dir,
    netns.mark_shell,
    netns.marked_pids,
    netns.kill_marked,
)
CGROUP_PIDS = netns.CGROUP_PIDS
MARK_ROOT = netns.MARK_ROOT


@dataclass(frozen=True)
class Daemon:
    """One dockerd in `namespace`. `root` holds its data (images, containers; on disk), `run_dir`
    its exec-root, pidfile and socket (kept short: unix socket paths end at 108 bytes)."""

    name: str
    namespace: str
    root: Path
    run_dir: Path
    mirror: str | None = None  # http://ip:port of a Registry: Docker Hub's images come from it
    insecure: tuple[str, ...] = ()  # more registries spoken to over plain HTTP (e.g. "nvcr.io")
    hosts: dict[str, str] = field(default_factory=dict)  # name -> IP in the daemon's /etc/hosts
    mark: str | None = None  # cgroup mark (kill_marked); None: no mark
    gpu_stub: bool = True
    # dockerd's `live-restore` (off by default, as in Debian's daemon): a killed dockerd leaves its
    # containers running either way; a new one then restarts them by their restart policy.
    live_restore: bool = False
    group: str = "docker"  # the socket's group (dockerd -G), when the group exists
    extra_args: tuple[str, ...] = ()
    # A file holding the pid of a process whose mount namespace (and network namespace) the
    # daemon starts from, in its own copy: a node whose disk is a mount namespace of its own
    # (labkit/aws/machine.py), so that the host paths a container mounts are the node's. None:
    # the machine's mount namespace, entered through `ip netns exec`.
    mount_pidfile: Path | None = None

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def host(self) -> str:
        """DOCKER_HOST for this daemon."""
        return f"unix://{self.socket}"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "dockerd.pid"

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"


def _cgroup_mounts() -> list[tuple[str, str, str]]:
    """(type, mount point, options) of the host's cgroup hierarchies."""
    mounts = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2") and parts[1].startswith("/sys/fs/cgroup"):
            mounts.append((parts[2], parts[1], parts[3]))
    return mounts


def dockerd_argv(daemon: Daemon) -> list[str]:
    argv = [
        DOCKERD,
        f"--data-root={daemon.root / 'data'}",
        f"--exec-root={daemon.run_dir / 'exec'}",
        f"--pidfile={daemon.pidfile}",
        f"--host={daemon.host}",
        "--storage-driver=overlay2",
        # Host networking only, and no node turned into a router (docs/lab.md, "Where the lab
        # departs from a host").
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--ip-forward=false",
        "--exec-opt=native.cgroupdriver=cgroupfs",
        "--log-level=warn",
    ]
    with contextlib.suppress(KeyError):
        import grp

        grp.getgrnam(daemon.group)
        argv.append(f"--group={daemon.group}")
    if daemon.live_restore:
        argv.append("--live-restore")
    if daemon.mirror:
        argv.append(f"--registry-mirror={daemon.mirror}")
        argv.append(f"--insecure-registry={daemon.mirror.split('://', 1)[-1]}")
    argv += [f"--insecure-registry={name}" for name in daemon.insecure]
    if daemon.mark and CGROUP_PIDS.is_dir():
        argv.append(f"--cgroup-parent=/{MARK_ROOT}/{daemon.mark}/containers")
    return argv + list(daemon.extra_args)


def start_script(daemon: Daemon) -> str:
    """What runs inside `ip netns exec NS unshare --mount`: the cgroup mounts, the hosts file,
    the mark, then dockerd."""
    # / shared inside the daemon's own mount namespace (it is private on a host without systemd):
    # a bind with rslave propagation (node-exporter's rootfs mount) needs a shared or slave
    # source, and nothing made here reaches the host (`ip netns exec` made its copy a slave).
    lines = ["set -e", "mount --make-rshared /", "mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup"]
    for kind, point, options in _cgroup_mounts():
        lines.append(f"mkdir -p {shlex.quote(point)}")
        source = "cgroup2" if kind == "cgroup2" else "cgroup"
        lines.append(f"mount -t {kind} -o {shlex.quote(options)} {source} {shlex.quote(point)}")
    if daemon.hosts:
        hosts = daemon.root / "hosts"
        lines.append(f"mount --bind {shlex.quote(str(hosts))} /etc/hosts")
    text = "\n".join(lines) + "\n"
    if daemon.mark and CGROUP_PIDS.is_dir():
        text += mark_shell(daemon.mark + "/daemon")
    return text + "exec " + " ".join(shlex.quote(word) for word in dockerd_argv(daemon)) + "\n"


def _write_gpu_stub(daemon: Daemon) -> None:
    daemon.bin_dir.mkdir(parents=True, exist_ok=True)
    hook = daemon.bin_dir / GPU_HOOK
    hook.write_text(
        "#!/bin/sh\n"
        "# labkit/hosts/dockerd.py: no NVIDIA toolkit here; `--gpus` is accepted, no GPU is given.\n"
        "cat >/dev/null 2>&1 || true\nexit 0\n"
    )
    hook.chmod(0o755)


def ping(sock: Path, timeout: float = 2.0) -> bool:
    """GET /_ping on a daemon's socket."""
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(timeout)
        client.connect(str(sock))
        client.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
        data = b""
        while chunk := client.recv(4096):
            data += chunk
        client.close()
        return data.startswith(b"HTTP/1.") and b" 200 " in data.split(b"\r\n", 1)[0] + b" "
    except OSError:
        return False


def pid(daemon: Daemon) -> int | None:
    try:
        value = int(daemon.pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return value if _alive(value) else None


def _alive(value: int) -> bool:
    try:
        os.kill(value, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{value}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def running(daemon: Daemon) -> bool:
    return pid(daemon) is not None and ping(daemon.socket)


def start(daemon: Daemon, *, timeout: float = START_SECONDS) -> str:
    """Start the daemon (idempotent: a running one is left alone) and return once it answers
    /_ping. Fails as soon as dockerd exits, with the end of its log; `timeout` only bounds a
    daemon that neither answers nor dies."""
    if running(daemon):
        return f"dockerd {daemon.name} running"
    for needed in (DOCKERD, "unshare"):
        if shutil.which(needed) is None:
            raise DockerdError(f"{needed} is not installed (scripts/setup-system.sh: docker.io, util-linux)")
    daemon.root.mkdir(parents=True, exist_ok=True)
    daemon.run_dir.mkdir(parents=True, exist_ok=True)
    if pid(daemon) is not None:
        # Alive but not answering: one starting already (or hung); stop it and start afresh.
        stop(daemon, grace=5)
    daemon.pidfile.unlink(missing_ok=True)  # a killed dockerd leaves it, and refuses to start
    _stop_containerd(daemon)
    daemon.socket.unlink(missing_ok=True)
    if daemon.hosts:
        # The node's own hosts file (what `ip netns exec` shows its processes), else this machine's.
        node_hosts = netns.NETNS_ETC / daemon.namespace / "hosts"
        source = node_hosts if node_hosts.exists() else Path("/etc/hosts")
        base = source.read_text() if source.exists() else ""
        extra = "".join(f"{ip} {name}\n" for name, ip in sorted(daemon.hosts.items()))
        (daemon.root / "hosts").write_text(base.rstrip("\n") + "\n" + extra)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
    if daemon.gpu_stub:
        _write_gpu_stub(daemon)
        env["PATH"] = f"{daemon.bin_dir}:{env['PATH']}"
    script = daemon.root / "start.sh"
    script.write_text(start_script(daemon))
    argv = ["ip", "netns", "exec", daemon.namespace, "unshare", "--mount", "--propagation", "slave"]
    if daemon.mount_pidfile is not None:
        holder = int(daemon.mount_pidfile.read_text())
        argv = ["nsenter", f"--target={holder}", "--mount", "--net", *argv[4:]]
    with open(daemon.log, "ab") as out:
        process = subprocess.Popen(
            [*argv, "sh", str(script)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            tail = daemon.log.read_text(errors="replace")[-1500:]
            raise DockerdError(f"dockerd {daemon.name} exited {process.returncode} at start: {tail}")
        if ping(daemon.socket):
            return f"dockerd {daemon.name} pid {process.pid} ready in {time.monotonic() - started:.1f} s"
        time.sleep(0.05)
    raise DockerdError(f"dockerd {daemon.name} did not answer /_ping within {timeout:g} s ({daemon.log})")


def stop(daemon: Daemon, *, grace: float = 20.0, kill: bool = False) -> str:
    """Stop the daemon and its containerd: SIGTERM, SIGKILL after `grace` seconds; `kill`:
    SIGKILL at once, as a crash: the containers keep running, and a new daemon restarts them by
    their restart policy (with `live_restore` it adopts them; without it a SIGTERM also stops
    them first). To end everything, containers included, use `kill_marked`.
    Nothing running is not an error."""
    value = pid(daemon)
    if value is None:
        return f"dockerd {daemon.name} not running"
    with contextlib.suppress(ProcessLookupError):
        os.kill(value, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(value):
        time.sleep(0.05)
    if _alive(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(value, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(value):
            time.sleep(0.02)
    daemon.socket.unlink(missing_ok=True)
    daemon.pidfile.unlink(missing_ok=True)
    _stop_containerd(daemon)
    return f"dockerd {daemon.name} pid {value} stopped"


def _stop_containerd(daemon: Daemon) -> None:
    """The containerd dockerd started (it outlives a killed dockerd, and a new dockerd then
    times out waiting for its own). The shims, and so the containers, outlive it."""
    pidfile = daemon.run_dir / "exec" / "containerd" / "containerd.pid"
    try:
        value = int(pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(value, sig)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(value):
            time.sleep(0.02)
        if not _alive(value):
            break
    pidfile.unlink(missing_ok=True)


def docker_cli() -> str:
    found = shutil.which("docker") or "/usr/bin/docker"
    return found


def docker(
    daemon: Daemon, *args: str, check: bool = True, timeout: float = 300.0, input: str | None = None
) -> subprocess.CompletedProcess:
    """The docker CLI against this daemon's socket, as root."""
    done = subprocess.run(
        [docker_cli(), "--host", daemon.host, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )
    if check and done.returncode != 0:
        raise DockerdError(f"docker {' '.join(args[:3])}: {(done.stderr or done.stdout).strip()[-1500:]}")
    return done


def clamp_ulimits(ulimits: list[dict]) -> tuple[list[dict], list[str]]:
    """A container's ulimits lowered to this machine's hard limits (root here lacks
    CAP_SYS_RESOURCE: `--ulimit memlock=-1` fails with `error setting rlimit type 8`), and one
    line per change. The lab's only change to a container spec for this machine."""
    result, notes = [], []
    for limit in ulimits:
        cap = HARD_LIMITS.get(str(limit.get("name")))
        if cap is None:
            result.append(limit)
            continue
        soft, hard = int(limit.get("soft", 0)), int(limit.get("hard", 0))
        new_soft = cap if soft < 0 or soft > cap else soft
        new_hard = cap if hard < 0 or hard > cap else hard
        if (new_soft, new_hard) != (soft, hard):
            notes.append(
                f"ulimit {limit['name']} {soft}:{hard} -> {new_soft}:{new_hard} (no CAP_SYS_RESOURCE here)"
            )
        result.append({**limit, "soft": new_soft, "hard": new_hard})
    return result, notes
