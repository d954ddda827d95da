"""What a disaggregated stack renders for its model servers, its router and nginx: each pool's
NIXL role and tensor parallel, the transport's environment, the router in P/D mode, and nginx's
fallback to the decode pool."""

from __future__ import annotations

import json
import subprocess

import pytest

from components.baremetal import serving
from qwen_cluster.config import ConfigError, validate
from qwen_cluster.render import collective, nginx, router, ssm, vllm
from tests.helpers.configs import disaggregated


def kv_config(argv: list[str]) -> dict:
    value = next(arg for arg in argv if arg.startswith("--kv-transfer-config="))
    return json.loads(value.split("=", 1)[1])


def test_prefill_nodes_serve_as_kv_producers_and_decode_nodes_as_consumers(bare_metal_raw):
    cluster = validate(disaggregated(bare_metal_raw))
    roles = {node.name: kv_config(vllm.serve_argv(cluster, node.name))["kv_role"] for node in cluster.nodes}
    assert roles == {
        "master": "kv_producer",
        "worker-1": "kv_producer",
        "worker-2": "kv_consumer",
        "worker-3": "kv_consumer",
    }


def test_aggregated_nodes_get_no_kv_transfer_config(bare_metal_raw):
    cluster = validate(bare_metal_raw)
    assert not any(arg.startswith("--kv-transfer-config") for arg in vllm.serve_argv(cluster, "master"))
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in vllm.environment(cluster, "master")


def test_each_pool_runs_its_own_tensor_parallel(bare_metal_raw):
    raw = disaggregated(bare_metal_raw, decode={"nodes": ["worker-2", "worker-3"], "tensorParallel": 2})
    cluster = validate(raw)
    assert "--tensor-parallel-size=4" in vllm.serve_argv(cluster, "master")
    assert "--tensor-parallel-size=2" in vllm.serve_argv(cluster, "worker-3")


def test_model_vllm_flags_cannot_set_the_kv_transfer_config(bare_metal_raw):
    bare_metal_raw["model"] = {"vllmFlags": {"--kv-transfer-config": "{}"}}
    with pytest.raises(ConfigError, match=r"--kv-transfer-config .* is set by the program from serving"):
        validate(disaggregated(bare_metal_raw))


def test_the_side_channel_advertises_the_nodes_own_address(bare_metal_raw):
    cluster = validate(disaggregated(bare_metal_raw))
    env = vllm.environment(cluster, "worker-2")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.1.102"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["UCX_TCP_PORT_RANGE"] == "5601-5680"


def test_ucx_over_rdma_leaves_the_transport_to_ucx(bare_metal_raw):
    bare_metal_raw["tuning"] = {"rdma": True}
    cluster = validate(disaggregated(bare_metal_raw))
    _, env = serving.server_command(cluster, cluster.nodes[2])
    assert "UCX_TLS" not in env and "UCX_NET_DEVICES" not in env


def test_ucx_without_rdma_runs_tcp_on_the_nic_the_finder_names(bare_metal_raw):
    bare_metal_raw["tuning"] = {"rdma": False}
    cluster = validate(disaggregated(bare_metal_raw))
    script, env = serving.server_command(cluster, cluster.nodes[2])
    assert env["UCX_TLS"] == "tcp" and "UCX_NET_DEVICES" not in env
    # The container's prelude names it from the finder's answer, the same as NCCL's and Gloo's.
    prelude = collective.interface_prelude(ucx_tcp=True)
    assert script.startswith(prelude)
    shown = subprocess.run(
        ["bash", "-c", prelude.replace('$(python3 -c "$QWEN_FIND_INTERFACE" "$VLLM_HOST_IP")', "eth7")
         + 'echo "$UCX_NET_DEVICES"'],
        env={"UCX_TLS": "tcp", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == "eth7"


def test_a_named_interface_is_given_to_ucx_at_render(bare_metal_raw):
    bare_metal_raw["tuning"] = {"rdma": False}
    bare_metal_raw["bareMetal"]["interface"] = "ens5"
    cluster = validate(disaggregated(bare_metal_raw))
    assert vllm.environment(cluster, "master")["UCX_NET_DEVICES"] == "ens5"


def test_aggregated_containers_keep_their_prelude_to_the_byte(bare_metal_raw):
    bare_metal_raw["tuning"] = {"rdma": False}
    cluster = validate(bare_metal_raw)
    script, _ = serving.server_command(cluster, cluster.nodes[0])
    assert script.startswith(collective.interface_prelude()) and "UCX_NET_DEVICES" not in script


def test_aws_nodes_run_libfabric_with_the_efa_devices_and_memlock(aws_raw):
    cluster = validate(disaggregated(aws_raw))
    assert kv_config(vllm.serve_argv(cluster, "worker-2"))["kv_connector_extra_config"] == {
        "backends": ["LIBFABRIC"]
    }
    env = ssm.environment(cluster, "worker-2")
    assert env["FI_PROVIDER"] == "efa" and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "192.168.1.102"
    options = ssm.docker_options(cluster)
    assert {"--device=/dev/infiniband", "--ulimit=memlock=-1", "--cap-add=IPC_LOCK"} <= set(options)


def flag_values(argv: list[str], name: str) -> list[str]:
    return [argv[index + 1] for index, arg in enumerate(argv) if arg == name]


def test_the_router_runs_in_pd_mode_with_each_pool(bare_metal_raw):
    argv = router.command(validate(disaggregated(bare_metal_raw)))
    assert "--vllm-pd-disaggregation" in argv and "--worker-urls" not in argv
    assert flag_values(argv, "--prefill") == ["http://192.168.1.100:5000", "http://192.168.1.101:5000"]
    assert flag_values(argv, "--decode") == ["http://192.168.1.102:5000", "http://192.168.1.103:5000"]
    assert flag_values(argv, "--kv-connector") == ["nixl"]


def test_a_prefill_url_is_never_followed_by_a_bootstrap_port(bare_metal_raw):
    # Both CLIs read a bare word after `--prefill URL` as its bootstrap port (SGLang's and
    # Mooncake's handshake, not NIXL's): the next token must be a flag.
    argv = router.command(validate(disaggregated(bare_metal_raw)))
    after = [argv[index + 2] for index, arg in enumerate(argv) if arg == "--prefill"]
    assert all(token.startswith("--") for token in after)


def test_the_aws_router_reaches_each_pool_through_the_node_proxies(aws_raw):
    cluster = validate(disaggregated(aws_raw))
    argv = router.command(cluster)
    assert flag_values(argv, "--decode") == [
        f"http://192.168.1.10{index}:{cluster.router_worker_port}" for index in (2, 3)
    ]


def test_nginx_falls_back_to_the_decode_pool_only(bare_metal_raw):
    cluster = validate(disaggregated(bare_metal_raw))
    assert nginx.upstream_servers(cluster) == [("192.168.1.102", 5000), ("192.168.1.103", 5000)]
    assert nginx.router_server(cluster) == ("127.0.0.1", cluster.router_port)
