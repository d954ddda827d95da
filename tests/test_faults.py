"""The container faults of labkit/cluster/faults.py on the program's own model-server spec (no lab):
each change touches what its check reads and nothing another fault's check reads, so that all of
them in one container are still each named by their own check (tests/test_lab_doctor.py)."""

from __future__ import annotations

import copy

from components.baremetal import serving
from labkit.cluster import blueprint, faults
from labkit.cluster.blueprint import Member
from qwen_cluster.render import collective
from tooling import stackfile

ONPREM = stackfile.load("onprem")
NODE = next(node for node in ONPREM.nodes if node.name == "worker-2")


def _body() -> dict:
    """The create body docker inspect gives back for the program's container (Config + HostConfig)."""
    spec = serving.model_container_spec(ONPREM, NODE)
    return {
        "Image": spec["image"],
        "Entrypoint": spec["entrypoints"],
        "Cmd": spec["command"],
        "Env": spec["envs"],
        "HostConfig": {"IpcMode": spec["ipc_mode"], "NetworkMode": "host", "ShmSize": 67108864},
    }


def _member() -> Member:
    return blueprint.build(ONPREM, "t").node(NODE.name)  # the plan only: nothing is made


def _env(body: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in body["Env"])


def test_each_change_touches_only_what_its_check_reads():
    for fault in faults.CONTAINER_FAULTS:
        before = _body()
        after = copy.deepcopy(before)
        fault.change(after, _member())
        changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
        assert changed, fault.name
        script, env = after["Cmd"][0], _env(after)
        if fault.check == "node-address":
            assert env["VLLM_HOST_IP"] == "127.0.0.1" and changed == {"Env"}
        elif fault.check == "transport-pin":
            assert "NCCL_NET" not in env and changed == {"Env"}
        elif fault.check == "interface-env":
            assert collective.interface_prelude() not in script
            assert not {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} & set(env)
        elif fault.check == "shm":
            assert after["HostConfig"]["IpcMode"] == "private"
        elif fault.check == "model-path":
            assert f"vllm serve {faults.OTHER_MODEL} " in script and changed == {"Cmd"}
        elif fault.check == "image":
            assert after["Image"] == "vllm/vllm-openai:v0.33.0-other" and changed == {"Image"}
        elif fault.check == "memlock":
            assert after["HostConfig"]["Ulimits"] == [
                {"Name": "memlock", "Soft": faults.SMALL_MEMLOCK, "Hard": faults.SMALL_MEMLOCK}
            ]
        elif fault.check == "transport":
            assert script.startswith("echo ") and "NCCL INFO Using network Socket" in script
        else:
            raise AssertionError(f"no test for {fault.check}")


def test_all_changes_apply_together_and_the_server_still_serves():
    body = _body()
    for fault in faults.CONTAINER_FAULTS:
        fault.change(body, _member())
    assert body["Cmd"][0].rstrip().splitlines()[-1].startswith(f"exec vllm serve {faults.OTHER_MODEL} ")
