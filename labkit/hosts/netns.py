"""Network namespaces through `ip`, and code run inside one without a new process.

`ip netns exec` is used for programs that need their namespace's `/etc/netns/<ns>/` files
(sysctl, ufw, nginx). Probes instead run in a thread that joins the namespace with
setns(2): a socket belongs to the namespace it was created in, and a thread costs far
less than an interpreter per probe.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

NETNS_RUN = Path("/run/netns")
# Every long-lived process of a lab lives under one cgroup of the v1 pids hierarchy, its mark
# (<MARK_ROOT>/<label>/...), so `down` finds it without the namespace, which may be gone.
CGROUP_PIDS = Path("/sys/fs/cgroup/pids")
MARK_ROOT = "qwen-cluster-lab"
NETNS_ETC = Path("/etc/netns")
CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class NetnsError(RuntimeError):
    pass


def missing_requirements() -> list[str]:
    """Why the lab cannot run here, one reason each; empty when it can."""
    reasons = []
    if os.geteuid() != 0:
        reasons.append("the lab needs root (network namespaces, firewall rules)")
    for binary in ("ip",):
        if shutil.which(binary) is None:
            reasons.append(f"{binary} is not installed (package iproute2)")
    if not reasons:
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if probe.returncode != 0:
            reasons.append(f"`ip netns list` fails: {probe.stderr.strip()}")
    return reasons


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 60, input: str | None = None):
    """Run a command on the host side (e.g. `ip -n ns ...`); raise with its stderr."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input)
    if check and done.returncode != 0:
        raise NetnsError(
            f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
        )
    return done


def exec_in(namespace: str, argv: Sequence[str], **kwargs):
    """Run a program inside `namespace` with its /etc/netns/<ns>/ files in place."""
    return run(["ip", "netns", "exec", namespace, *argv], **kwargs)


def listed() -> list[str]:
    done = run(["ip", "netns", "list"])
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def exists(namespace: str) -> bool:
    return (NETNS_RUN / namespace).exists()


def add(namespace: str) -> None:
    """Create the namespace (if needed) with loopback up."""
    if not exists(namespace):
        run(["ip", "netns", "add", namespace])
    run(["ip", "-n", namespace, "link", "set", "lo", "up"])


def pids(namespace: str) -> list[int]:
    done = run(["ip", "netns", "pids", namespace], check=False)
    return [int(pid) for pid in done.stdout.split() if pid.isdigit()]


def kill_all(namespace: str, *, grace: float = 2.0) -> None:
    """Stop every process living in the namespace: TERM, then KILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = pids(namespace)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and pids(namespace):
            time.sleep(0.05)


def delete(namespace: str) -> None:
    kill_all(namespace)
    if exists(namespace):
        run(["ip", "netns", "del", namespace], check=False)
    etc = NETNS_ETC / namespace
    if etc.exists():
        shutil.rmtree(etc)


def remove_etc_root_if_empty(created: bool) -> None:
    """/etc/netns itself goes only if the lab created it and nothing else lives there."""
    if created and NETNS_ETC.exists() and not any(NETNS_ETC.iterdir()):
        NETNS_ETC.rmdir()


def spawn(
    namespace: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    mark: str | None = None,
) -> subprocess.Popen:
    """Start a long-running program inside the namespace, detached from our session, its
    output in `log`, under `mark` (kill_marked finds it even after the namespace is gone)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            marked_argv(mark, ["ip", "netns", "exec", namespace, *argv]),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )


def call_in(namespace: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `function` in a thread that has joined `namespace`; sockets it opens live there."""
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(NETNS_RUN / namespace, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise NetnsError(f"setns({namespace}): {os.strerror(errno)}")
            finally:
                os.close(fd)
            outcome["value"] = function(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=body, name=f"netns-{namespace}", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# ---------------------------------------------------------------- marks (cgroups)


def mark_dir(mark: str) -> Path:
    return CGROUP_PIDS / MARK_ROOT / mark


def mark_shell(mark: str) -> str:
    """Shell text that moves the current shell (and so what it execs) under `mark`."""
    path = mark_dir(mark)
    return f"mkdir -p {shlex.quote(str(path))} && echo $$ > {shlex.quote(str(path))}/cgroup.procs\n"


def marked_argv(mark: str | None, argv: Sequence[str]) -> list[str]:
    """`argv` run under the mark. Run on the host side: inside `ip netns exec` /sys is a fresh
    sysfs without the cgroup mounts, so the mark goes around `ip netns exec ...`."""
    if not mark or not CGROUP_PIDS.is_dir():
        return list(argv)
    return ["sh", "-c", mark_shell(mark) + 'exec "$@"', "marked", *argv]


def marked_pids(mark: str) -> list[int]:
    root = mark_dir(mark)
    found: list[int] = []
    if not root.is_dir():
        return found
    for procs in root.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            found += [int(line) for line in procs.read_text().split()]
    return found


def kill_marked(mark: str, *, timeout: float = 10.0) -> int:
    """SIGKILL every process under the mark (repeated: a dying parent may still fork), then
    remove the cgroups. Returns how many processes were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = marked_pids(mark)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.05)
    root = mark_dir(mark)
    if root.is_dir():
        # Deepest first: a cgroup with children cannot be removed.
        for path in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            root.rmdir()
    return len(killed)
