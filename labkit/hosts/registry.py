"""The lab's registry: Debian's docker-registry (distribution 2.8) in a network namespace, a
Docker Hub mirror for the lab's Docker engines (labkit/hosts/dockerd.py), which also stands in
for the other registries they name (nvcr.io), and the push of a built image into it.

Standalone: it needs root, `ip` and Debian's `docker-registry` (scripts/setup-system.sh installs
it); it imports nothing else of the lab but `netns`. What it publishes is an image as files (a v2
manifest, its config and layers: `ImageFiles`), as labkit/images/build.py writes them.

    from labkit.hosts import registry

    lab_registry = registry.Registry(namespace="qcl-x-switch", address="169.254.77.1", port=80,
                                     root=Path("/var/cache/qwen-cluster-lab/registry"), run_dir=...)
    registry.start_registry(lab_registry)
    registry.publish(lab_registry, "vllm/vllm-openai:v0.33.0", image)   # docker.io name as pulled
    # a dockerd.Daemon with mirror=lab_registry.url then pulls it as `vllm/vllm-openai:v0.33.0`

A blob of at least LINK_BLOB_BYTES (the real vLLM's environment layer) is not pushed but hard
linked into the registry's storage, where distribution's own upload would leave it
(`registry_link`, after distribution's registry/storage/paths.go).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from labkit.hosts import netns

REGISTRY = "docker-registry"
# Docker Hub's official images live under library/ in a registry (and so in a mirror).
HUB = "docker.io"
START_SECONDS = 120.0  # upper bound; a start ends as soon as the registry answers or dies


class RegistryError(RuntimeError):
    pass


class ImageFiles(Protocol):
    """An image as files, as `publish` pushes it (labkit/images/build.py Built): its v2 manifest,
    its config and its layers, in the manifest's order."""

    @property
    def manifest(self) -> Path: ...

    @property
    def config(self) -> Path: ...

    @property
    def layers(self) -> list[Path]: ...


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
        raise RegistryError(f"{REGISTRY} is not installed (scripts/setup-system.sh: docker-registry)")
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
            raise RegistryError(f"registry exited {process.returncode} at start: {tail}")
        if _registry_answers(registry):
            return f"registry {registry.url} pid {process.pid} ready in {time.monotonic() - started:.1f} s"
        time.sleep(0.05)
    raise RegistryError(f"registry {registry.url} did not answer within {timeout:g} s")


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


def publish(registry: Registry, image: str, built: ImageFiles, *, link_bytes: int = LINK_BLOB_BYTES) -> str:
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
            raise RegistryError(f"registry refused an upload to {repository}: {status} {body[:300]!r}")
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
            raise RegistryError(f"registry refused blob {digest} of {repository}: {status} {body[:300]!r}")
    status, _, body = _http(
        registry.namespace,
        "PUT",
        f"{base}/manifests/{tag}",
        built.manifest.read_bytes(),
        {"Content-Type": manifest["mediaType"]},
    )
    if status != 201:
        raise RegistryError(f"registry refused the manifest {repository}:{tag}: {status} {body[:300]!r}")
    return f"{repository}:{tag}"
