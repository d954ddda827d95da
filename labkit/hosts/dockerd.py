"""A real Docker engine in a network namespace, a registry for it, and the images it pulls.

Standalone: it needs root, `ip`, `unshare` and Debian's `docker.io` and `docker-registry`
(scripts/setup-system.sh installs them); it imports nothing else of the lab but `netns`.

    from labkit.hosts import dockerd

    # 1. images: a rootfs tarball built once, cached outside the clone, keyed by its inputs
    spec = dockerd.ImageSpec(
        programs=("/usr/bin/python3", "/bin/bash"),         # with their shared libraries
        trees=(("/opt/venv", "/opt/venv"),),                 # host dir -> path in the image
        files=(("/usr/local/bin/hello", "#!/bin/sh\\necho hi\\n", 0o755),),
        entrypoint=("/bin/bash", "-c"), env=("PATH=/usr/local/bin:/usr/bin:/bin",),
    )
    image = dockerd.build(spec)                              # dockerd.Built (cached)

    # 2. a registry in a namespace, serving the images as a Docker Hub mirror
    registry = dockerd.Registry(namespace="qcl-x-switch", address="169.254.77.1", port=80,
                                root=Path("/var/cache/qwen-cluster-lab/registry"), run_dir=...)
    dockerd.start_registry(registry)
    dockerd.publish(registry, "vllm/vllm-openai:v0.33.0", image)   # docker.io name as pulled

    # 3. one dockerd per node namespace, pulling through that registry
    daemon = dockerd.Daemon(name="worker-1", namespace="qcl-x-worker-1",
                            root=Path("/var/lib/qwen-cluster-lab/x/worker-1"),   # data (disk)
                            run_dir=Path("/run/qcl-docker/x/worker-1"),          # sockets (short)
                            mirror=registry.url, mark="x/worker-1/docker")
    dockerd.start(daemon)                 # returns once /_ping answers (fails if dockerd dies)
    dockerd.docker(daemon, "pull", "vllm/vllm-openai:v0.33.0")   # the CLI, as root
    daemon.host                           # "unix:///run/qcl-docker/x/worker-1/docker.sock"
    dockerd.stop(daemon, kill=True)       # a crash: its containers keep running meanwhile
    dockerd.kill_marked("x")              # every process of the lab, found by its cgroup

    # a directory tree into an image (e.g. a venv), on a cached base:
    dockerd.ImageSpec(trees=(("/opt/vllm-venv", "/opt/venv"),), base=some_spec)
    # labkit/images/standins.py builds the lab's images this way (LabKnobs.extra_trees for vLLM's).

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
import errno
import gzip
import hashlib
import http.client
import io
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from labkit.hosts import netns

# Built images live here, outside any clone (CI runs from a fresh one on the same machine).
CACHE = Path(os.environ.get("QCL_LAB_CACHE", "/var/cache/qwen-cluster-lab"))
DOCKERD = "dockerd"
REGISTRY = "docker-registry"
# Docker Hub's official images live under library/ in a registry (and so in a mirror).
HUB = "docker.io"
GPU_HOOK = "nvidia-container-runtime-hook"
# This machine's hard limits for root without CAP_SYS_RESOURCE (docs/lab.md, "Where the lab
# departs from a host").
HARD_LIMITS = {"memlock": 8 * 1024 * 1024, "nofile": 20000}
# Part of every image's cache key: bump it when build() changes what it writes.
BUILDER_VERSION = 4
DPKG_STATUS = "/var/lib/dpkg/status"
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


# ---------------------------------------------------------------- a daemon


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


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Registry:
    """Debian's docker-registry (distribution 2.8) in `namespace`, listening on address:port,
    its storage under `root` (may be shared between labs: what was published stays)."""

    namespace: str
    address: str
    port: int
    root: Path
    run_dir: Path
    mark: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.run_dir / "registry.pid"


def registry_config(registry: Registry) -> str:
    return "\n".join(
        [
            "version: 0.1",
            "log: {level: warn}",
            "storage:",
            f"  filesystem: {{rootdirectory: {registry.root}}}",
            "  delete: {enabled: true}",
            "http:",
            f"  addr: {registry.address}:{registry.port}",
            "",
        ]
    )


def _http(
    namespace: str, method: str, url: str, body: bytes | BinaryIO | None = None, headers=None, timeout=30.0
):
    """One HTTP request from inside `namespace`: (status, headers, body). A file as `body` is
    streamed (a layer of GBs is not read into memory); `headers` must then give its
    Content-Length (without it urllib would send it chunked)."""

    def call():
        request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()
        except (OSError, http.client.HTTPException) as error:
            return 0, {}, str(error).encode()

    return netns.call_in(namespace, call)


def start_registry(registry: Registry, *, timeout: float = START_SECONDS) -> str:
    """Start the registry (idempotent) and return once GET /v2/ answers 200."""
    if shutil.which(REGISTRY) is None:
        raise DockerdError(f"{REGISTRY} is not installed (scripts/setup-system.sh: docker-registry)")
    registry.root.mkdir(parents=True, exist_ok=True)
    registry.run_dir.mkdir(parents=True, exist_ok=True)
    if _registry_answers(registry):
        return f"registry {registry.url} running"
    config = registry.run_dir / "registry.yml"
    config.write_text(registry_config(registry))
    argv = [REGISTRY, "serve", str(config)]
    process = netns.spawn(registry.namespace, argv, registry.run_dir / "registry.log", mark=registry.mark)
    registry.pidfile.write_text(str(process.pid))
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            tail = (registry.run_dir / "registry.log").read_text(errors="replace")[-1500:]
            raise DockerdError(f"registry exited {process.returncode} at start: {tail}")
        if _registry_answers(registry):
            return f"registry {registry.url} pid {process.pid} ready in {time.monotonic() - started:.1f} s"
        time.sleep(0.05)
    raise DockerdError(f"registry {registry.url} did not answer within {timeout:g} s")


def _registry_answers(registry: Registry) -> bool:
    if not netns.exists(registry.namespace):
        return False
    status, _, _ = _http(registry.namespace, "GET", f"{registry.url}/v2/", timeout=2)
    return status == 200


def stop_registry(registry: Registry) -> None:
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        value = int(registry.pidfile.read_text())
        os.killpg(value, signal.SIGKILL)


def split_reference(image: str) -> tuple[str, str, str]:
    """An image reference as a registry holds it: (registry host, repository, tag).
    `nginx:1.27` -> ("docker.io", "library/nginx", "1.27"); digests are not built here."""
    name, tag = image, "latest"
    head, sep, tail = image.rpartition(":")
    if sep and "/" not in tail:
        name, tag = head, tail
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, repository = first, rest
    else:
        host, repository = HUB, name
    if host == HUB and "/" not in repository:
        repository = f"library/{repository}"
    return host, repository, tag


# ---------------------------------------------------------------- images


@dataclass(frozen=True)
class ImageSpec:
    """An image: the layers of `base` (if any) and one layer of its own, made of host programs
    with their shared libraries, host trees copied in, files and links written; and the image
    config (a field left empty is taken from the base). Every input is part of the cache key."""

    programs: tuple[str, ...] = ()  # host binaries, copied at the same path, with ldd's closure
    trees: tuple[tuple[str, str], ...] = ()  # (host path, path in the image): directories or files
    files: tuple[tuple[str, str, int], ...] = ()  # (path in the image, content, mode)
    links: tuple[tuple[str, str], ...] = ()  # (path in the image, target)
    dirs: tuple[tuple[str, int], ...] = ()  # (empty directory in the image, mode)
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
    workdir: str = "/"
    user: str = ""
    stop_signal: str = ""
    exclude: tuple[str, ...] = ("__pycache__", "/test/", "/tests/")  # skipped in trees (substring)
    # gzip the layer (the registry's usual form). False: a plain tar, for a layer of GBs that
    # barely compresses and is pulled on every node: dockerd finds out the compression of each
    # layer it pulls (moby distribution/xfer/download.go hands it to pkg/archive's
    # DecompressStream), so a plain tar saves a gunzip on every pull.
    compressed: bool = True
    base: ImageSpec | None = None  # its layers come first; its config is the default


GZIP_LAYER, PLAIN_LAYER = "layer.tar.gz", "layer.tar"
# Media types of a layer in a v2 manifest (distribution's docs/spec/manifest-v2-2.md).
LAYER_MEDIA_TYPES = {
    True: "application/vnd.docker.image.rootfs.diff.tar.gzip",
    False: "application/vnd.docker.image.rootfs.diff.tar",
}


@dataclass(frozen=True)
class Built:
    """A built image in the cache: its own layer (gzip, or a plain tar), config and manifest,
    and its base."""

    key: str
    folder: Path
    base: Built | None = None

    @property
    def layers(self) -> list[Path]:
        """Every layer file, the base's first."""
        return [*(self.base.layers if self.base else []), self.layer]

    @property
    def compressed(self) -> bool:
        return not (self.folder / PLAIN_LAYER).exists()

    @property
    def layer(self) -> Path:
        return self.folder / (GZIP_LAYER if self.compressed else PLAIN_LAYER)

    @property
    def config(self) -> Path:
        return self.folder / "config.json"

    @property
    def manifest(self) -> Path:
        return self.folder / "manifest.json"

    @property
    def id(self) -> str:
        """The image id docker reports (the config's digest)."""
        return "sha256:" + hashlib.sha256(self.config.read_bytes()).hexdigest()


def _libraries(program: str) -> list[str]:
    done = subprocess.run(["ldd", program], capture_output=True, text=True)
    found = []
    for line in done.stdout.splitlines():
        words = line.split()
        for word in words:
            if word.startswith("/") and os.path.exists(word):
                found.append(word)
    return found


# Debian 12's merged /usr: these are symlinks into usr/ on the host and in every image built here.
MERGED_USR = tuple(
    (name, os.readlink(f"/{name}")) for name in ("bin", "sbin", "lib", "lib64") if os.path.islink(f"/{name}")
)


def in_usr(path: str) -> str:
    """A path in an image with merged /usr applied (/bin/sh -> /usr/bin/sh): a tar entry under
    a symlinked directory would not land where the symlink points."""
    for name, target in MERGED_USR:
        if path == f"/{name}" or path.startswith(f"/{name}/"):
            return "/" + target.strip("/") + path[len(name) + 1 :]
    return path


def _tree_files(host_path: str, exclude: tuple[str, ...]) -> list[str]:
    root = Path(host_path)
    if not root.is_dir():
        return [str(root)]
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not any(x.strip("/") == d for x in exclude)]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            path = os.path.join(directory, name)
            if not any(x in path for x in exclude):
                found.append(path)
    return sorted(found)


def _entries(spec: ImageSpec) -> list[tuple[str, str]]:
    """(host path, path in the image) of every file, programs and libraries included."""
    entries: dict[str, str] = {}
    for program in spec.programs:
        real = shutil.which(program) or program
        for path in [real, *_libraries(real)]:
            # At the path the host resolves it to through its directories (merged /usr: /lib is
            # usr/lib, as in the image, MERGED_USR), and its own symlink's target too.
            canonical = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
            entries[canonical] = canonical
            resolved = os.path.realpath(path)
            entries[resolved] = resolved
    for host_path, image_path in spec.trees:
        image_path = in_usr(image_path)
        for path in _tree_files(host_path, spec.exclude):
            entries[path] = (
                image_path.rstrip("/") + path[len(host_path.rstrip("/")) :]
                if path != host_path
                else image_path
            )
    return sorted(((host, image) for host, image in entries.items()), key=lambda pair: pair[1])


def cache_key(spec: ImageSpec) -> str:
    """sha256 over the spec, its base's key, and each input file's path, size and mtime: the
    programs themselves (their libraries change only with a package, so Debian's package
    database stands for them) and every file of the trees. Cheap: no ldd, no reading."""
    digest = hashlib.sha256(f"{BUILDER_VERSION}\n".encode())
    fields = {name: value for name, value in spec.__dict__.items() if name != "base"}
    digest.update(json.dumps(fields, default=list, sort_keys=True).encode())
    if spec.base is not None:
        digest.update(f"base {cache_key(spec.base)}\n".encode())
    paths = [shutil.which(program) or program for program in spec.programs]
    if spec.programs:
        paths.append(DPKG_STATUS)
    for host_path, _ in spec.trees:
        paths += _tree_files(host_path, spec.exclude)
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(path)
            digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _add_dirs(tar: tarfile.TarFile, path: str, made: set[str]) -> None:
    parts = Path(path).parts[1:-1]
    current = ""
    for part in parts:
        current += "/" + part
        if current not in made:
            made.add(current)
            info = tarfile.TarInfo(current.lstrip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)


def build(spec: ImageSpec, *, cache: Path | None = None) -> Built:
    """The image's layer, config and manifest, built once per cache key (concurrent builders
    of one key: the second finds the first's result or writes the same files)."""
    cache = cache or CACHE / "images"
    base = build(spec.base, cache=cache) if spec.base is not None else None
    key = cache_key(spec)
    built = Built(key, cache / key, base)
    if built.manifest.exists():
        return built
    tmp = cache / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    raw = tmp / PLAIN_LAYER
    made: set[str] = set()
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("tmp", "etc", "root", "dev", "proc", "sys", "run", "var/tmp"):
            made.add("/" + directory)
            if base is None:
                info = tarfile.TarInfo(directory)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if "tmp" in directory else 0o755, 0
                tar.addfile(info)
        for name, target in MERGED_USR:
            made.add("/" + name)
            if base is None:
                info = tarfile.TarInfo(name)
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                tar.addfile(info)
        for host, image in _entries(spec):
            _add_dirs(tar, image, made)
            info = tar.gettarinfo(host, arcname=image.lstrip("/"))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isdir():
                made.add(image)
                tar.addfile(info)
            elif info.isreg():
                with open(host, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
        for image, target in spec.links:
            image = in_usr(image)
            _add_dirs(tar, image, made)
            info = tarfile.TarInfo(image.lstrip("/"))
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
        for image, mode in spec.dirs:
            image = in_usr(image)
            _add_dirs(tar, image, made)
            made.add(image)
            info = tarfile.TarInfo(image.lstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        for image, content, mode in spec.files:
            image = in_usr(image)
            _add_dirs(tar, image, made)
            data = content.encode()
            info = tarfile.TarInfo(image.lstrip("/"))
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    diff_id = "sha256:" + _sha256_file(raw)
    layer = raw
    if spec.compressed:
        layer = tmp / GZIP_LAYER
        with open(raw, "rb") as source, gzip.open(layer, "wb", compresslevel=1) as target:
            shutil.copyfileobj(source, target, 1 << 20)
        raw.unlink()
    base_config = json.loads(base.config.read_text()) if base else {}
    image_config = dict(base_config.get("config", {}))
    image_config.update(
        {
            k: v
            for k, v in {
                "Env": list(spec.env),
                "Entrypoint": list(spec.entrypoint) or None,
                "Cmd": list(spec.cmd) or None,
                "WorkingDir": spec.workdir,
                "User": spec.user,
                "StopSignal": spec.stop_signal or None,
            }.items()
            if v
        }
    )
    if spec.entrypoint and not spec.cmd:
        image_config.pop("Cmd", None)  # as a Dockerfile's ENTRYPOINT resets the base's CMD
    history = [{"created": "1970-01-01T00:00:00Z", "created_by": "labkit/hosts/dockerd.py build"}]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": image_config,
        "rootfs": {
            "type": "layers",
            "diff_ids": [*base_config.get("rootfs", {}).get("diff_ids", []), diff_id],
        },
        "history": [*base_config.get("history", []), *history],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    (tmp / "config.json").write_bytes(config_bytes)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "size": len(config_bytes),
            "digest": "sha256:" + hashlib.sha256(config_bytes).hexdigest(),
        },
        "layers": [
            *(json.loads(base.manifest.read_text())["layers"] if base else []),
            {
                "mediaType": LAYER_MEDIA_TYPES[spec.compressed],
                "size": layer.stat().st_size,
                "digest": diff_id if layer == raw else "sha256:" + _sha256_file(layer),
            },
        ],
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    with contextlib.suppress(OSError):  # another builder got there first: same content
        tmp.rename(built.folder)
    shutil.rmtree(tmp, ignore_errors=True)
    return built


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# A blob at least this large is linked into the registry's storage instead of sent over HTTP
# (registry_link): the real vLLM's 2.4 GB environment layer, which a push made the registry
# receive, hash and write again on every lab up. The registry serves it all the same.
LINK_BLOB_BYTES = 64 << 20


def registry_link(registry: Registry, repository: str, digest: str, path: Path) -> bool:
    """Put a blob into the registry's filesystem storage as a hard link to the cached file, and
    link it into `repository`, as the registry's own upload leaves it (distribution's
    registry/storage/paths.go: the blob at v2/blobs/<alg>/<2 hex>/<hex>/data, the repository's
    v2/repositories/<name>/_layers/<alg>/<hex>/link holding the digest). The manifest is then
    pushed over HTTP as usual, and the registry checks each layer through that link. False when
    the cache and the registry's storage are on different filesystems (no hard link there):
    the caller pushes the blob instead. The registry never writes a stored blob again, and its
    deletes unlink, so the cached file is not changed through the link."""
    algorithm, _, hexdigest = digest.partition(":")
    v2 = registry.root / "docker" / "registry" / "v2"
    data = v2 / "blobs" / algorithm / hexdigest[:2] / hexdigest / "data"
    data.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(path, data)
    except FileExistsError:
        pass
    except OSError as error:
        if error.errno == errno.EXDEV:
            return False
        raise
    link = v2 / "repositories" / repository / "_layers" / algorithm / hexdigest / "link"
    link.parent.mkdir(parents=True, exist_ok=True)
    partial = link.with_name(f".link.{os.getpid()}")
    partial.write_text(digest)
    partial.replace(link)
    return True


def publish(registry: Registry, image: str, built: Built, *, link_bytes: int = LINK_BLOB_BYTES) -> str:
    """Push a built image into the registry under the name `docker pull IMAGE` asks a mirror
    for (`nginx:1.27` -> library/nginx:1.27; `nvcr.io/x/y:t` -> x/y:t, for a daemon that maps
    nvcr.io to the registry). Blobs the registry has are not sent again; a blob of at least
    `link_bytes` is linked into its storage (registry_link) where it can be."""
    _, repository, tag = split_reference(image)
    base = f"{registry.url}/v2/{repository}"
    manifest = json.loads(built.manifest.read_text())
    layers = zip([layer["digest"] for layer in manifest["layers"]], built.layers, strict=True)
    blobs = [(manifest["config"]["digest"], built.config), *layers]
    for digest, path in blobs:
        status, _, _ = _http(registry.namespace, "HEAD", f"{base}/blobs/{digest}")
        if status == 200:
            continue
        if path.stat().st_size >= link_bytes and registry_link(registry, repository, digest, path):
            continue
        status, headers, body = _http(registry.namespace, "POST", f"{base}/blobs/uploads/", b"")
        location = headers.get("Location", "")
        if status != 202 or not location:
            raise DockerdError(f"registry refused an upload to {repository}: {status} {body[:300]!r}")
        if location.startswith("/"):
            location = registry.url + location
        joiner = "&" if "?" in location else "?"
        with open(path, "rb") as blob:
            status, _, body = _http(
                registry.namespace,
                "PUT",
                f"{location}{joiner}digest={digest}",
                blob,
                {"Content-Type": "application/octet-stream", "Content-Length": str(path.stat().st_size)},
                timeout=300,
            )
        if status != 201:
            raise DockerdError(f"registry refused blob {digest} of {repository}: {status} {body[:300]!r}")
    status, _, body = _http(
        registry.namespace,
        "PUT",
        f"{base}/manifests/{tag}",
        built.manifest.read_bytes(),
        {"Content-Type": manifest["mediaType"]},
    )
    if status != 201:
        raise DockerdError(f"registry refused the manifest {repository}:{tag}: {status} {body[:300]!r}")
    return f"{repository}:{tag}"


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
