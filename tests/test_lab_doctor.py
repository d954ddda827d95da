"""`doctor` rehearsed against the failures of issue 26's table the lab can produce: each injected
on one node (labkit/faults.py), named with that node and its cause within a minute, and gone
again once the fault is removed. One lab for the module (label d<pid>), every fault undone.

The container-level faults (no --ipc=host, a small memlock, another image tag, an interface
variable missing, NCCL's socket fallback in the log) need `docker inspect/exec/logs` of a real
daemon; the lab's docker stand-in does not model them yet, so they are rehearsed on recorded
inputs in tests/test_doctor_checks.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import blueprint, faults, lifecycle
from labkit import doctor as labdoctor
from tests.test_lab_namespaces import MISSING
from tooling import doctor, stackfile

pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")
ROOT = Path(__file__).resolve().parents[1]
LABEL = f"d{os.getpid() % 100000}"
WITHIN = 60  # the issue: a fault is named within a minute
FAULTY = "worker-2"


@pytest.fixture(scope="module")
def lab():
    lifecycle.down(LABEL)
    lab_plan = blueprint.build(stackfile.load("onprem"), LABEL)
    try:
        report = lifecycle.up(lab_plan, lifecycle.Options())
        assert report.ok, [step for step in report.steps if not step.ok]
        yield lab_plan
    finally:
        lifecycle.down(LABEL)


def _from_hosts(lab_plan) -> list[doctor.Finding]:
    run, cluster = labdoctor.lab_runner("onprem", lab_plan.label)
    found, _ = doctor.host_findings(cluster, run, connect_timeout=1)
    return found


def _until(what: str, condition, timeout: float = WITHIN):
    """Ask again (each ask is a whole doctor run) until `condition` holds; the seconds it took."""
    started = time.monotonic()
    last = None
    while time.monotonic() - started < timeout:
        last = condition()
        if last:
            return time.monotonic() - started, last
    pytest.fail(f"{what}: not within {timeout} s (last: {last!r})")


def test_a_clean_lab_has_no_finding_from_its_hosts(lab):
    assert [finding.what for finding in _from_hosts(lab)] == []


@pytest.mark.parametrize("fault", faults.FAULTS, ids=[fault.check for fault in faults.FAULTS])
def test_doctor_names_the_fault_and_its_node_within_a_minute_and_clears(lab, fault):
    member = lab.node(FAULTY)
    fault.inject(lab, member)
    try:

        def named():
            found = _from_hosts(lab)
            return [f for f in found if f.check == fault.check and FAULTY in f.where] and found

        took, found = _until(f"{fault.name} on {FAULTY}", named)
        print(f"\n{fault.name}: named in {took:.1f} s: {[f.what for f in found]}")
        # Every finding names the faulty node: no other node is blamed.
        assert all(FAULTY in finding.where for finding in found), [f.what for f in found]
        assert all(finding.cause and finding.fix for finding in found)
    finally:
        fault.remove(lab, member)
    cleared, _ = _until(f"{fault.name} removed", lambda: _from_hosts(lab) == [] or None)
    print(f"{fault.name}: clean again in {cleared:.1f} s")


def test_the_cli_names_the_fault_and_its_node_in_json_in_the_guides_order(lab):
    member = lab.node(FAULTY)
    faults.hostname_to_loopback(lab, member)
    faults.lower_mtu(lab, member)
    try:
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "doctor.py"),
                "onprem",
                "--lab",
                "--label",
                LABEL,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=WITHIN,
        )
        took = time.monotonic() - started
    finally:
        faults.restore_mtu(lab, member)
        faults.hostname_restored(lab, member)
    document = json.loads(done.stdout)
    assert done.returncode in (1, 2), done.stderr  # 2 only when the lab's Prometheus cannot be asked
    assert document["healthy"] is False
    checks = {(f["check"], tuple(f["where"])) for f in document["findings"]}
    assert ("hostname", (FAULTY,)) in checks
    assert any(check == "mtu" and FAULTY in where for check, where in checks)
    steps = [doctor.STEPS.index(f["step"]) for f in document["findings"]]
    assert steps == sorted(steps)
    print(f"\nscripts/doctor.py onprem --lab --json: {took:.1f} s, {len(document['findings'])} findings")
