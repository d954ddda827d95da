"""Containers the program registers, run as stand-in processes in a node's namespace.

`STAND_INS` is the one table from a container's image to the process the lab runs for it;
extend it for a new image (e.g. a monitoring container). A stand-in is started with the
container's own environment and command where that means something here (the vLLM image's
`bash -c` script runs as is; `vllm` on PATH is the stand-in model server), or with the real
program and the files the container would see (nginx with the delivered nginx.conf).

Each running stand-in has a record, `<lab state>/<node>/containers/<name>.json`, which the
executor and the `docker` shim (labkit/shims.py) both use: Docker names containers
per host, so (node, name) is the identity, and a second container of the same name on the
same host is refused as dockerd refuses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from labkit import substitutions

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
READY_SECONDS = 15.0


@dataclass(frozen=True)
class Container:
    """The inputs of a `docker:index/container:Container` the lab acts on."""

    resource: str
    name: str
    image: str
    entrypoints: list[str]
    command: list[str]
    env: dict[str, str]
    uploads: dict[str, str]  # container path -> content
    volumes: dict[str, str]  # container path -> host path (as the program registered it)
    labels: dict[str, str]
    stop_signal: str | None
    destroy_grace_seconds: int

    @classmethod
    def from_inputs(cls, resource: str, inputs: dict[str, Any]) -> Container:
        env = {}
        for item in inputs.get("envs") or []:
            key, _, value = str(item).partition("=")
            env[key] = value
        return cls(
            resource=resource,
            name=str(inputs.get("name") or resource),
            image=str(inputs.get("image") or ""),
            entrypoints=[str(x) for x in inputs.get("entrypoints") or []],
            command=[str(x) for x in inputs.get("command") or []],
            env=env,
            uploads={u["file"]: u.get("content", "") for u in inputs.get("uploads") or []},
            volumes={
                v["containerPath"]: v["hostPath"]
                for v in inputs.get("volumes") or []
                if v.get("containerPath") and v.get("hostPath")
            },
            labels={lab["label"]: lab["value"] for lab in inputs.get("labels") or []},
            stop_signal=inputs.get("stopSignal"),
            # kreuzwerker/terraform-provider-docker resourceDockerContainerDelete: ContainerStop
            # with timeout destroy_grace_seconds (0 when unset: the stop signal, then SIGKILL at
            # once), then ContainerRemove(Force).
            destroy_grace_seconds=int(inputs.get("destroyGraceSeconds") or 0),
        )

    @property
    def repository(self) -> str:
        image = self.image.split("@", 1)[0]
        head, _, tail = image.rpartition(":")
        return head if head and "/" not in tail else image


@dataclass(frozen=True)
class Host:
    """Where a stand-in runs: one lab node."""

    node: str
    namespace: str
    ip: str
    etc_root: str  # /etc/netns/<ns>
    state_dir: str  # the node's lab state (what /var/lib/qwen-cluster becomes)
    bin_dir: str  # the shims, first on PATH
    lab_env: dict[str, str] = field(default_factory=dict)  # QCL_LAB_* for the shims

    @property
    def containers(self) -> Path:
        return Path(self.state_dir) / "containers"


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    ports: list[int]  # ports the process serves (ready when they accept); the holder skips them
    run_dir: str


@dataclass(frozen=True)
class StandIn:
    repository: str  # the image without its tag
    kind: str  # the step name reports use ("model", "nginx")
    launch: Callable[[Container, Host], Launch]
    stop_signal: str  # the image's STOPSIGNAL (docker stop sends it first)
    serves: Callable[[Container], list[int]]  # its ports, known from the inputs alone


def _run_dir(container: Container, host: Host) -> Path:
    return host.containers / container.name


def write_atomic(path: Path, text: str) -> None:
    """Replace a file's content in one rename, and only when it differs: the scripts that run
    side by side (a reload here, an `nginx -t` or a `docker ps` there) read the files the lab
    writes for them, and must never see one truncated or half written."""
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == text:
            return
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    partial.write_text(text)
    os.replace(partial, path)


def _mounts(container: Container, host: Host) -> dict[str, str]:
    """Container path -> host path: uploads are written under the stand-in's run dir."""
    run_dir = _run_dir(container, host)
    mounts = {}
    for path, content in container.uploads.items():
        target = run_dir / "uploads" / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, content)
        mounts[path] = str(target)
    for path, host_path in container.volumes.items():
        mounts[path] = substitutions.host_path(host_path, etc_root=host.etc_root, state_dir=host.state_dir)
    return mounts


def _environment(container: Container, host: Host) -> dict[str, str]:
    return {
        "PATH": f"{host.bin_dir}:{BASE_PATH}",
        "HOME": "/root",
        **container.env,
        **host.lab_env,
        "QCL_LAB_CONTAINER": container.name,
        "QCL_LAB_IMAGE": container.image,
    }


_PORT_FLAG = re.compile(r"--port[= ]['\"]?(\d+)")


def _vllm_argv(container: Container) -> list[str]:
    # The image's ENTRYPOINT is `vllm serve` when the program does not set one.
    return [*(container.entrypoints or ["vllm", "serve"]), *container.command]


_MASTER_PORT_FLAG = re.compile(r"--master-port[= ]['\"]?(\d+)")


def _vllm_ports(container: Container) -> list[int]:
    """The API port of a `vllm serve` (none for a --headless member), and a multi-node head's
    --master-port (rank 0), where its members join."""
    text = " ".join(_vllm_argv(container))
    if "vllm serve" not in text:
        return []
    ports = [int(port) for port in _PORT_FLAG.findall(text)]
    if "--headless" not in text:
        ports += [int(port) for port in _MASTER_PORT_FLAG.findall(text)]
    return ports


def _as_command(container: Container, host: Host) -> Launch:
    """The container's entrypoint and command with its env; `vllm` on PATH is the stand-in. Not
    waited for on its ports: vLLM opens its API port only once loaded (a multi-node head once its
    members joined), and dockerd returns once the process runs; the rollout's health gate waits."""
    return Launch(_vllm_argv(container), _environment(container, host), [], "")


NGINX_CONF = "/etc/nginx/nginx.conf"
_LISTEN = re.compile(r"^\s*listen\s+(?:[\d.]+:)?(\d+)", re.M)


def nginx_conf_path(container: Container, host: Host) -> Path:
    return _run_dir(container, host) / "nginx.conf"


def _in_host(path: str, mounts: dict[str, str]) -> str | None:
    """Where a container path lives on the host: the longest mount that holds it."""
    for container_path in sorted(mounts, key=len, reverse=True):
        if path == container_path or path.startswith(container_path.rstrip("/") + "/"):
            return mounts[container_path] + path[len(container_path) :]
    return None


def write_nginx_conf(container: Container, host: Host) -> Path:
    """The delivered nginx.conf (uploaded or mounted; `-c` in the command, else the image's
    default), for a process outside the image. nginx resolves a relative include against the
    directory of its -c file, so those become absolute paths on the host."""
    run_dir = _run_dir(container, host)
    (run_dir / "nginx").mkdir(parents=True, exist_ok=True)
    mounts = _mounts(container, host)
    words = container.command
    conf = next((words[i + 1] for i, word in enumerate(words[:-1]) if word == "-c"), NGINX_CONF)
    source = Path(_in_host(conf, mounts) or "")
    if not source.is_file():
        raise StandInError(f"{container.resource}: {conf} is not delivered (no upload or volume holds it)")
    text = re.sub(
        r"^(\s*include\s+)(?!/)([^;\s]+)\s*;",
        lambda match: f"{match.group(1)}{source.parent}/{match.group(2)};",
        source.read_text(),
        flags=re.M,
    )
    text = substitutions.nginx_conf(text, run_dir=str(run_dir), mounts=mounts)
    path = nginx_conf_path(container, host)
    write_atomic(path, text)
    return path


def _nginx(container: Container, host: Host) -> Launch:
    path = write_nginx_conf(container, host)
    run_dir = str(_run_dir(container, host))
    test = subprocess.run(
        ["ip", "netns", "exec", host.namespace, "nginx", "-t", "-q", "-p", run_dir, "-c", str(path)],
        capture_output=True,
        text=True,
    )
    if test.returncode != 0:
        raise StandInError(f"{container.resource}: nginx -t: {(test.stderr or test.stdout).strip()}")
    ports = [int(port) for port in _LISTEN.findall(path.read_text())]
    # Foreground, so the pid recorded is nginx's master (as in the image: `daemon off`).
    argv = ["nginx", "-p", run_dir, "-c", str(path), "-g", "daemon off;"]
    return Launch(argv, _environment(container, host), ports, run_dir)


def _nginx_ports(container: Container) -> list[int]:
    """The listen ports of an uploaded config; a mounted one is not known before it is written,
    so the image's default (80) stands for it."""
    uploaded = "".join(container.uploads.values())
    return [int(port) for port in _LISTEN.findall(uploaded)] or [80]


# ---------------------------------------------------------------- monitoring (issue 12)
# Debian's prometheus, prometheus-alertmanager, prometheus-node-exporter and
# prometheus-blackbox-exporter run with the container's own arguments, container paths
# mapped to the files the container would see; the endpoint runs qwen_cluster/node/nodemetrics.py as
# uploaded; with no GPU in a namespace, dcgm-exporter's stand-in serves its counters at 0.

_LISTEN_FLAG = re.compile(r"^--web\.listen-address=(?:[^:]*):(\d+)$")


def _mapped(args: list[str], mounts: dict[str, str]) -> list[str]:
    """Arguments with container paths replaced by where the lab keeps those files."""
    result = []
    for arg in args:
        for path in sorted(mounts, key=len, reverse=True):
            if path in arg:
                arg = arg.replace(path, mounts[path])
                break
        result.append(arg)
    return result


def _listen_ports(container: Container) -> list[int]:
    return [int(m.group(1)) for arg in container.command if (m := _LISTEN_FLAG.match(arg))]


def _debian(binary: str, data_flag: str | None = None):
    def launch(container: Container, host: Host) -> Launch:
        mounts = _mounts(container, host)
        run_dir = _run_dir(container, host)
        args = _mapped([arg for arg in container.command if not arg.startswith("--path.rootfs")], mounts)
        for arg in args:
            if data_flag and arg.startswith(f"{data_flag}="):
                Path(arg.split("=", 1)[1]).mkdir(parents=True, exist_ok=True)
        return Launch([binary, *args], _environment(container, host), _listen_ports(container), str(run_dir))

    return launch


def _endpoint_config(container: Container) -> dict[str, Any]:
    text = next((content for path, content in container.uploads.items() if path.endswith(".json")), "{}")
    return json.loads(text)


def _endpoint(container: Container, host: Host) -> Launch:
    mounts = _mounts(container, host)
    argv = _mapped(list(container.entrypoints), mounts)
    if argv and argv[0].startswith("python"):
        argv[0] = sys.executable
    return Launch(
        argv, _environment(container, host), _endpoint_ports(container), str(_run_dir(container, host))
    )


def _endpoint_ports(container: Container) -> list[int]:
    listen = str(_endpoint_config(container).get("listen", ""))
    return [int(listen.rpartition(":")[2])] if listen else []


_DCGM_ADDRESS = re.compile(r"^(?:[\d.]*):(\d+)$")


def _dcgm_ports(container: Container) -> list[int]:
    args = container.command
    return [
        int(m.group(1))
        for flag, value in zip(args, args[1:], strict=False)
        if flag == "-a" and (m := _DCGM_ADDRESS.match(value))
    ]


def _dcgm(container: Container, host: Host) -> Launch:
    """No GPU here: the counters the program enabled, every one 0, served as /metrics."""
    run_dir = _run_dir(container, host)
    run_dir.mkdir(parents=True, exist_ok=True)
    counters = next(iter(container.uploads.values()), "")
    lines = []
    for row in counters.splitlines():
        if row.strip() and not row.startswith("#"):
            field_name, kind = (part.strip() for part in row.split(",")[:2])
            lines += [f"# TYPE {field_name} {kind}", f'{field_name}{{gpu="0",UUID="GPU-lab",xid="0"}} 0']
    (run_dir / "metrics").write_text("\n".join(lines) + "\n")
    port = (_dcgm_ports(container) or [9400])[0]
    argv = [
        sys.executable,
        "-m",
        "http.server",
        "--bind",
        "127.0.0.1",
        "--directory",
        str(run_dir),
        str(port),
    ]
    return Launch(argv, _environment(container, host), [port], str(run_dir))


MONITORING_STAND_INS: tuple[StandIn, ...] = (
    StandIn(
        "prom/node-exporter", "node-exporter", _debian("prometheus-node-exporter"), "SIGTERM", _listen_ports
    ),
    StandIn(
        "prom/blackbox-exporter",
        "blackbox-exporter",
        _debian("prometheus-blackbox-exporter"),
        "SIGTERM",
        _listen_ports,
    ),
    StandIn(
        "prom/prometheus",
        "prometheus",
        _debian("prometheus", "--storage.tsdb.path"),
        "SIGTERM",
        _listen_ports,
    ),
    StandIn(
        "prom/alertmanager",
        "alertmanager",
        _debian("prometheus-alertmanager", "--storage.path"),
        "SIGTERM",
        _listen_ports,
    ),
    StandIn("python", "nodemetrics", _endpoint, "SIGTERM", _endpoint_ports),
    StandIn("nvcr.io/nvidia/k8s/dcgm-exporter", "dcgm-exporter", _dcgm, "SIGTERM", _dcgm_ports),
)


STAND_INS: tuple[StandIn, ...] = (
    StandIn("vllm/vllm-openai", "model", _as_command, "SIGTERM", _vllm_ports),
    # The official image's Dockerfile: STOPSIGNAL SIGQUIT (nginx's graceful shutdown).
    StandIn("nginx", "nginx", _nginx, "SIGQUIT", _nginx_ports),
    *MONITORING_STAND_INS,
)


class StandInError(RuntimeError):
    pass


def serves(container: Container) -> list[int]:
    try:
        return stand_in_for(container).serves(container)
    except StandInError:
        return []


def stand_in_for(container: Container) -> StandIn:
    for entry in STAND_INS:
        if container.repository == entry.repository:
            return entry
    known = ", ".join(entry.repository for entry in STAND_INS)
    raise StandInError(
        f"{container.resource}: image {container.image} has no stand-in in the lab "
        f"(labkit/standins.py STAND_INS knows {known})"
    )


# ---------------------------------------------------------------- records


@dataclass
class Record:
    resource: str
    name: str
    kind: str
    namespace: str
    pid: int
    argv: list[str]
    env: dict[str, str]
    ports: list[int]
    stop_signal: str
    container: dict[str, Any]
    host: dict[str, Any]
    started: float


def record_path(host: Host, name: str) -> Path:
    return host.containers / f"{name}.json"


def read_record(host: Host, name: str) -> Record | None:
    try:
        return Record(**json.loads(record_path(host, name).read_text()))
    except FileNotFoundError:
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":  # a zombie has stopped; only its parent has not waited yet
            return False
    return True


def running(host: Host, name: str) -> Record | None:
    record = read_record(host, name)
    return record if record is not None and alive(record.pid) else None


def _spawn(host: Host, launch: Launch, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, *launch.argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop reaches every process of it
            env=launch.env,
        )


def _accepts(host: Host, port: int) -> bool:
    """Accepting on loopback (the exporters) or on the node's address (the servers that bind
    the cluster address), whichever the container binds."""
    from labkit import netns, probes

    return any(
        netns.call_in(host.namespace, probes.tcp_connect, address, port, 0.3).open
        for address in ("127.0.0.1", host.ip)
    )


def start(container: Container, host: Host) -> tuple[str, Record]:
    """`docker run -d`: refused if a running container on this host has the name."""
    existing = running(host, container.name)
    if existing is not None:
        raise StandInError(
            f'{container.resource}: Conflict. The container name "/{container.name}" is already in use '
            f"by {existing.resource} on {host.node} (a fixed name needs deleteBeforeReplace)"
        )
    entry = stand_in_for(container)
    launch = entry.launch(container, host)
    process = _spawn(host, launch, host.containers / f"{container.name}.log")
    record = Record(
        resource=container.resource,
        name=container.name,
        kind=entry.kind,
        namespace=host.namespace,
        pid=process.pid,
        argv=launch.argv,
        env=launch.env,
        ports=launch.ports,
        stop_signal=container.stop_signal or entry.stop_signal,
        container=asdict(container),
        host=asdict(host),
        started=time.time(),
    )
    write_atomic(record_path(host, container.name), json.dumps(asdict(record), indent=1))
    # dockerd returns once the process runs; the lab also waits for the stand-in to accept on
    # its ports, so an interpreter's start-up is not mistaken for the model's load time.
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (host.containers / f"{container.name}.log").read_text()[-600:]
            raise StandInError(f"{container.resource}: exited {process.returncode} at start: {log}")
        if all(_accepts(host, port) for port in launch.ports):
            break
        time.sleep(0.05)
    else:
        raise StandInError(
            f"{container.resource}: not accepting on {launch.ports} within {READY_SECONDS:g} s"
        )
    return f"{entry.kind} stand-in pid {process.pid}", record


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def stop(host: Host, name: str, *, grace: float = 0.0) -> str:
    """`docker stop -t grace` + `docker rm -f`: the stop signal to the main process, SIGKILL to
    all of it after `grace` seconds. Nothing running is not an error (as the provider's delete
    ignores "No such container")."""
    record = read_record(host, name)
    if record is None:
        return "no such container"
    if alive(record.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, getattr(signal, record.stop_signal, signal.SIGTERM))
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(record.pid):
            time.sleep(0.05)
    _signal_group(record.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(record.pid):
        time.sleep(0.02)
    record_path(host, name).unlink(missing_ok=True)
    return f"stopped pid {record.pid}"


def nginx_test(host: Host, name: str) -> subprocess.CompletedProcess:
    """`nginx -t` on the delivered config, as `docker exec NAME nginx -t` would run it."""
    record = running(host, name)
    if record is None:
        raise StandInError(f"Error response from daemon: No such container: {name} (on {host.node})")
    container = Container(**record.container)
    path = write_nginx_conf(container, host)
    run_dir = str(_run_dir(container, host))
    return subprocess.run(
        ["ip", "netns", "exec", host.namespace, "nginx", "-t", "-q", "-p", run_dir, "-c", str(path)],
        capture_output=True,
        text=True,
    )


def running_kind(host: Host, kind: str) -> Record | None:
    """The running container of a kind on this host (e.g. its nginx)."""
    for path in sorted(host.containers.glob("*.json")):
        record = running(host, path.stem)
        if record is not None and record.kind == kind:
            return record
    return None


def send(host: Host, name: str, sig: int) -> str:
    """`docker kill -s SIG`: nginx re-reads the delivered config first (it may have changed on
    the host: a mounted file), as nginx in the container would see it."""
    record = running(host, name)
    if record is None:
        raise StandInError(f"Error response from daemon: No such container: {name} (on {host.node})")
    if record.kind == "nginx" and sig == signal.SIGHUP:
        write_nginx_conf(Container(**record.container), host)
    os.kill(record.pid, sig)
    return f"{signal.Signals(sig).name} to {name} pid {record.pid}"


def restart(host: Host, name: str) -> str:
    """`docker restart` (and the `unless-stopped` policy after a crash): the same container again."""
    record = read_record(host, name)
    if record is None:
        raise StandInError(f"Error response from daemon: No such container: {name} (on {host.node})")
    stop(host, name, grace=0)
    detail, _ = start(Container(**record.container), host)
    return detail


def all_records(state_root: Path) -> list[Record]:
    records = []
    for path in sorted(state_root.glob("*/containers/*.json")):
        with contextlib.suppress(FileNotFoundError, ValueError):
            records.append(Record(**json.loads(path.read_text())))
    return records
