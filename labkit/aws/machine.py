"""A lab namespace as an EC2 instance's operating system: what runs there runs as root, with
the node's own /etc, /opt, /var/cache and /run/lock and its own Docker engine, and first boot
runs the launch template's user data.

The program's node scripts write /etc/qwen-cluster, /etc/sysctl.d, /opt/qwen-cluster,
/var/cache/qwen-cluster (the weights) and /run/lock as any script on an instance does. Here each
node has one private mount namespace, its disk (held by a process, `holder`, under the lab's
cgroup mark; every run enters it with nsenter), in which /etc, /opt and /var/cache are overlays
whose upper layer is the node's lab directory (the host's files stay untouched, the node's own
persist from run to run), /run/lock is the node's, and `ip netns exec`'s /etc/netns/<ns>/ files
(the node's /etc/hosts) are bound again on top. So the scripts run unmodified.

Containers: the node's dockerd (labkit/hosts/dockerd.py, started by labkit/aws/nodes.py as the bare-metal
lab starts its own, `mount_pidfile` = this holder) runs in a copy of that disk, so `docker run
--volume=/var/cache/qwen-cluster/...` mounts the node's files, as on the instance. The scripts'
`docker` is the real CLI, reaching that daemon as DOCKER_HOST (on EC2: /var/run/docker.sock);
images come from the lab's registry as Docker Hub mirror (labkit/images/standins.py). What stays a
departure on PATH (the run's `bin_dir`): `sysctl --system` applies the program's drop-in only (a
namespace shares the machine's global keys), and systemctl/timedatectl (labkit/hosts/shims.py).

Cloud-init (https://cloudinit.readthedocs.io/en/latest/explanation/format.html): user data that
starts with `#!` is a script, run once per instance (its semaphore under
/var/lib/cloud/instances/<id>/sem) as root in the final stage; a failing script is logged and
cloud-init reports an error, and the instance runs on (SSM still reaches it). Gzip'd user data
is unpacked first. `#cloud-config` and the other formats are refused by the lab (the program
renders a script: qwen_cluster/render/cloudinit.py).
"""

from __future__ import annotations

import contextlib
import gzip
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.aws import ssmrun
from labkit.aws.model import Instance
from labkit.hosts import netns

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OVERLAID = ("/etc", "/opt", "/var/cache")  # qwen_cluster/hostpaths.py: config, state, weights


@dataclass(frozen=True)
class Machine:
    """One GPU node: its namespace and its lab directory."""

    instance: Instance
    namespace: str
    root: Path  # the node's lab directory
    bin_dir: Path  # the lab's shims for AWS nodes, first on PATH
    env: dict[str, str]  # what the lab adds to a run's environment (CA bundle, DOCKER_HOST)
    mark: str | None = None  # the holder's cgroup mark (netns.kill_marked: `down` finds it)

    def _mounts(self) -> str:
        lines = ["set -e"]
        for path in OVERLAID:
            upper, work = self.root / "fs" / path.strip("/"), self.root / "fs-work" / path.strip("/")
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            lines.append(
                f"mount -t overlay overlay -o lowerdir={path},upperdir={upper},workdir={work} {path}"
            )
        netns_etc = Path("/etc/netns") / self.namespace
        if netns_etc.is_dir():
            for entry in sorted(netns_etc.iterdir()):
                lines.append(f"mount --bind {shlex.quote(str(entry))} /etc/{shlex.quote(entry.name)}")
        lock = self.root / "run-lock"
        lock.mkdir(parents=True, exist_ok=True)
        lines.append(f"mount --bind {lock} /run/lock")
        lines.append("exec sleep infinity")
        return "\n".join(lines)

    def holder(self) -> int:
        """The node's mount namespace, held by one process: overlayfs refuses two mounts that
        share an upper directory, and runs overlap (the stack-wide staging and a node's own)."""
        pidfile = self.root / "holder.pid"
        with contextlib.suppress(FileNotFoundError, ValueError):
            pid = int(pidfile.read_text())
            if _holds(pid):
                return pid
        argv = ["ip", "netns", "exec", self.namespace, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", self._mounts()]  # fmt: skip
        process = subprocess.Popen(
            netns.marked_argv(self.mark, argv),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not _holds(process.pid):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.instance.node}: the node's mounts failed ({process.poll()})")
            time.sleep(0.02)
        pidfile.write_text(str(process.pid))
        return process.pid

    def execute(self, script_text: str, name: str, timeout: float) -> tuple[str, int, str]:
        """Run a script file as SSM and cloud-init do (`sh -c FILE`, its `#!` picks the shell)."""
        folder = self.root / "runs" / f"{time.time_ns()}-{name}"
        folder.mkdir(parents=True)
        script = folder / "_script.sh"
        # Written by a child (`tee`), never through a file descriptor of this process: nodes run
        # their scripts from parallel threads, and a fork of another thread inherits every open
        # descriptor until its exec; the `sh -c` of a script whose write descriptor such a child
        # still held failed with "Text file busy" (exit 126) in a CI run: a race of the lab's
        # threads, not the node's.
        subprocess.run(
            ["tee", str(script)], input=script_text, text=True, stdout=subprocess.DEVNULL, check=True
        )
        script.chmod(0o700)
        env = {"PATH": f"{self.bin_dir}:{BASE_PATH}", "HOME": "/root", "LANG": "C.UTF-8", **self.env}
        pid = self.holder()
        try:
            done = subprocess.run(
                ["nsenter", "--target", str(pid), "--mount", "--net", "sh", "-c", str(script)],
                capture_output=True, text=True, timeout=timeout, env=env, cwd=folder,
            )  # fmt: skip
        except subprocess.TimeoutExpired as expired:
            out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
            return ssmrun.TIMED_OUT, -1, out
        output = done.stdout + done.stderr
        (folder / "stdout").write_text(done.stdout)
        (folder / "stderr").write_text(done.stderr)
        return (ssmrun.SUCCESS if done.returncode == 0 else ssmrun.FAILED), done.returncode, output

    def run_steps(self, instance: Instance, planned: list[ssmrun.Step]) -> tuple[str, int, str]:
        """ssmrun.Runner: each step's runCommand lines as one `_script.sh`."""
        outputs = []
        for step in planned:
            status, code, output = self.execute("\n".join(step.lines) + "\n", step.name, step.timeout_seconds)
            outputs.append(output)
            if status != ssmrun.SUCCESS:
                return status, code, "".join(outputs)
        return ssmrun.SUCCESS, 0, "".join(outputs)

    def first_boot(self) -> tuple[str, int, str]:
        """The launch template's user data, once per instance id (cloud-init scripts-user)."""
        semaphore = (
            self.root
            / "var-lib-cloud"
            / "instances"
            / self.instance.instance_id
            / "sem"
            / "config_scripts_user"
        )
        if semaphore.exists():
            return ssmrun.SUCCESS, 0, "already ran for this instance (cloud-init per-instance)"
        text = user_data_script(self.instance.user_data)
        status, code, output = self.execute(text, "user-data", 3600)
        semaphore.parent.mkdir(parents=True, exist_ok=True)
        semaphore.write_text(f"{status} {code}\n")
        return status, code, output


def user_data_script(user_data: str | bytes) -> str:
    """The script cloud-init would run for this user data; other formats are refused."""
    raw = user_data.encode() if isinstance(user_data, str) else user_data
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    text = raw.decode()
    if text.startswith("#!"):
        return text
    first = text.splitlines()[0] if text else "(empty)"
    raise ssmrun.DocumentError(
        f"user data starting {first!r} is not a script; the lab runs `#!` user data only"
    )


def _holds(pid: int) -> bool:
    """`pid` is a node's holder: alive, with the node's /opt overlay mounted."""
    try:
        mounts = Path(f"/proc/{pid}/mounts").read_text()
    except OSError:
        return False
    return any(line.split()[1:3] == ["/opt", "overlay"] for line in mounts.splitlines())
