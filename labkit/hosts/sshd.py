"""The lab's SSH: every node runs OpenSSH's own sshd in its namespace, and every command the
program registered reaches it through the OpenSSH client, as the user the stack names.

What pulumi-command does on a real host, the lab does here (pulumi-command
provider/pkg/provider/remote/commandOutputs.go `run`): one SSH session per command, each key of
`environment` set with a `Setenv` request (refused unless sshd's `AcceptEnv` lists it, which
fails the command), then `session.Run(command)`: sshd hands the whole string to the user's
login shell as `$SHELL -c '<command>'`. The host key is checked against `connection.hostKey`
(connection.go: `ssh.FixedHostKey`), or not at all when the stack pins none.

The lab's departures, each for a reason:
- sshd's `SetEnv` gives a session the lab hooks (qwen_cluster/render/shell.py LAB_HOOKS), the
  shims first on PATH (labkit/engine/substitutions.py) and `DOCKER_HOST`, the node's own dockerd
  socket (labkit/hosts/dockerd.py): a namespace shares this machine's disk, so the scripts need them;
  a real host has none of them (its docker is at /var/run/docker.sock). The deploy user's
  sudoers entry keeps them (`env_keep`, no `secure_path`), as the same scripts run under
  `sudo -n`.
- The users are this machine's (one passwd for every namespace): `DEPLOY_USER` has passwordless
  sudo and is in group `docker`, as the bare-metal docs ask of a host; `PLAIN_USER` has neither.
"""

from __future__ import annotations

import fnmatch
import grp
import os
import pwd
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from labkit.hosts import netns
from qwen_cluster import sshhosts

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
# The guide's ordinary user: passwordless sudo, in group docker (what docs/baremetal.md asks).
DEPLOY_USER = "qcl-deploy"
# A user with neither: preflight must refuse it, naming bareMetal.sshUser.
PLAIN_USER = "qcl-plain"
DOCKER_GROUP = "docker"
USERS = (DEPLOY_USER, PLAIN_USER)
SUDOERS = Path("/etc/sudoers.d/qwen-cluster-lab")
# Debian's /etc/ssh/sshd_config: the variables a client may set. pulumi-command sets what a
# command's `environment` holds; anything else is refused, and the command fails.
ACCEPT_ENV = ("LANG", "LC_*")
# sshd's privilege-separation directory (Debian's ssh.service makes it: RuntimeDirectory=sshd).
PRIVSEP_DIR = Path("/run/sshd")


class SshError(RuntimeError):
    pass


def missing_requirements() -> list[str]:
    """Why the lab cannot reach its nodes over SSH here; empty when it can."""
    reasons = []
    for binary, package in (
        (SSHD, "openssh-server"),
        ("/usr/bin/ssh", "openssh-client"),
        ("/usr/bin/sudo", "sudo"),
    ):
        if not Path(binary).exists():
            reasons.append(f"{binary} is not installed (package {package}; make system installs it)")
    return reasons


# ---------------------------------------------------------------- users and sudo


def _ensure_group(name: str) -> None:
    try:
        grp.getgrnam(name)
    except KeyError:
        netns.run(["groupadd", "--system", name])


def _ensure_user(name: str, groups: tuple[str, ...]) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        netns.run(["useradd", "--create-home", "--shell", "/bin/bash", name])
    # No password, yet not locked: sshd (without PAM) refuses a locked account even for a key.
    netns.run(["usermod", "--password", "*", name])
    if groups:
        netns.run(["usermod", "--append", "--groups", ",".join(groups), name])


SUDOERS_TEXT = f"""# qwen-cluster lab: {DEPLOY_USER} has passwordless sudo, as bareMetal.sshUser needs.
# The lab hooks, the shims' PATH and the node's DOCKER_HOST reach the scripts under sudo too.
Defaults:{DEPLOY_USER} env_keep += "PATH QWEN_* QCL_LAB_* DOCKER_HOST"
Defaults:{DEPLOY_USER} !secure_path
{DEPLOY_USER} ALL=(ALL) NOPASSWD: ALL
"""


def ensure_users() -> None:
    """The lab's two users and the deploy user's sudo rule, on this machine (idempotent)."""
    _ensure_group(DOCKER_GROUP)
    _ensure_user(DEPLOY_USER, (DOCKER_GROUP,))
    _ensure_user(PLAIN_USER, ())
    if not SUDOERS.exists() or SUDOERS.read_text() != SUDOERS_TEXT:
        partial = SUDOERS.with_name(".qwen-cluster-lab.new")  # sudo skips names with a dot
        partial.write_text(SUDOERS_TEXT)
        partial.chmod(0o440)
        netns.run(["visudo", "-c", "-q", "-f", str(partial)])
        os.replace(partial, SUDOERS)


def remove_users() -> None:
    """Undo `ensure_users` (when the last lab goes)."""
    SUDOERS.unlink(missing_ok=True)
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        netns.run(["userdel", "--remove", name], check=False)


# ---------------------------------------------------------------- keys


@dataclass(frozen=True)
class Keys:
    """The lab's client key (the stack's sshPrivateKey) and one host key per node."""

    directory: Path

    @property
    def client(self) -> Path:
        return self.directory / "id_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.directory / "authorized_keys"

    def host_key(self, node: str) -> Path:
        return self.directory / node / "ssh_host_ed25519_key"

    def public_host_key(self, node: str) -> str:
        """`ssh-ed25519 AAAA...`, as bareMetal.hostKeys pins it (no comment)."""
        return " ".join(self.host_key(node).with_suffix(".pub").read_text().split()[:2])

    def private_key(self) -> str:
        return self.client.read_text()


def _keygen(path: Path, comment: str) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    netns.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


def ensure_keys(directory: Path, nodes: list[str]) -> Keys:
    """Generated once per lab and kept while it runs, so a host key stays what the stack pins."""
    keys = Keys(directory)
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)  # sshd's StrictModes: no group- or world-writable directory above a key
    _keygen(keys.client, "qwen-cluster-lab-deploy")
    authorized = keys.client.with_suffix(".pub").read_text()
    if not keys.authorized_keys.exists() or keys.authorized_keys.read_text() != authorized:
        keys.authorized_keys.write_text(authorized)
    keys.authorized_keys.chmod(0o644)
    for node in nodes:
        _keygen(keys.host_key(node), f"qwen-cluster-lab-{node}")
    return keys


# ---------------------------------------------------------------- sshd per node


def _setenv_value(value: str) -> str:
    if any(c in value for c in ' "\\\t\n'):
        raise SshError(f"sshd SetEnv cannot carry {value!r} (spaces, quotes)")
    return value


def sshd_config(
    *, ip: str, host_key: Path, pid_file: Path, authorized_keys: Path, env: dict[str, str]
) -> str:
    """One node's sshd_config: key logins only, Debian's AcceptEnv, the lab's session env."""
    setenv = " ".join(f"{key}={_setenv_value(value)}" for key, value in sorted(env.items()))
    return "\n".join(
        [
            f"ListenAddress {ip}:{SSH_PORT}",
            f"HostKey {host_key}",
            f"PidFile {pid_file}",
            f"AuthorizedKeysFile {authorized_keys}",
            "PermitRootLogin no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            f"AcceptEnv {' '.join(ACCEPT_ENV)}",
            # Many commands start at once (the executor's workers, and a whole wave of drains).
            "MaxStartups 64:30:128",
            f"SetEnv {setenv}",
            "",
        ]
    )


def start(namespace: str, node_dir: Path, config_text: str, *, mark: str | None = None) -> str:
    """Start (or restart, when its config changed) the node's sshd under `mark` (netns.kill_marked
    finds it without the namespace); returns what was done."""
    node_dir.mkdir(parents=True, exist_ok=True)
    config, pid_file, log = node_dir / "sshd_config", node_dir / "sshd.pid", node_dir / "sshd.log"
    running = _pid(pid_file, namespace)
    if running is not None and config.exists() and config.read_text() == config_text:
        return f"sshd running (pid {running})"
    if running is not None:
        os.kill(running, signal.SIGTERM)
        _wait_gone(running)
    config.write_text(config_text)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    netns.run(["ip", "netns", "exec", namespace, SSHD, "-t", "-f", str(config)])
    netns.run(
        netns.marked_argv(mark, ["ip", "netns", "exec", namespace, SSHD, "-f", str(config), "-E", str(log)])
    )
    # The daemon writes its pid file once it listens, just after its parent has exited.
    deadline = time.monotonic() + 10
    pid = _pid(pid_file, namespace)
    while pid is None and time.monotonic() < deadline:
        time.sleep(0.02)
        pid = _pid(pid_file, namespace)
    if pid is None:
        raise SshError(f"sshd in {namespace} did not start: {log.read_text()[-500:] if log.exists() else ''}")
    return f"sshd started (pid {pid})"


def _pid(pid_file: Path, namespace: str) -> int | None:
    try:
        pid = int(pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid in netns.pids(namespace) else None


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- the client

# The key exchanges pulumi-command's client offers that this OpenSSH client knows, in its order:
# golang.org/x/crypto/ssh (common.go, defaultKexAlgos) offers mlkem768x25519-sha256,
# curve25519-sha256, then ECDH and DH group 14; it has no sntrup761x25519, which OpenSSH 9.2
# offers first. Against OpenSSH 9.2's sshd (no ML-KEM), pulumi-command agrees curve25519-sha256;
# the lab's command connections do the same. It also costs the client a seventh of the CPU
# (0.017 s against 0.123 s a connection, measured here): the lab opens hundreds per up. The
# docker provider's connections stay with OpenSSH's own choice: its ssh is OpenSSH.
PULUMI_COMMAND_KEX = ",".join(
    (
        *("curve25519-sha256", "ecdh-sha2-nistp256", "ecdh-sha2-nistp384", "ecdh-sha2-nistp521"),
        "diffie-hellman-group14-sha256",
    )
)


def known_host_options(ip: str, host_key: str | None) -> list[str]:
    """`connection.hostKey` as OpenSSH checks it: pinned the way the program pins docker's ssh
    (a mismatch refuses the connection before any command), or, with none, accepted unverified
    (pulumi-command's InsecureIgnoreHostKey)."""
    if host_key is None:
        return ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    return ["-o", "UserKnownHostsFile=/dev/null", *sshhosts.known_host_options(ip, SSH_PORT, host_key)]


def refused_environment(environment: dict[str, str]) -> list[str]:
    """Keys sshd would refuse (pulumi-command then fails the command)."""
    return [
        key for key in environment if not any(fnmatch.fnmatchcase(key, pattern) for pattern in ACCEPT_ENV)
    ]


@dataclass(frozen=True)
class Client:
    """The deployer: the OpenSSH client, started in a lab namespace (the admin vantage, inside
    access.adminCidrs) with the stack's key."""

    namespace: str
    key: Path
    connect_timeout: float = 5.0

    def argv(
        self,
        *,
        user: str,
        ip: str,
        command: str,
        host_key: str | None,
        environment: dict[str, str] | None = None,
        verify: list[str] | None = None,
        kex: str | None = None,
    ) -> list[str]:
        """`verify`: ssh options that check the host key in place of `host_key` (pulumi-docker's
        `sshOpts`, which the program renders with the pinned key). They come first: for ssh the
        first value of an option wins. `kex`: the key exchanges offered (PULUMI_COMMAND_KEX for
        a command), OpenSSH's own when None."""
        argv = ["ip", "netns", "exec", self.namespace, "ssh", "-F", "none", "-T"]
        argv += verify if verify is not None else known_host_options(ip, host_key)
        argv += ["-o", f"KexAlgorithms={kex}"] if kex else []
        argv += ["-i", str(self.key), "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none"]
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout:g}"]
        argv += ["-o", "LogLevel=ERROR", "-p", str(SSH_PORT)]
        for key, value in (environment or {}).items():
            argv += ["-o", f"SetEnv={key}={value}"]
        # One string: sshd gives it to the login shell's -c, as session.Run does.
        return [*argv, f"{user}@{ip}", command]

    def run(self, *, timeout: float, stdin: str | None = None, **kwargs) -> subprocess.CompletedProcess:
        # No stdin given: the remote command reads end of file, never this process's stdin.
        feed = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
        return subprocess.run(
            self.argv(**kwargs),
            **feed,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
        )


def describe(done: subprocess.CompletedProcess) -> str:
    """ssh's own exit 255 is the connection (refused, host key, auth), not the command."""
    output = (done.stdout + done.stderr).strip()
    if done.returncode == 255:
        return f"ssh: connection failed (exit 255): {output[-1500:]}"
    return output
