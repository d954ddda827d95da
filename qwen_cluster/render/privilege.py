"""Who runs a bare-metal command: the SSH user (`bareMetal.sshUser`), raised to root here and
nowhere else.

Every bare-metal step changes what only root may change (/etc/sysctl.d, apt/dnf, ufw, nft,
firewall-cmd, semanage, /etc/qwen-cluster, /var/lib/qwen-cluster, the docker daemon), so every
registered command runs its script as root: directly when the user is root, otherwise through
`sudo -n`, as Ansible's `become` does (no terminal, never a password prompt: a user without
passwordless sudo fails at once instead of hanging `pulumi up`). Files the scripts create are
therefore root's, with the modes the scripts set, whoever logs in.

sshd hands a command to the user's login shell (`$SHELL -c '<command>'`), which may be dash,
so the wrapper is POSIX sh and starts bash itself. The script travels once, in a quoted
here-document: no expansion, and the size stays within Linux's one-argument cap
(shell.MAX_ARG_STRLEN) as before.

Signatures:
    as_root(script: str, *, first_as_user: str = "") -> str
    user_checks(node: str, ip: str) -> str      what preflight checks as the SSH user itself
"""

from __future__ import annotations

from qwen_cluster.render.shell import quote

DELIMITER = "QWEN_CLUSTER_SCRIPT"
KEY = "bareMetal.sshUser"


class PrivilegeError(ValueError):
    pass


def as_root(script: str, *, first_as_user: str = "") -> str:
    """The command that runs `script` as root (bash), after `first_as_user` (POSIX sh) has
    run as the SSH user and succeeded."""
    # Lines are looked at only when the word is there at all: every script is wrapped, and a
    # verify script holds a line per probe.
    if DELIMITER in script and any(line.strip() == DELIMITER for line in script.splitlines()):
        raise PrivilegeError(f"a script may not contain a line {DELIMITER!r} (the wrapper's delimiter)")
    user_part = f"{first_as_user.strip(chr(10))}\n" if first_as_user else ""
    return f"""# qwen-cluster: runs as root, directly or through sudo -n ({KEY})
{user_part}qwen_script=$(cat <<'{DELIMITER}'
{script.rstrip(chr(10))}
{DELIMITER}
)
if [ "$(id -u)" -eq 0 ]; then exec /bin/bash -c "$qwen_script"; fi
exec sudo -n -- /bin/bash -c "$qwen_script"
"""


def user_checks(node: str, ip: str) -> str:
    """What only the SSH user can tell, checked as that user before anything runs as root:
    that it can become root without a password, and that the docker daemon answers it (the
    docker provider connects as this user over ssh and runs `docker system dial-stdio`).
    Every failure names the host, the key to change and the fix; nothing is changed."""
    where = f"preflight on {node} ({ip})"
    return f"""qwen_where={quote(where)}
qwen_user=$(id -un)
qwen_failed=0
if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
  echo "$qwen_where: FAILED: $qwen_user cannot run sudo without a password." \\
    "Set {KEY} to root or to a user with passwordless sudo" \\
    "(on the host: echo '$qwen_user ALL=(ALL) NOPASSWD: ALL' | sudo tee /etc/sudoers.d/$qwen_user)" >&2
  qwen_failed=1
fi
if ! command -v docker >/dev/null 2>&1; then
  echo "$qwen_where: FAILED: docker is not installed (the model server and nginx run as containers):" \\
    "install Docker Engine, then add $qwen_user to group docker" >&2
  qwen_failed=1
elif ! qwen_docker=$(docker version --format '{{{{.Server.Version}}}}' 2>&1); then
  echo "$qwen_where: FAILED: the docker daemon does not answer $qwen_user ($qwen_docker)." \\
    "The docker provider connects as {KEY}: add it to group docker" \\
    "(sudo usermod -aG docker $qwen_user) or set {KEY} to root, and check that dockerd runs" >&2
  qwen_failed=1
else
  echo "$qwen_where: $qwen_user reaches docker $qwen_docker"
fi
if [ "$qwen_failed" -ne 0 ]; then exit 1; fi"""
