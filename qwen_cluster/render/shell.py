"""Shared pieces of the rendered bash scripts: the strict header and safe quoting.

Signatures:
    script(purpose: str, body: str) -> str      a complete bash script (set -euo pipefail)
    quote(value: object) -> str                 one shell word (shlex.quote of str(value))
    os_family_function() -> str                 bash function `os_family` printing debian|rhel
    interface_of_function() -> str              bash function `interface_of IP` printing its NIC
    sha256(text: str) -> str                    the hex digest components use as triggers
    state_dir_line(default: str) -> str          `state_dir=...`, overridable by QWEN_STATE_DIR
    persist_guard(body: str) -> str             `body` unless QWEN_PERSIST=no
    container_state_function() -> str           bash `container_state NAME`: running|stopped|absent

from qwen_cluster import hostpaths

LAB_HOOKS are the only run-time differences between a real host and the lab, which runs the
registered scripts unchanged inside network namespaces of one machine (scripts/lab.py). SSH
passes none of them (sshd accepts only the variables its AcceptEnv lists, and pulumi-command
sets none of ours), so on a host they are unset and the rendered defaults hold.
"""

from __future__ import annotations

import hashlib
import re
import shlex

from qwen_cluster import hostpaths
from qwen_cluster.node.nic import FINDER

LAB_HOOKS = {
    "QWEN_STATE_DIR": f"the state directory instead of {hostpaths.STATE_DIR} (one per lab node)",
    "QWEN_PERSIST": "`no` skips boot-time persistence (systemctl enable ...): no systemd for a namespace",
    "QWEN_SYSCTL_SCOPE": "`dropin` applies only our drop-in (sysctl -p), not every file (sysctl --system)",
}
# sshd runs a pulumi-command `create` as `$SHELL -c '<command>'`: the whole script is one
# argument, and Linux caps one argv or environment string at 32 pages (linux/binfmts.h
# MAX_ARG_STRLEN, NUL included). A longer script cannot start on a host.
MAX_ARG_STRLEN = 32 * 4096
_PLAIN_PATH = re.compile(r"^[A-Za-z0-9_./-]+$")

HEADER = "#!/usr/bin/env bash\n# Rendered by qwen-cluster: {purpose}\nset -euo pipefail\n"


def script(purpose: str, body: str) -> str:
    return HEADER.format(purpose=purpose) + body.strip("\n") + "\n"


def quote(value: object) -> str:
    return shlex.quote(str(value))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def state_dir_line(default: str) -> str:
    if not _PLAIN_PATH.match(default):
        raise ValueError(f"state directory {default!r}: letters, digits and _ . / - only")
    return f'state_dir="${{QWEN_STATE_DIR:-{default}}}"'


def persist_guard(body: str) -> str:
    """`body` (boot-time persistence) runs unless the lab says QWEN_PERSIST=no."""
    return f"""if [ "${{QWEN_PERSIST:-yes}}" != no ]; then
{body.strip(chr(10))}
fi"""


def os_family_function(os_release: str = "/etc/os-release") -> str:
    """A bash function that prints the OS family (debian or rhel) or fails naming the OS."""
    return f"""
os_family() {{
  local id="" id_like=""
  # shellcheck disable=SC1091
  id=$(. {quote(os_release)} && echo "${{ID:-}}")
  # shellcheck disable=SC1091
  id_like=$(. {quote(os_release)} && echo "${{ID_LIKE:-}}")
  case " $id $id_like " in
    *" debian "* | *" ubuntu "*) echo debian ;;
    *" rhel "* | *" fedora "* | *" centos "*) echo rhel ;;
    *) echo "unsupported OS: ID=$id ID_LIKE=$id_like (need a Debian or RHEL family)" >&2; return 1 ;;
  esac
}}
"""


# The rule every target uses to find the cluster interface, in one text: qwen_cluster/node/nic.py
# (the first interface in the kernel's address dump holding the node's IPv4 address, primary or
# secondary). Host scripts run it with python3, the model server's container and the monitoring
# endpoint run the same file; there is no second spelling to drift.
INTERFACE_OF = "interface_of"


def interface_of_function() -> str:
    """A bash function `interface_of IP` printing the interface that holds IPv4 address IP (the
    first one listed), or nothing when none does: nic.py's text, run by python3."""
    return f"""{INTERFACE_OF}() {{
  python3 - "$1" <<'QWEN_NIC_EOF'
{FINDER.rstrip()}
QWEN_NIC_EOF
}}"""


def container_state_function() -> str:
    """`container_state NAME` prints running, stopped or absent, and fails with docker's own
    words when docker cannot say (permission denied, no daemon): only a container that is truly
    absent or stopped is "not running", so no step acts on a guess."""
    return """
container_state() {
  local out
  if out=$(docker inspect -f '{{.State.Running}}' "$1" 2>&1); then
    if [ "$out" = true ]; then echo running; else echo stopped; fi
    return 0
  fi
  case "$out" in
    *"No such object"* | *"No such container"*) echo absent ;;
    *) echo "docker inspect $1 failed: $out" >&2; return 1 ;;
  esac
}
"""
