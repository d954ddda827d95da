"""The rendered model server prevents what docs/monitoring.md's table of the ten failures says it
prevents, on both targets: one test per row (rows 7 and 8 are prevented by the host's MTU and
firewall and detected by verify and doctor: their tests are named in the table)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from components.baremetal import serving
from qwen_cluster.render import cloudinit, collective, preflight, ssm, verify
from tooling import stackfile

ONPREM = stackfile.load("onprem")  # bare metal, tuning.rdma true
DEV = stackfile.load("dev")  # AWS with EFA


def with_model(cluster, **changes):
    raw = cluster.model_dump(by_alias=True, mode="json", exclude_none=True)
    raw["model"].update(changes)
    return type(cluster).model_validate(raw)


def with_section(cluster, section: str, **changes):
    raw = cluster.model_dump(by_alias=True, mode="json", exclude_none=True)
    raw[section].update(changes)
    return type(cluster).model_validate(raw)


PIPELINE = with_model(ONPREM, pipelineParallel=2)  # two replicas of two nodes: head and a worker
AWS_PIPELINE = with_model(DEV, pipelineParallel=2)


def bare_metal_env(cluster, node_name: str) -> dict[str, str]:
    node = next(n for n in cluster.nodes if n.name == node_name)
    spec = serving.model_container_spec(cluster, node)
    return dict(item.split("=", 1) for item in spec["envs"])


def prelude_exports(cluster, node_name: str, interface: str) -> dict[str, str]:
    """What the bare-metal container's entry script exports before vLLM or its launcher starts,
    run in bash with the finder answering `interface`."""
    node = next(n for n in cluster.nodes if n.name == node_name)
    script, env = serving.server_command(cluster, node)
    prelude = script.split("exec ", 1)[0].split(" && ", 1)[0]
    assert prelude.startswith(collective.interface_prelude())
    env = {**env, "QWEN_FIND_INTERFACE": f"print({interface!r})", "PATH": "/usr/bin:/bin"}
    text = collective.interface_prelude() + 'echo "$NCCL_SOCKET_IFNAME|$GLOO_SOCKET_IFNAME"'
    done = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, check=True)
    nccl, gloo = done.stdout.strip().split("|")
    return {"NCCL_SOCKET_IFNAME": nccl, "GLOO_SOCKET_IFNAME": gloo}


# -- row 1 and row 9: the interface variables, on every member, from the one finder


@pytest.mark.parametrize("node", [n.name for n in PIPELINE.nodes])
def test_row_1_and_9_every_bare_metal_member_exports_both_interface_variables(node):
    assert prelude_exports(PIPELINE, node, "ens1f0") == {
        "NCCL_SOCKET_IFNAME": "=ens1f0",  # exact: never ens1f01
        "GLOO_SOCKET_IFNAME": "ens1f0",
    }


def test_row_1_and_9_a_configured_interface_is_in_every_members_environment():
    cluster = with_section(PIPELINE, "bareMetal", interface="ens1f0")
    for node in cluster.nodes:
        env = bare_metal_env(cluster, node.name)
        assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("=ens1f0", "ens1f0")
        assert "QWEN_FIND_INTERFACE" not in env


def test_row_1_and_9_on_aws_every_member_gets_both_from_the_run():
    run = ssm.run_script()
    assert 'echo "NCCL_SOCKET_IFNAME==$IFACE"; echo "GLOO_SOCKET_IFNAME=$IFACE"' in run
    assert "GLOO_SOCKET_IFNAME" not in json.dumps(ssm.parameters(AWS_PIPELINE, "worker-1"))  # no per-node gap


def test_a_container_whose_address_no_interface_holds_stops_naming_it():
    env = {"QWEN_FIND_INTERFACE": "pass", "VLLM_HOST_IP": "192.0.2.9", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        ["bash", "-c", collective.interface_prelude() + "echo started"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "no interface holds VLLM_HOST_IP 192.0.2.9" in done.stderr


# -- row 2: vLLM and its launcher agree on the node's address


@pytest.mark.parametrize("cluster", [PIPELINE, AWS_PIPELINE], ids=["bare-metal", "aws"])
def test_row_2_vllm_host_ip_is_the_address_the_launcher_advertises(cluster):
    for node in cluster.nodes:
        if cluster.bare_metal:
            script, env = serving.server_command(cluster, node)
        else:
            env = ssm.environment(cluster, node.name)
            script = ssm.decoded(ssm.parameters(cluster, node.name)["ServerScript"])
        assert env["VLLM_HOST_IP"] == str(node.ip)
        for advertised in re.findall(r"--node-ip-address=(\S+)", script):
            assert advertised == str(node.ip)


# -- row 3 and 4: NCCL_NET pinned, the devices and provider EFA needs


def test_row_3_bare_metal_with_rdma_pins_nccl_to_ib():
    for node in ONPREM.nodes:
        assert bare_metal_env(ONPREM, node.name)["NCCL_NET"] == "IB"


def test_row_3_without_rdma_nccl_is_pinned_to_sockets_and_skips_ib():
    cluster = with_section(ONPREM, "tuning", rdma=False)
    env = bare_metal_env(cluster, "master")
    assert (env["NCCL_NET"], env["NCCL_IB_DISABLE"]) == ("Socket", "1")
    assert "devices" not in serving.model_container_spec(cluster, cluster.nodes[0])


def test_row_3_and_4_aws_pins_aws_ofi_nccl_and_gives_the_efa_devices():
    env = ssm.environment(DEV, "master")
    assert (env["NCCL_NET"], env["FI_PROVIDER"]) == ("AWS Libfabric", "efa")
    options = ssm.docker_options(DEV)
    assert "--device=/dev/infiniband" in options and "--cap-add=IPC_LOCK" in options


def test_row_3_nccl_logs_its_transport_for_doctor():
    for env in (bare_metal_env(ONPREM, "master"), ssm.environment(DEV, "master")):
        assert env["NCCL_DEBUG"] == "INFO" and "INIT" in env["NCCL_DEBUG_SUBSYS"]


def test_row_4_bare_metal_with_rdma_gives_the_verbs_devices():
    spec = serving.model_container_spec(ONPREM, ONPREM.nodes[0])
    assert spec["devices"] == [{"host_path": "/dev/infiniband"}]


# -- row 5 and 6: memlock and /dev/shm


def test_row_5_memlock_is_unlimited_with_ipc_lock_on_both_targets():
    spec = serving.model_container_spec(ONPREM, ONPREM.nodes[0])
    assert spec["ulimits"] == [{"name": "memlock", "soft": -1, "hard": -1}]
    assert spec["capabilities"] == {"adds": ["IPC_LOCK"]}
    assert "--ulimit=memlock=-1" in ssm.docker_options(DEV)


def test_row_6_host_ipc_gives_nccl_the_hosts_dev_shm_on_both_targets():
    assert serving.model_container_spec(ONPREM, ONPREM.nodes[0])["ipc_mode"] == "host"
    assert "--ipc=host" in ssm.docker_options(DEV)


def test_row_5_and_6_preflight_stops_on_a_host_that_cannot_give_them():
    """This machine: no /dev/infiniband, a hard memlock root cannot raise (no CAP_SYS_RESOURCE)."""
    text = preflight._rdma_checks()
    body = 'failed=0\nfail() { echo "FAILED: $*" >&2; failed=1; }\n' + text + 'exit "$failed"\n'
    done = subprocess.run(["bash", "-c", body], capture_output=True, text=True)
    if not os.path.isdir("/dev/infiniband"):
        assert done.returncode == 1
        assert "tuning.rdma is true but /dev/infiniband is empty or missing" in done.stderr
    assert done.returncode == 0 or "tuning.rdma is true but" in done.stderr


# -- row 7 and 8: the host's MTU and firewall (prevented there, detected by verify/doctor)


def test_row_7_the_aws_user_data_sets_the_cluster_mtu_on_the_found_interface():
    text = cloudinit.user_data(DEV, "master")
    assert f'ip link set dev "$IFACE" mtu {cloudinit.CLUSTER_MTU}' in text
    assert 'IFACE=$(interface_of "$NODE_IP")' in text


def test_row_8_verify_probes_a_dynamic_port_between_every_pair():
    probes = verify.cluster_probes(ONPREM)
    dynamic = {(p.source, p.dest) for p in probes if p.name == "dynamic"}
    pairs = {(a.name, b.name) for a in ONPREM.nodes for b in ONPREM.nodes if a != b}
    assert dynamic == pairs


# -- row 10: one image and one model path on every member of a replica


@pytest.mark.parametrize("cluster", [PIPELINE, AWS_PIPELINE], ids=["bare-metal", "aws"])
def test_row_10_every_member_of_a_replica_runs_the_same_image_and_model(cluster):
    for replica in cluster.topology.replicas:
        if cluster.bare_metal:
            images = {serving.model_container_spec(cluster, m)["image"] for m in replica.members}
        else:
            images = {ssm.parameters(cluster, m.name)["Image"] for m in replica.members}
        assert images == {cluster.model.image}
    if not cluster.bare_metal:
        # A member's change restarts the whole replica: one hash for all its members.
        for replica in cluster.topology.replicas:
            hashes = {ssm.config_hash(cluster, m.name) for m in replica.members}
            assert len(hashes) == 1


def test_the_collective_environment_is_the_same_on_every_member():
    envs = [
        {k: v for k, v in bare_metal_env(PIPELINE, n.name).items() if k.startswith(("NCCL_", "GLOO_", "FI_"))}
        for n in PIPELINE.nodes
    ]
    assert all(env == envs[0] for env in envs)
    assert json.dumps(envs[0], sort_keys=True) == json.dumps(
        {k: v for k, v in collective.environment(PIPELINE).items()}, sort_keys=True
    )
