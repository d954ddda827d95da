"""The lab's image builder: an image (a rootfs layer, its config and v2 manifest) made of this
machine's own programs and trees, built once and cached outside the clone, keyed by its inputs.

Standalone: it needs `ldd` and Python's standard library; it imports nothing of the lab. The
registry (labkit/hosts/registry.py) publishes what it builds; labkit/images/standins.py builds the
lab's images this way (LabKnobs.extra_trees for vLLM's).

    from labkit.images import build

    spec = build.ImageSpec(
        programs=("/usr/bin/python3", "/bin/bash"),         # with their shared libraries
        trees=(("/opt/venv", "/opt/venv"),),                 # host dir -> path in the image
        files=(("/usr/local/bin/hello", "#!/bin/sh\\necho hi\\n", 0o755),),
        entrypoint=("/bin/bash", "-c"), env=("PATH=/usr/local/bin:/usr/bin:/bin",),
    )
    image = build.build(spec)                                # build.Built (cached)
    registry.publish(lab_registry, "vllm/vllm-openai:v0.33.0", image)

    # a directory tree into an image (e.g. a venv), on a cached base:
    build.ImageSpec(trees=(("/opt/vllm-venv", "/opt/venv"),), base=some_spec)
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

# Built images live here, outside any clone (CI runs from a fresh one on the same machine).
CACHE = Path(os.environ.get("QCL_LAB_CACHE", "/var/cache/qwen-cluster-lab"))
# Part of every image's cache key: bump it when build() changes what it writes.
BUILDER_VERSION = 5
DPKG_STATUS = "/var/lib/dpkg/status"


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
    history = [{"created": "1970-01-01T00:00:00Z", "created_by": "labkit/images/build.py build"}]
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
