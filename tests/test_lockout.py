"""No lock-out: each host stops before its firewall changes unless the address the deploy's SSH
arrives from stays admitted (qwen_cluster/render/firewall.py deployer_check), and preview says
so where it can (lockout_notices, scripts/plan.py --deploy-from). The lab rehearsal is
tests/test_lab_lockout.py."""

from __future__ import annotations

import subprocess

import pytest

from components.baremetal import host
from qwen_cluster.render import firewall
from tests.helpers.baremetal import shellcheck
from tooling import preview, stackfile


@pytest.fixture(scope="module")
def onprem():
    return stackfile.load("onprem")


def run_check(text: str, ssh_connection: str | None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if ssh_connection is not None:
        env["SSH_CONNECTION"] = ssh_connection
    return subprocess.run(["sh", "-c", text], env=env, capture_output=True, text=True, timeout=30)


def check_for(cluster, node: str = "worker-1") -> str:
    return firewall.deployer_check(cluster, node, firewall.ssh_sources(firewall.host_rules(cluster, node)))


def test_a_deploy_from_outside_admin_cidrs_stops_naming_the_key_and_the_address(onprem):
    done = run_check(check_for(onprem), "198.51.100.7 50022 192.168.1.101 22")
    assert done.returncode == 1
    assert (
        "firewall on worker-1 (192.168.1.101): FAILED: this deploy connects from 198.51.100.7, which "
        "access.adminCidrs (203.0.113.10/32) does not admit to SSH" in done.stderr
    )
    assert "Nothing was changed." in done.stderr


@pytest.mark.parametrize(
    "client",
    ["203.0.113.10", "192.168.1.100", "192.168.1.103"],
    ids=["from adminCidrs", "from the master", "from another node"],
)
def test_a_deploy_from_an_admitted_address_passes(onprem, client):
    done = run_check(check_for(onprem), f"{client} 50022 192.168.1.101 22")
    assert done.returncode == 0, done.stderr
    assert f"the deploy connects from {client}, which the new rules admit to SSH" in done.stdout


def test_a_cidr_admits_every_address_inside_it_and_none_outside(onprem):
    cluster = onprem.model_copy(
        update={
            "access": onprem.access.model_copy(update={"admin_cidrs": ["10.20.0.0/14", "2001:db8:1::/48"]})
        }
    )
    text = check_for(cluster)
    inside = ["10.20.0.1", "10.23.255.254", "2001:db8:1::5"]
    outside = ["10.24.0.1", "10.19.255.255", "2001:db8:2::5", "9.20.0.1"]
    for client in inside:
        assert run_check(text, f"{client} 1 192.168.1.101 22").returncode == 0, client
    for client in outside:
        assert run_check(text, f"{client} 1 192.168.1.101 22").returncode == 1, client


def test_without_ssh_connection_it_says_it_did_not_check(onprem):
    done = run_check(check_for(onprem), None)
    assert done.returncode == 0
    assert "SSH_CONNECTION is not set" in done.stderr


def test_the_check_is_posix_sh(onprem, tmp_path):
    shellcheck("#!/bin/sh\n" + check_for(onprem), tmp_path)


def test_preflight_and_the_firewall_step_check_before_they_change_anything(onprem):
    steps = {step.name: step for step in host.steps_for(onprem, onprem.nodes[1])}
    assert "preflight on worker-1 (192.168.1.101)" in steps["preflight"].first_as_user
    assert "firewall on worker-1 (192.168.1.101)" in steps["firewall"].first_as_user
    assert "SSH_CONNECTION" in steps["preflight"].first_as_user


def test_preflight_admits_the_segment_so_a_joining_node_does_not_rerun_it(onprem):
    assert firewall.preflight_sources(onprem) == ["203.0.113.10/32", "192.168.1.0/24"]


def test_preview_says_a_documentation_range_may_stop_the_deploy(onprem):
    notices = firewall.lockout_notices(onprem)
    assert [n.certain for n in notices] == [False]
    assert "access.adminCidrs (203.0.113.10/32) holds only documentation addresses" in notices[0].message


def test_preview_says_a_deployer_outside_admin_cidrs_will_be_stopped(onprem):
    (notice,) = firewall.lockout_notices(onprem, "10.9.9.9")
    assert notice.certain
    assert notice.message.startswith(
        "the deploying machine 10.9.9.9 is not in access.adminCidrs (203.0.113.10/32)"
    )
    assert firewall.lockout_notices(onprem, "203.0.113.10") == []


def test_preview_checks_a_bastion_given_by_address(onprem):
    target = type(onprem.bare_metal).model_validate(
        {**onprem.bare_metal.model_dump(by_alias=True), "bastion": {"host": "192.0.2.50"}}
    )
    cluster = onprem.model_copy(update={"bare_metal": target})
    (notice,) = firewall.lockout_notices(cluster, "203.0.113.10")  # the bastion connects, not you
    assert notice.certain and notice.message.startswith("bareMetal.bastion.host 192.0.2.50 is not in")


def test_plan_fails_a_deploy_the_hosts_would_stop(capsys):
    assert preview.main(["onprem", "--deploy-from", "10.9.9.9"]) == 1
    out = capsys.readouterr().out
    assert "deploy will stop: the deploying machine 10.9.9.9 is not in access.adminCidrs" in out
    assert preview.main(["onprem", "--deploy-from", "203.0.113.10"]) == 0
    assert preview.main(["onprem", "--deploy-from", "not-an-address"]) == 2


def test_aws_stacks_have_no_host_firewall_to_lock():
    assert firewall.lockout_notices(stackfile.load("dev"), "10.9.9.9") == []
