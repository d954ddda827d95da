"""The images the lab builds in place of the ones the program pulls, and where a container runs.

The lab runs every container the program registers on the node's own Docker engine
(labkit/hosts/dockerd.py), as registered (labkit/engine/dockerprovider.py). What it cannot have is
the real images (no Docker Hub here), so it builds small ones from this machine's own programs
(labkit/images/build.py) and serves them from its registry (labkit/hosts/registry.py) under the
names the program pulls: `STAND_INS`, one table from an image repository to how its image is made,
the name reports give its step, and the ports a container of it serves (known from its inputs
alone, for the probes' port holder). Extend it for a new image; an image without an entry cannot
be pulled in the lab, and its step fails saying so.

- vllm/vllm-openai: host Python, bash, busybox; `vllm` and `ray` on PATH start the stand-ins
  (labkit/images/imagebin.py; the model server is labkit/models/modelserver.py); a lab layer per tag;
- nginx: Debian's nginx, its /etc/nginx, the official image's user and paths, STOPSIGNAL SIGQUIT;
- prom/*: Debian's prometheus, alertmanager, node and blackbox exporters at the official
  images' entrypoints, as `nobody` where those run so;
- python: host Python (Debian's 3.11 for the pinned CPython: the aggregator is stdlib only);
- nvcr.io/nvidia/k8s/dcgm-exporter: no GPU here, every counter of its counters file served at 0;
- vllm/vllm-router: the real router, vllm-router from PyPI (labkit/models/router.py), in its own
  environment on the Python layer, `vllm-router` on PATH as in the project's image.

Every image sits on shared, cached layers (busybox, Python, the lab's code), so a new tag or a
new lab adds a layer of a few bytes. `realvllm` adds its environment under the vLLM image's
code with `environment_trees` and its launcher over it with `top_trees`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.hosts import registry
from labkit.images import build

PROJECT_ROOT = Path(__file__).resolve().parents[2]
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class StandInError(RuntimeError):
    pass


@dataclass(frozen=True)
class Container:
    """The inputs of a `docker:index/container:Container` the lab reads to name and probe it."""

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
            destroy_grace_seconds=int(inputs.get("destroyGraceSeconds") or 0),
        )

    @property
    def repository(self) -> str:
        return repository_of(self.image)


def repository_of(image: str) -> str:
    image = image.split("@", 1)[0]
    head, _, tail = image.rpartition(":")
    return head if head and "/" not in tail else image


@dataclass(frozen=True)
class Host:
    """One lab node: its namespace, address, files, and its Docker engine."""

    node: str
    namespace: str
    ip: str
    etc_root: str  # /etc/netns/<ns>
    state_dir: str  # the node's lab state (what /var/lib/qwen-cluster becomes)
    bin_dir: str  # the lab's shims (systemctl, timedatectl), first on PATH
    lab_env: dict[str, str] = field(default_factory=dict)  # what the node's sshd gives a session
    docker_host: str = ""  # unix:// socket of the node's dockerd (DOCKER_HOST in its sessions)


# ---------------------------------------------------------------- the lab's knobs


@dataclass(frozen=True)
class LabKnobs:
    """What the vLLM stand-in reads from its image's lab layer (labkit/images/imagebin.py LAB_FILE)."""

    token_delay: float = 0.0
    load_delay: float = 0.0
    clock: float = 1.0  # the lab's clock scale: --shutdown-timeout is put on it, as stop graces are
    nodes: dict[str, str] = field(default_factory=dict)  # node IP -> node name
    # The real vLLM (labkit/models/realvllm.py image_trees), as (host path, path in the vLLM image):
    # its environment, below the lab's code, and what must override that code (the launcher).
    environment_trees: tuple[tuple[str, str], ...] = ()
    top_trees: tuple[tuple[str, str], ...] = ()
    # The real vLLM's KV cache in bytes instead of realvllm.KV_CACHE_BYTES (the routing
    # benchmark sizes it so that its working set fits the cluster's cache but not one replica's).
    kv_cache_bytes: int | None = None
    # Node IP -> the core its real vLLM engine binds (VLLM_CPU_OMP_THREADS_BIND); empty: vLLM's own
    # choice, which put every engine of a 2-core machine on core 0.
    engine_cores: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------- layers

BUSYBOX_APPLETS = (
    "sh",
    "awk",
    "basename",
    "cat",
    "chmod",
    "cp",
    "cut",
    "date",
    "dirname",
    "echo",
    "env",
    "expr",
    "false",
    "find",
    "grep",
    "head",
    "hostname",
    "id",
    "kill",
    "ln",
    "ls",
    "mkdir",
    "mv",
    "nc",
    "nproc",
    "printf",
    "ps",
    "readlink",
    "rm",
    "sed",
    "seq",
    "sleep",
    "sort",
    "stat",
    "tail",
    "tee",
    "test",
    "timeout",
    "touch",
    "tr",
    "true",
    "uname",
    "uniq",
    "wc",
    "which",
    "xargs",
)
PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "www-data:x:33:33:www-data:/var/www:/usr/sbin/nologin\n"
    "nginx:x:101:101:nginx user:/nonexistent:/bin/false\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nwww-data:x:33:\nnginx:x:101:\nnogroup:x:65534:\n"
PYTHON = "/usr/bin/python3.11"
PYTHON_LIB = "/usr/lib/python3.11"
# Not needed to run a server; left out to keep the layer small.
PYTHON_EXCLUDE = (
    "__pycache__",
    "/test/",
    "/tests/",
    "/idlelib/",
    "/tkinter/",
    "/turtledemo/",
    "/ensurepip/",
    "/lib2to3/",
    "/config-3.11",
    "/site-packages/",
    "/dist-packages/",
)
APP_DIR = "/opt/qcl-lab/app"
SITE_DIR = "/opt/qcl-lab/site"
# The model server's third-party imports (labkit/models/modelserver.py -> qwen_cluster.render.vllm).
APP_PACKAGES = ("pydantic", "pydantic_core", "typing_extensions", "annotated_types", "typing_inspection")
APP_ENV = (f"PATH={BASE_PATH}", f"PYTHONPATH={APP_DIR}:{SITE_DIR}", "PYTHONDONTWRITEBYTECODE=1")


def _launcher(name: str) -> str:
    return f'#!/bin/sh\nexec python3 -m labkit.images.imagebin {name} "$@"\n'


def busybox_layer() -> build.ImageSpec:
    return build.ImageSpec(
        programs=("busybox",),
        files=(
            ("/etc/passwd", PASSWD, 0o644),
            ("/etc/group", GROUP, 0o644),
            ("/etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n", 0o644),
        ),
        links=(
            *((f"/usr/bin/{name}", "busybox") for name in BUSYBOX_APPLETS),
            ("/var/run", "/run"),  # as on Debian and in the official images
        ),
        env=(f"PATH={BASE_PATH}",),
        cmd=("sh",),
    )


def python_layer() -> build.ImageSpec:
    dynload = sorted(str(path) for path in Path(PYTHON_LIB, "lib-dynload").glob("*.so"))
    return build.ImageSpec(
        programs=(PYTHON, "bash", *dynload),
        trees=((PYTHON_LIB, PYTHON_LIB),),
        links=(("/usr/bin/python3", "python3.11"), ("/usr/bin/python", "python3.11")),
        exclude=PYTHON_EXCLUDE,
        cmd=("python3",),
        base=busybox_layer(),
    )


def _package_paths(name: str) -> list[str]:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise StandInError(f"{name} is not installed in {sys.prefix}: the lab's image needs it")
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)
    return [spec.origin] if spec.origin else []


def app_layer(base: build.ImageSpec | None = None) -> build.ImageSpec:
    """The lab's code and the model server's dependencies, with the launchers, on `base`
    (default: the Python layer)."""
    trees = [(str(PROJECT_ROOT / package), f"{APP_DIR}/{package}") for package in ("labkit", "qwen_cluster")]
    libraries: list[str] = []  # compiled modules bring their shared libraries (libgcc_s, ...)
    for name in APP_PACKAGES:
        for path in _package_paths(name):
            trees.append((path, f"{SITE_DIR}/{Path(path).name}"))
            libraries += sorted(str(so) for so in Path(path).glob("*.so")) if Path(path).is_dir() else []
    # No Hub: the staging's weights fetch records what it would fetch (labkit/images/imagesite/).
    site = Path(__file__).resolve().parent / "imagesite"
    trees.append((str(site / "huggingface_hub"), f"{SITE_DIR}/huggingface_hub"))
    return build.ImageSpec(
        programs=tuple(libraries),
        trees=tuple(trees),
        files=(
            ("/usr/local/bin/vllm", _launcher("vllm"), 0o755),
            ("/usr/local/bin/ray", _launcher("ray"), 0o755),
            ("/usr/local/dcgm/dcgm-exporter-entrypoint.sh", _launcher("dcgm-exporter"), 0o755),
        ),
        env=APP_ENV,
        base=base or python_layer(),
    )


# ---------------------------------------------------------------- one spec per repository


# A tag ending in this stands for a release whose container cannot start: its image lacks
# /bin/bash (a whiteout over the base's), the entrypoint the program gives, so docker's start
# fails after the create (the provider's partial create; labkit/engine/dockerprovider.py). The image
# pulls, and the staging's Python runs in it, as in any other tag.
NO_START_TAG_SUFFIX = "-nostart"


def _vllm(image: str, knobs: LabKnobs) -> build.ImageSpec:
    if image.endswith(NO_START_TAG_SUFFIX):
        working = _vllm(image.removesuffix(NO_START_TAG_SUFFIX), knobs)
        return build.ImageSpec(
            files=(("/usr/bin/.wh.bash", "", 0o644),),  # an OCI whiteout: bash removed
            entrypoint=working.entrypoint,
            env=working.env,
            base=working,
        )
    lab = {
        "image": image,
        "token_delay": knobs.token_delay,
        "load_delay": knobs.load_delay,
        "clock": knobs.clock,
        "nodes": dict(sorted(knobs.nodes.items())),
    }
    if knobs.kv_cache_bytes is not None:
        lab["kv_cache_bytes"] = knobs.kv_cache_bytes
    if knobs.engine_cores:
        lab["engine_cores"] = dict(sorted(knobs.engine_cores.items()))
    base = app_layer()
    if knobs.environment_trees:
        # The real vLLM (labkit/models/realvllm.py), shared by every tag (a bump adds the few bytes
        # below), whole: compiled modules included, three processes import torch and vLLM at
        # every start. Its 2.5 GB sit right on the Python layer, under the lab's code: a layer's
        # cache key covers its base's, which covers the clone's files, so above the code every
        # clone would pack it anew. Uncompressed: it barely compresses, and every node's pull
        # would gunzip it (17 s of a core here).
        environment = build.ImageSpec(
            trees=knobs.environment_trees, exclude=(), env=APP_ENV, compressed=False, base=python_layer()
        )
        base = build.ImageSpec(trees=knobs.top_trees, exclude=(), env=APP_ENV, base=app_layer(environment))
    return build.ImageSpec(
        files=(("/etc/qcl-lab/image.json", json.dumps(lab, sort_keys=True) + "\n", 0o644),),
        env=APP_ENV,
        # The release's Dockerfile: ENTRYPOINT ["vllm", "serve"] (the program sets its own).
        entrypoint=("vllm", "serve"),
        base=base,
    )


def _nginx(image: str, knobs: LabKnobs) -> build.ImageSpec:
    return build.ImageSpec(
        programs=("/usr/sbin/nginx",),
        trees=(("/etc/nginx", "/etc/nginx"), ("/usr/share/nginx", "/usr/share/nginx")),
        # The official image's paths (its nginx is built with them) and Debian's (this nginx's).
        dirs=(
            ("/var/cache/nginx", 0o755),
            ("/var/log/nginx", 0o755),
            ("/var/lib/nginx", 0o755),
            ("/etc/nginx/conf.d", 0o755),
        ),
        cmd=("nginx", "-g", "daemon off;"),
        # The official image's Dockerfile: STOPSIGNAL SIGQUIT (nginx's graceful shutdown).
        stop_signal="SIGQUIT",
        base=busybox_layer(),
    )


def _debian(
    binary: str, entrypoint: str, user: str = "", data: tuple[str, ...] = ()
) -> Callable[[str, LabKnobs], build.ImageSpec]:
    """A Prometheus project image: Debian's binary at the official image's entrypoint, with the
    data files Debian's build reads (`data`: its templates, web assets)."""

    def spec(image: str, knobs: LabKnobs) -> build.ImageSpec:
        links = () if build.in_usr(entrypoint) == binary else ((entrypoint, binary),)
        return build.ImageSpec(
            programs=(binary,),
            trees=tuple((path, path) for path in data if Path(path).exists()),
            links=links,
            entrypoint=(entrypoint,),
            user=user,
            base=busybox_layer(),
        )

    return spec


def _python(image: str, knobs: LabKnobs) -> build.ImageSpec:
    return python_layer()


def _dcgm(image: str, knobs: LabKnobs) -> build.ImageSpec:
    return build.ImageSpec(
        entrypoint=("/usr/local/dcgm/dcgm-exporter-entrypoint.sh",),
        env=APP_ENV,
        base=app_layer(),
    )


def _router(image: str, knobs: LabKnobs) -> build.ImageSpec:
    """vLLM's router as the project publishes it (vllm-project/router Dockerfile.router: a Python
    base, `vllm-router` in /usr/local/bin, no ENTRYPOINT: the container's command is the whole
    argv), made of the PyPI wheel of the same release (labkit/models/router.py): its environment (130 MB,
    62 MB of it the Rust router) at its own path on the lab's Python layer, shared by every tag."""
    from labkit.models import router

    environment = build.ImageSpec(trees=router.image_trees(), exclude=(), base=python_layer())
    return build.ImageSpec(
        links=(("/usr/local/bin/vllm-router", str(router.executable())),),
        env=(f"PATH={BASE_PATH}",),
        base=environment,
    )


# ---------------------------------------------------------------- ports a container serves

_PORT_FLAG = re.compile(r"--port[= ]['\"]?(\d+)")
_LISTEN = re.compile(r"^\s*listen\s+(?:[\d.]+:)?(\d+)", re.M)
_LISTEN_FLAG = re.compile(r"^--web\.listen-address=(?:[^:]*):(\d+)$")
_DCGM_ADDRESS = re.compile(r"^(?:[\d.]*):(\d+)$")
_MASTER_PORT_FLAG = re.compile(r"--master-port[= ]['\"]?(\d+)")


def _vllm_ports(container: Container) -> list[int]:
    """The API port of a `vllm serve` (none for a --headless member), and a multi-node head's
    --master-port (rank 0), where its members join."""
    text = " ".join([*(container.entrypoints or ["vllm", "serve"]), *container.command])
    if "vllm serve" not in text:
        return []
    ports = [int(port) for port in _PORT_FLAG.findall(text)]
    if "--headless" not in text:
        ports += [int(port) for port in _MASTER_PORT_FLAG.findall(text)]
    return ports + _nixl_ports(container, text) + _kv_events_ports(text)


# The KV-cache events publisher's endpoint in `--kv-events-config` (loadBalancer.routing kv-aware:
# qwen_cluster/render/vllm.py kv_events_flags), e.g. "endpoint":"tcp://*:5557".
_KV_EVENTS_ENDPOINT = re.compile(r'"endpoint"\s*:\s*"tcp://[^"]*:(\d+)"')


def _kv_events_ports(text: str) -> list[int]:
    """A kv-aware replica's events publisher: the server's own, as NIXL's ports are (the holder
    took 5557 first and the real server's engine died at bind, `ZMQError: Address already in
    use`, restarting in a loop)."""
    if "--kv-events-config" not in text:
        return []
    return [int(port) for port in _KV_EVENTS_ENDPOINT.findall(text)]


def _nixl_ports(container: Container, text: str) -> list[int]:
    """A disaggregated server's NIXL ports (qwen_cluster/render/kvtransfer.py environment): its
    side channel, and the ends of the UCX range it takes five ports from at random. The server's
    own: the lab's holder must not take them first (the real server's side-channel listener then
    dies at bind, `Address already in use`, and the decode side's handshakes go nowhere)."""
    if "--kv-transfer-config" not in text:
        return []
    ports = [int(container.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600"))]
    low, _, high = container.env.get("UCX_TCP_PORT_RANGE", "").partition("-")
    if low.isdigit():
        ports += [int(low), int(high or low)]
    return ports


def _router_ports(container: Container) -> list[int]:
    """The router's API port (`--port`; its Prometheus listener is on loopback only)."""
    args = container.command
    return [int(value) for flag, value in zip(args, args[1:], strict=False) if flag == "--port"]


def _nginx_ports(container: Container) -> list[int]:
    """The listen ports of an uploaded config; a mounted one is not known before it is written,
    so the image's default (80) stands for it."""
    uploaded = "".join(container.uploads.values())
    return [int(port) for port in _LISTEN.findall(uploaded)] or [80]


def _listen_ports(container: Container) -> list[int]:
    return [int(m.group(1)) for arg in container.command if (m := _LISTEN_FLAG.match(arg))]


def _endpoint_ports(container: Container) -> list[int]:
    text = next((content for path, content in container.uploads.items() if path.endswith(".json")), "{}")
    listen = str(json.loads(text).get("listen", ""))
    return [int(listen.rpartition(":")[2])] if listen else []


def _dcgm_ports(container: Container) -> list[int]:
    args = container.command
    return [
        int(m.group(1))
        for flag, value in zip(args, args[1:], strict=False)
        if flag == "-a" and (m := _DCGM_ADDRESS.match(value))
    ]


@dataclass(frozen=True)
class StandIn:
    repository: str  # the image without its tag
    kind: str  # the step name reports use ("model", "nginx")
    spec: Callable[[str, LabKnobs], build.ImageSpec]  # (image reference, knobs) -> its image
    serves: Callable[[Container], list[int]]  # its ports, known from the inputs alone


STAND_INS: tuple[StandIn, ...] = (
    StandIn("vllm/vllm-openai", "model", _vllm, _vllm_ports),
    StandIn("nginx", "nginx", _nginx, _nginx_ports),
    # prom/*: the official Dockerfiles' ENTRYPOINT and USER.
    StandIn(
        "prom/node-exporter",
        "node-exporter",
        _debian("/usr/bin/prometheus-node-exporter", "/bin/node_exporter", "nobody"),
        _listen_ports,
    ),
    StandIn(
        "prom/blackbox-exporter",
        "blackbox-exporter",
        _debian("/usr/bin/prometheus-blackbox-exporter", "/bin/blackbox_exporter"),
        _listen_ports,
    ),
    StandIn(
        "prom/prometheus",
        "prometheus",
        _debian("/usr/bin/prometheus", "/bin/prometheus", "nobody", ("/usr/share/prometheus/web",)),
        _listen_ports,
    ),
    StandIn(
        "prom/alertmanager",
        "alertmanager",
        _debian(
            "/usr/bin/prometheus-alertmanager",
            "/bin/alertmanager",
            "nobody",
            ("/usr/share/prometheus/alertmanager",),
        ),
        _listen_ports,
    ),
    StandIn("python", "nodemetrics", _python, _endpoint_ports),
    StandIn("nvcr.io/nvidia/k8s/dcgm-exporter", "dcgm-exporter", _dcgm, _dcgm_ports),
    StandIn("vllm/vllm-router", "router", _router, _router_ports),
)


def stand_in_for(container: Container) -> StandIn:
    return stand_in_for_image(container.image, container.resource)


def stand_in_for_image(image: str, resource: str = "") -> StandIn:
    repository = repository_of(image)
    for entry in STAND_INS:
        if repository == entry.repository:
            return entry
    known = ", ".join(entry.repository for entry in STAND_INS)
    raise StandInError(
        f"{resource or image}: image {image} has no stand-in in the lab "
        f"(labkit/images/standins.py STAND_INS knows {known})"
    )


def serves(container: Container) -> list[int]:
    try:
        return stand_in_for(container).serves(container)
    except StandInError:
        return []


def publish(lab_registry: registry.Registry, images: list[str], knobs: LabKnobs) -> list[str]:
    """Build (or find in the cache) and publish every image the lab has a stand-in for; one
    line per image. Those without one are left out: their pull fails as for a missing tag."""
    done = []
    for image in sorted(set(images)):
        try:
            entry = stand_in_for_image(image)
        except StandInError as error:
            done.append(f"{image}: not published ({error})")
            continue
        built = build.build(entry.spec(image, knobs))
        registry.publish(lab_registry, image, built)
        done.append(f"{image}: {entry.kind} image {built.id[:19]}")
    return done


def missing_requirements() -> list[str]:
    reasons = []
    for binary in ("busybox", PYTHON, "bash"):
        if shutil.which(binary) is None:
            reasons.append(f"{binary} is not installed (scripts/setup-system.sh)")
    return reasons
