import subprocess

from qwen_cluster.render import sysctl
from tests.helpers.baremetal import ONPREM, needs_netns, netns_pair, run_in, shellcheck

VALUES = {"net.core.rmem_max": 16777216, "net.ipv4.tcp_fastopen": 3, "net.core.wmem_max": 16777216}


def test_dropin_is_sorted_and_stable():
    text = sysctl.dropin(VALUES)
    assert text.splitlines()[1:] == [
        "net.core.rmem_max = 16777216",
        "net.core.wmem_max = 16777216",
        "net.ipv4.tcp_fastopen = 3",
    ]
    assert sysctl.dropin(dict(reversed(VALUES.items()))) == text


def test_apply_script_writes_one_dropin_and_never_appends_to_sysctl_conf():
    text = sysctl.apply_script(ONPREM.tuning.sysctl)
    assert sysctl.DROPIN_PATH in text
    assert "/etc/sysctl.conf" not in text
    assert ">>" not in text
    assert "apply=(sysctl -e --system)" in text and "${QWEN_SYSCTL_SCOPE:-system}" in text
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text


def test_apply_script_without_system_applies_only_the_dropin():
    text = sysctl.apply_script(VALUES, dropin_path="/tmp/x.conf", system=False)
    assert 'apply=(sysctl -e -p "$dropin")' in text and "${QWEN_SYSCTL_SCOPE:-dropin}" in text


@needs_netns
def test_the_hosts_script_applies_only_the_dropin_under_the_labs_hook(tmp_path):
    """The lab runs the registered (system-wide) script with QWEN_SYSCTL_SCOPE=dropin."""
    dropin = tmp_path / "90-qwen-cluster.conf"
    text = sysctl.apply_script(VALUES, dropin_path=str(dropin))
    (tmp_path / "s.sh").write_text(text)
    with netns_pair() as (ns, _):
        result = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "env",
                "QWEN_SYSCTL_SCOPE=dropin",
                "bash",
                "-x",
                str(tmp_path / "s.sh"),
            ],
            capture_output=True,
            text=True,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sysctl -e -p" in result.stderr and "--system" not in result.stderr  # bash -x trace


def test_scripts_are_shellcheck_clean(tmp_path):
    shellcheck(sysctl.apply_script(ONPREM.tuning.sysctl), tmp_path)
    shellcheck(sysctl.revert_script(), tmp_path)


@needs_netns
def test_in_a_namespace_global_keys_are_reported_exempt_and_the_rest_applied(tmp_path):
    dropin = tmp_path / "sysctl.d" / "90-qwen-cluster.conf"
    text = sysctl.apply_script(VALUES, dropin_path=str(dropin), system=False)
    with netns_pair() as (ns, _):
        first = run_in(ns, text, tmp_path)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "net.core.rmem_max namespace-exempt" in first.stdout
        assert "net.ipv4.tcp_fastopen = 3 ok" in first.stdout
        assert "wrote" in first.stdout
        again = run_in(ns, text, tmp_path)
        assert again.returncode == 0
        assert "is up to date" in again.stdout
    assert dropin.read_text() == sysctl.dropin(VALUES)


@needs_netns
def test_a_key_the_kernel_lacks_fails_the_read_back(tmp_path):
    text = sysctl.apply_script(
        {"net.ipv4.no_such_key_qwen": 1}, dropin_path=str(tmp_path / "x.conf"), system=False
    )
    with netns_pair() as (ns, _):
        result = run_in(ns, text, tmp_path)
    assert result.returncode == 1
    assert "net.ipv4.no_such_key_qwen" in result.stdout + result.stderr
