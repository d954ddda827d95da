"""One lab of the committed onprem stack (four nodes, the lab's default options), shared by the
modules that only read it or put back what they break: the `shared_onprem_lab` fixture in
tests/conftest.py, its modules in the "onprem-lab" group there (one worker, one after another).
Bringing a lab up takes 40-65 s on the 2-core machines; four modules, one up.

They run in tests/conftest.py's LONG_MODULES order: namespaces (reads the up, breaks and
restores), ssh (its last test rolls an image bump: later modules see every node on v0.33.1),
doctor and monitoring (faults injected and cleared; monitoring's last change is a new alert
bound). A module that changes the lab for good (an upgrade, nodes added) brings up its own."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from tooling import stackfile

LABEL = f"o{os.getpid() % 100000}"
MODULES = ("test_lab_namespaces", "test_lab_ssh", "test_lab_doctor", "test_lab_monitoring")


def host_snapshot() -> dict:
    """What the lab must never change on the host."""
    files = {}
    for root in ("/etc/ufw", "/etc/sysctl.d", "/etc/default/ufw", "/etc/nftables.conf", "/etc/sysctl.conf"):
        path = Path(root)
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                files[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    keys = sorted(stackfile.load("onprem").tuning.sysctl)
    sysctl = subprocess.run(["sysctl", *keys], capture_output=True, text=True).stdout
    ruleset = subprocess.run(["nft", "-s", "list", "ruleset"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {"files": files, "sysctl": sysctl, "nft": ruleset, "bridges": "br0" in links.split()}
