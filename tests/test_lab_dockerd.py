"""The lab's Docker hosts for real: a registry (labkit/hosts/registry.py) and a dockerd
(labkit/hosts/dockerd.py) in a namespace, an image built once (labkit/images/build.py) and pulled
through the registry as a Docker Hub mirror, a container on host networking, and every
process of it found again by its mark after the namespace is gone.

Needs root, iproute2, Debian's docker.io and docker-registry (scripts/setup-system.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from labkit.hosts import dockerd, netns, registry
from labkit.images import build
from tests.helpers.wait import wait_until

LABEL = f"d{os.getpid() % 100000}"
NAMESPACE = f"qcl-{LABEL}-n1"
MISSING = netns.missing_requirements() + [
    f"{binary} not installed (scripts/setup-system.sh)"
    for binary in ("dockerd", "docker-registry", "busybox")
    if shutil.which(binary) is None
]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")

BUSYBOX = build.ImageSpec(
    programs=("busybox",),
    links=(("/bin/sh", "/bin/busybox"), ("/bin/sleep", "/bin/busybox"), ("/bin/cat", "/bin/busybox")),
    files=(("/etc/lab-release", "lab\n", 0o644),),
    cmd=("/bin/sh", "-c", "echo started; exec sleep 1000"),
    stop_signal="SIGTERM",
)
# A layer on top: the base's files stay, the config is the base's unless set.
CHILD = build.ImageSpec(files=(("/etc/lab-child", "child\n", 0o644),), base=BUSYBOX)
# An uncompressed layer on gzip ones (the real vLLM's environment, labkit/images/standins.py): dockerd
# finds out the compression of each layer it pulls.
PLAIN = build.ImageSpec(files=(("/etc/lab-plain", "plain\n", 0o644),), compressed=False, base=CHILD)


def test_split_reference() -> None:
    assert registry.split_reference("nginx:1.27.3") == ("docker.io", "library/nginx", "1.27.3")
    assert registry.split_reference("vllm/vllm-openai:v0.33.0") == (
        "docker.io",
        "vllm/vllm-openai",
        "v0.33.0",
    )
    assert registry.split_reference("nvcr.io/nvidia/k8s/dcgm-exporter:4.4") == (
        "nvcr.io",
        "nvidia/k8s/dcgm-exporter",
        "4.4",
    )


def test_clamp_ulimits() -> None:
    clamped, notes = dockerd.clamp_ulimits(
        [{"name": "memlock", "soft": -1, "hard": -1}, {"name": "core", "soft": 0, "hard": 0}]
    )
    assert clamped[0] == {
        "name": "memlock",
        "soft": dockerd.HARD_LIMITS["memlock"],
        "hard": dockerd.HARD_LIMITS["memlock"],
    }
    assert clamped[1] == {"name": "core", "soft": 0, "hard": 0}
    assert len(notes) == 1 and "memlock" in notes[0]


def test_build_is_cached_by_inputs(tmp_path: Path) -> None:
    first = build.build(BUSYBOX, cache=tmp_path)
    again = build.build(BUSYBOX, cache=tmp_path)
    assert first == again and first.manifest.exists()
    changed = build.build(
        build.ImageSpec(**{**BUSYBOX.__dict__, "files": (("/etc/lab-release", "other\n", 0o644),)}),
        cache=tmp_path,
    )
    assert changed.key != first.key


def test_a_large_blob_is_linked_into_the_registrys_storage(tmp_path: Path, monkeypatch) -> None:
    blob = tmp_path / "layer.tar"
    blob.write_bytes(b"layer bytes")
    digest = "sha256:" + "ab" * 32
    lab_registry = registry.Registry("unused", "127.0.0.1", 5000, tmp_path / "registry", tmp_path / "run")
    v2 = lab_registry.root / "docker" / "registry" / "v2"
    assert registry.registry_link(lab_registry, "library/x", digest, blob)
    assert registry.registry_link(lab_registry, "other/y", digest, blob)  # a second repository
    data = v2 / "blobs" / "sha256" / "ab" / ("ab" * 32) / "data"
    assert data.samefile(blob)  # the cached file itself, not a copy
    for repository in ("library/x", "other/y"):
        link = v2 / "repositories" / repository / "_layers" / "sha256" / ("ab" * 32) / "link"
        assert link.read_text() == digest
    # Another filesystem: no hard link, the caller pushes the blob over HTTP instead.
    exdev = OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(registry.os, "link", lambda *_: (_ for _ in ()).throw(exdev))
    assert not registry.registry_link(lab_registry, "library/z", "sha256:" + "cd" * 32, blob)
    assert not (v2 / "repositories" / "library" / "z").exists()


@pytest.fixture
def lab(tmp_path: Path):
    netns.add(NAMESPACE)
    lab_registry = registry.Registry(
        NAMESPACE, "127.0.0.1", 5000, tmp_path / "registry", tmp_path / "registry-run", mark=LABEL
    )
    daemon = dockerd.Daemon(
        "n1",
        NAMESPACE,
        tmp_path / "n1",
        Path(f"/run/qcl-docker/{LABEL}-n1"),
        mirror=lab_registry.url,
        mark=f"{LABEL}/n1",
    )
    try:
        yield lab_registry, daemon
    finally:
        dockerd.kill_marked(LABEL)
        netns.delete(NAMESPACE)
        shutil.rmtree(daemon.run_dir, ignore_errors=True)


def test_a_daemon_in_a_namespace_pulls_through_the_lab_registry(lab) -> None:
    lab_registry, daemon = lab
    built = build.build(PLAIN)
    assert len(built.layers) == 3 and not built.compressed and built.base.compressed
    media = [layer["mediaType"] for layer in json.loads(built.manifest.read_text())["layers"]]
    assert media == [build.LAYER_MEDIA_TYPES[True]] * 2 + [build.LAYER_MEDIA_TYPES[False]]
    with tarfile.open(built.layer, "r:") as plain:  # a plain tar, as its media type says
        assert plain.getnames() == ["etc/lab-plain"]
    registry.start_registry(lab_registry)
    assert registry.publish(lab_registry, "lab/busybox:v1", built) == "lab/busybox:v1"
    # Every blob linked into the registry's storage where it can be (the path a multi-GB layer
    # takes), pushed where it cannot: pulled the same either way.
    assert registry.publish(lab_registry, "lab/linked:v1", built, link_bytes=0) == "lab/linked:v1"
    dockerd.start(daemon)
    assert dockerd.start(daemon).endswith("running")  # idempotent

    dockerd.docker(daemon, "pull", "lab/busybox:v1")
    dockerd.docker(daemon, "pull", "lab/linked:v1")
    linked = dockerd.docker(daemon, "image", "inspect", "-f", "{{.Id}}", "lab/linked:v1")
    assert linked.stdout.strip() == built.id
    unknown = dockerd.docker(daemon, "pull", "lab/busybox:nope", check=False)
    assert unknown.returncode != 0
    # One image id on every node: the config's digest, not a per-import id.
    assert (
        dockerd.docker(daemon, "image", "inspect", "-f", "{{.Id}}", "lab/busybox:v1").stdout.strip()
        == built.id
    )

    run = ["run", "-d", "--name", "c1", "--network", "host", "--gpus", "all", "--stop-timeout", "1"]
    run += ["--ulimit", "nofile=20000:20000", "--label", "lab=yes", "lab/busybox:v1"]
    dockerd.docker(daemon, *run)
    state = dockerd.docker(daemon, "inspect", "-f", "{{.State.Running}}", "c1").stdout.strip()
    assert state == "true"
    shown = dockerd.docker(
        daemon, "exec", "c1", "cat", "/etc/lab-release", "/etc/lab-child", "/etc/lab-plain"
    )
    assert shown.stdout == "lab\nchild\nplain\n"
    assert "started" in dockerd.docker(daemon, "logs", "c1").stdout

    # Every process (registry, dockerd, containerd, shim, the container) carries the mark.
    marked = dockerd.marked_pids(LABEL)
    assert len(marked) >= 5, marked
    # A crash leaves the container running; a new daemon comes up on the same data.
    dockerd.stop(daemon, kill=True)
    dockerd.start(daemon)
    dockerd.docker(daemon, "rm", "-f", "c1")

    # The namespace deleted from outside: the mark still finds everything.
    dockerd.docker(daemon, *run[:3], "c2", *run[4:])
    os.system(f"ip netns del {NAMESPACE}")
    assert dockerd.kill_marked(LABEL) >= 4
    wait_until(lambda: not dockerd.marked_pids(LABEL), what="every marked process gone", timeout=10)
