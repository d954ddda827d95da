"""The node checks of `verify` and `doctor` (qwen_cluster/render/nodecheck.py) on recorded inputs:
the rendered script runs against a `docker` that answers as a daemon would for a container with
the fault (inspect templates, exec, logs: tests/data/doctor/), and doctor's comparisons across a
replica run on the facts nodes report. Causes the lab cannot produce (EFA, RDMA, NCCL's errors,
image skew across a replica's members) are rehearsed only here; the container-level ones it can
produce are rehearsed on its real dockerd too (tests/test_lab_doctor.py).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_cluster.render import collective, nodecheck, verify
from tooling import doctor, stackfile

ONPREM = stackfile.load("onprem")  # tuning.rdma: NCCL_NET=IB, memlock and devices checked
DATA = Path(__file__).parent / "data" / "doctor"
NODE, NODE_IP = "worker-1", "192.168.1.101"
CONTAINER = nodecheck.container_name(ONPREM, NODE)

# A docker CLI for one container: `inspect -f TEMPLATE` answers from the spec's table, `exec` runs
# the spec's answer for the command, `logs` prints the spec's log file.
STUB_DOCKER = """#!/usr/bin/env python3
import json, os, sys
spec = json.load(open(os.environ["DOCKER_STUB"]))
args = sys.argv[1:]
if args[0] == "inspect":
    template = args[args.index("-f") + 1]
    if template not in spec["inspect"]:
        sys.exit("stub docker: no answer for " + template)
    print(spec["inspect"][template])
elif args[0] == "exec":
    command = " ".join(args[2:])
    if command not in spec["exec"]:
        sys.exit(126)
    sys.stdout.write(spec["exec"][command])
elif args[0] == "logs":
    sys.stdout.write(open(spec["logs"]).read() if spec.get("logs") else "")
else:
    sys.exit(125)
"""


def healthy_spec() -> dict:
    """A model server the program rendered, as docker 20.10 reports it."""
    env = {
        "VLLM_HOST_IP": NODE_IP,
        "NCCL_SOCKET_IFNAME": "=eth1",
        "GLOO_SOCKET_IFNAME": "eth1",
        **collective.environment(ONPREM),
    }
    environ = "".join(f"{key}={value}\0" for key, value in env.items())
    return {
        "inspect": {
            "{{.State.Running}}": "true",
            "{{.HostConfig.NetworkMode}}": "host",
            "{{.Config.Image}} {{.Image}}": f"{ONPREM.model.image} sha256:1111",
            "{{range .Config.Env}}{{println .}}{{end}}": "\n".join(f"{k}={v}" for k, v in env.items()),
            '{{join .Config.Cmd " "}}': "exec vllm serve Qwen/Qwen3-32B --host=192.168.1.101",
            "{{.HostConfig.IpcMode}}": "host",
            "{{.HostConfig.ShmSize}}": "67108864",
            nodecheck.MEMLOCK_FORMAT: "-1",
            nodecheck.DEVICES_FORMAT: "/dev/infiniband ",
        },
        "exec": {
            "cat /proc/1/environ": environ,
            "df -Pk /dev/shm": "Filesystem 1024-blocks Used Available Capacity Mounted on\n"
            "shm 65929216 0 65929216 0% /dev/shm\n",
            "sh -c ulimit -l": "unlimited\n",
            "ls /dev/infiniband": "rdma_cm\nuverbs0\n",
        },
        "logs": str(DATA / "ib-transport.log"),
    }


def run_checks(tmp_path: Path, spec: dict) -> tuple[int, list[tuple[str, str]]]:
    """The node's verify script with the stub docker (and the node's name resolving to its
    address); the (check, detail) of each finding about the model server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tools = {
        "docker": STUB_DOCKER.replace("/usr/bin/env python3", sys.executable, 1),
        "hostname": f"#!/bin/sh\necho {NODE}\n",
        "getent": f"#!/bin/sh\necho '{NODE_IP}       STREAM {NODE}'\n",
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    script = tmp_path / "verify.sh"
    script.write_text(verify.for_cluster(ONPREM, NODE))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DOCKER_STUB": str(tmp_path / "spec.json"),
    }
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=120)
    found = []
    for line in done.stdout.splitlines():
        parts = line.split("|", 5)
        # This host holds no lab address: the probe rows do not run and no interface holds the
        # node address; what is checked here is the model server.
        if parts[:2] == ["qwen", "finding"] and parts[2] != "interface":
            found.append((parts[2], parts[5]))
    return done.returncode, found


def with_env(spec: dict, **changes: str | None) -> dict:
    environ = dict(item.split("=", 1) for item in spec["exec"]["cat /proc/1/environ"].split("\0") if item)
    for key, value in changes.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    spec["exec"]["cat /proc/1/environ"] = "".join(f"{k}={v}\0" for k, v in environ.items())
    return spec


def test_the_rendered_model_server_passes_every_check(tmp_path):
    _, found = run_checks(tmp_path, healthy_spec())
    assert found == []


def _shm_64m(spec: dict) -> dict:
    spec["inspect"]["{{.HostConfig.IpcMode}}"] = "private"
    spec["exec"]["df -Pk /dev/shm"] = (
        "Filesystem 1024-blocks Used Available Capacity Mounted on\nshm 65536 0 65536 0% /dev/shm\n"
    )
    return spec


def _memlock_64k(spec: dict) -> dict:
    spec["exec"]["sh -c ulimit -l"] = "64\n"
    return spec


def _no_devices(spec: dict) -> dict:
    del spec["exec"]["ls /dev/infiniband"]
    spec["inspect"][nodecheck.DEVICES_FORMAT] = ""
    return spec


def _other_image(spec: dict) -> dict:
    spec["inspect"]["{{.Config.Image}} {{.Image}}"] = "vllm/vllm-openai:v0.32.0 sha256:2222"
    return spec


def _log(name: str):
    def change(spec: dict) -> dict:
        spec["logs"] = str(DATA / name)
        return spec

    return change


CASES = {
    # cause 1 / 9: an interface variable missing on this member
    "GLOO_SOCKET_IFNAME unset": (lambda s: with_env(s, GLOO_SOCKET_IFNAME=None), "interface-env"),
    # cause 2: vLLM's address is not the node's
    "VLLM_HOST_IP another address": (lambda s: with_env(s, VLLM_HOST_IP="10.0.0.9"), "node-address"),
    # cause 3: no pin, a fallback would be silent; and the fallback itself in the log
    "NCCL_NET unset": (lambda s: with_env(s, NCCL_NET=None), "transport-pin"),
    "NET/Socket in the log": (_log("socket-fallback.log"), "transport"),
    # cause 4: no RDMA devices in the container; aws-ofi-nccl's fi_getinfo failure
    "no /dev/infiniband": (_no_devices, "efa-devices"),
    "fi_getinfo() failed in the log": (_log("efa-fi-getinfo.log"), "efa-devices"),
    # cause 5: memlock
    "memlock 64 KiB": (_memlock_64k, "memlock"),
    "ibv_reg_mr in the log": (_log("memlock.log"), "memlock"),
    # cause 10: this member on another tag than model.image
    "another image tag": (_other_image, "image"),
    # cause 6: docker's 64 MB /dev/shm
    "ipc private, 64 MiB /dev/shm": (_shm_64m, "shm"),
    "shm segment error in the log": (_log("shm.log"), "shm"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_of_the_model_server_is_named_with_its_check(tmp_path, case):
    change, check = CASES[case]
    code, found = run_checks(tmp_path, change(healthy_spec()))
    assert code == 1
    assert {name for name, _ in found} == {check}, found


def test_what_docker_cannot_tell_is_a_finding_never_a_silent_pass(tmp_path):
    """A docker that answers only State.Running: each check that could not run is named (the
    environment, /dev/shm, memlock, the devices), nothing is guessed and nothing passes."""
    spec = {"inspect": {"{{.State.Running}}": "true"}, "exec": {}, "logs": ""}
    code, found = run_checks(tmp_path, spec)
    assert code == 1
    assert {name for name, _ in found} == {"container"}, found
    details = " ".join(detail for _, detail in found)
    for what in ("image", "environment", "/dev/shm", "memlock", "/dev/infiniband"):
        assert what in details, found


def test_a_model_server_that_is_not_running_is_a_finding(tmp_path):
    spec = {
        "inspect": {
            "{{.State.Running}}": "false",
            "{{.State.Status}} (exit {{.State.ExitCode}})": "exited (exit 1)",
        },
        "exec": {},
        "logs": "",
    }
    code, found = run_checks(tmp_path, spec)
    assert code == 1
    assert found == [("container", f"{CONTAINER} is not running here: exited (exit 1) (docker inspect)")]


# ---------------------------------------------------------------- across the replica


def fake_runner(outputs: dict[str, str]):
    return lambda node, script: (0, outputs.get(node, ""))


def test_a_member_on_another_image_is_named_with_the_head():
    """Cause 10: a worker on another image tag. A pipeline replica: master heads worker-1."""
    raw = ONPREM.model_dump(by_alias=True, mode="json", exclude_none=True)
    raw["model"]["pipelineParallel"] = 2
    cluster = type(ONPREM).model_validate(raw)
    assert [m.name for m in cluster.topology.replica_of("worker-1").members] == ["master", "worker-1"]
    image = cluster.model.image
    facts = {
        "master": f"qwen|fact|image|master|{image} sha256:aaa",
        "worker-1": f"qwen|fact|image|worker-1|{image.rsplit(':', 1)[0]}:v0.32.0 sha256:bbb",
        "worker-2": f"qwen|fact|image|worker-2|{image} sha256:aaa",
        "worker-3": f"qwen|fact|image|worker-3|{image} sha256:aaa",
    }
    found, _ = doctor.host_findings(cluster, fake_runner(facts))
    assert [(f.check, f.where) for f in found] == [("image-skew", ["worker-1", "master"])]
    assert "Version mismatch" in found[0].cause


def test_one_member_with_a_smaller_mtu_is_named():
    outputs = {name: f"qwen|fact|mtu|{name}|9000" for name in ("master", "worker-1", "worker-3")}
    outputs["worker-2"] = "qwen|fact|mtu|worker-2|1500"
    found, _ = doctor.host_findings(ONPREM, fake_runner(outputs))
    assert [(f.check, f.where, f.step) for f in found] == [
        ("mtu-skew", ["worker-2", "master"], "connectivity")
    ]


def test_a_host_on_the_segment_that_is_not_a_member_is_named_with_its_fix():
    """The nodes trust members by source address: a non-member on network.cidr (the lab's
    intruder at 192.168.1.254) is named from the neighbour tables. Members, the segment's
    router and addresses off the segment are not."""
    outputs = {
        "master": "qwen|fact|neighbours|master|192.168.1.101 192.168.1.254 10.9.0.1\n"
        "qwen|fact|gateway|master|192.168.1.1",
        "worker-1": "qwen|fact|neighbours|worker-1|192.168.1.100 192.168.1.1 192.168.1.254",
        "worker-2": "qwen|fact|neighbours|worker-2|192.168.1.100",
    }
    found, _ = doctor.host_findings(ONPREM, fake_runner(outputs))
    assert [(f.check, f.where, f.severity) for f in found] == [
        ("foreign-host", ["master", "worker-1"], "warning"),
    ]
    (finding,) = found
    assert finding.what.startswith("192.168.1.254 is on network.cidr 192.168.1.0/24 and is not a member")
    assert "dedicated segment or VLAN" in finding.fix and "security.md" in finding.cause


def test_a_quiet_segment_has_no_foreign_host_finding():
    members = "192.168.1.100 192.168.1.101"
    outputs = {name: f"qwen|fact|neighbours|{name}|{members}" for name in ("master", "worker-1")}
    found, _ = doctor.host_findings(ONPREM, fake_runner(outputs))
    assert found == []


def test_findings_come_in_the_guides_order_and_as_json():
    outputs = {
        "master": "qwen|finding|bandwidth|master|worker-1|iperf3 (4 streams): 3.10 Gbit/s is below 10\n"
        "qwen|finding|latency|master|worker-1|ping: median RTT 2.1 ms is above maxLatencyMs 1\n"
        "qwen|finding|dynamic-port|master|worker-1|dynamic 32768/tcp: expected reachable, got filtered",
    }
    found, _ = doctor.host_findings(ONPREM, fake_runner(outputs))
    assert [f.step for f in found] == ["connectivity", "latency", "bandwidth"]
    document = found[0].as_json()
    assert document["check"] == "dynamic-port" and document["where"] == ["master", "worker-1"]
    assert "worker-1" in document["fix"] and "client socket has timed out" in document["cause"]


def test_a_node_doctor_cannot_reach_is_a_finding():
    found, _ = doctor.host_findings(ONPREM, lambda node, script: (255, "ssh: connect: timed out"))
    assert {f.check for f in found} == {"host"} and len(found) == 4


def test_over_ssh_each_node_runs_its_own_script_with_sudo(tmp_path, monkeypatch):
    """The bare-metal runner: `ssh user@node <command>` with the script on stdin, run by sudo. A
    fake ssh runs the command here (this host holds none of the nodes' addresses, so each node's
    script says no interface holds its address) and records who it was asked to reach."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "ssh").write_text(f'#!/bin/bash\necho "${{@: -2:1}}" >>{calls}\nexec bash -c "${{@: -1}}"\n')
    (bin_dir / "sudo").write_text('#!/bin/sh\nshift\nexec "$@"\n')
    for tool in ("ssh", "sudo"):
        (bin_dir / tool).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    found, _ = doctor.host_findings(ONPREM, doctor.ssh_runner(ONPREM), connect_timeout=1)
    user = ONPREM.bare_metal.ssh_user
    assert sorted(calls.read_text().split()) == sorted(f"{user}@{node.ip}" for node in ONPREM.nodes)
    interface = [f for f in found if f.check == "interface"]
    assert sorted(f.where[0] for f in interface) == sorted(node.name for node in ONPREM.nodes)
