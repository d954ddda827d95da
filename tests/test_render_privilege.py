"""Bare-metal commands run their scripts as root, whoever logs in (qwen_cluster/render/privilege.py)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid

import pytest

from qwen_cluster.render import privilege
from tests.helpers.baremetal import ONPREM
from tests.helpers.secrets import plain
from tooling import offline

SCRIPT = """#!/usr/bin/env bash
set -euo pipefail
quoted='it'"'"'s $HOME, `not run`'
cat <<'INNER'
a here-document of its own: $PATH
INNER
echo "uid=$(id -u) bash=${BASH_VERSION:+yes} $quoted"
exit 7
"""


def run_as_login_shell(command: str, user: str | None = None) -> subprocess.CompletedProcess:
    """As sshd does: the user's login shell with `-c '<command>'` (dash: POSIX sh only)."""
    argv = ["dash", "-c", command]
    if user is not None:
        entry = pwd.getpwnam(user)
        ids = [f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"]
        argv = ["setpriv", *ids, "--", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd="/")


@pytest.mark.skipif(shutil.which("dash") is None, reason="needs dash (a POSIX login shell)")
def test_root_runs_the_script_in_bash_unchanged_with_its_exit_status():
    if os.geteuid() != 0:
        pytest.skip("runs as root")
    done = run_as_login_shell(privilege.as_root(SCRIPT))
    assert done.returncode == 7
    assert done.stdout == ("a here-document of its own: $PATH\nuid=0 bash=yes it's $HOME, `not run`\n")


def test_the_wrapper_is_posix_sh_and_shellcheck_clean(tmp_path):
    path = tmp_path / "wrapped.sh"
    path.write_text(privilege.as_root(SCRIPT, first_as_user=privilege.user_checks("master", "192.168.1.100")))
    done = subprocess.run(["shellcheck", "-s", "sh", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_a_script_holding_the_delimiter_line_is_refused():
    with pytest.raises(privilege.PrivilegeError, match="QWEN_CLUSTER_SCRIPT"):
        privilege.as_root(f"echo a\n{privilege.DELIMITER}\necho b\n")


def test_a_user_without_sudo_is_told_which_key_to_change_and_nothing_runs(tmp_path):
    """`nobody` has no sudo rule: the user checks name the host and bareMetal.sshUser, and the
    root part never starts (its marker file is not written)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switching to another user needs root and setpriv")
    nobody = "nobody"
    marker = tmp_path / f"ran-{uuid.uuid4().hex[:6]}"
    tmp_path.chmod(0o777)
    command = privilege.as_root(
        f"touch {marker}\n", first_as_user=privilege.user_checks("worker-1", "192.168.1.101")
    )
    done = run_as_login_shell(command, user=nobody)
    assert done.returncode == 1
    assert "preflight on worker-1 (192.168.1.101): FAILED: nobody cannot run sudo without a password" in (
        done.stderr
    )
    assert "Set bareMetal.sshUser to root or to a user with passwordless sudo" in done.stderr
    assert not marker.exists()


def test_every_bare_metal_command_runs_its_scripts_as_root():
    rendered = offline.render_stack("onprem")
    commands = rendered.of_type("command:remote:Command")
    kinds = {command.name.rsplit("-", 1)[-1] for command in commands}
    assert {"preflight", "sysctl", "firewall", "drain", "ready", "verify", "config"} <= kinds
    assert len({command.name for command in commands if command.name.endswith("-preflight")}) == len(
        ONPREM.nodes
    )
    for command in commands:
        for key in ("create", "update", "delete"):
            text = plain(command.inputs.get(key))  # monitoring-config's is a secret
            if text:
                assert text.startswith("# qwen-cluster: runs as root"), (command.name, key)
                assert 'exec sudo -n -- /bin/bash -c "$qwen_script"' in text, (command.name, key)


def test_preflight_checks_the_user_before_anything_runs_as_root():
    create = offline.render_stack("onprem").named("worker-2-preflight").inputs["create"]
    user_part, _, root_part = create.partition("qwen_script=$(cat <<")
    assert "sudo -n true" in user_part and "docker version" in user_part
    assert "preflight on worker-2 (192.168.1.102)" in user_part
    assert "os_family" in root_part and "os_family" not in user_part
