"""What a disaggregated stack renders for its model servers, its router and nginx: each pool's
NIXL role and tensor parallel, the transport's environment, the router in P/D mode, and nginx's
fallback to the decode pool."""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

from components.baremetal import serving
from qwen_cluster.config import ConfigError, validate
from qwen_cluster.render import collective, nginx, proxy, rollout, router, ssm, vllm
from tests.helpers import tools
from tests.helpers.baremetal import shellcheck
from tests.helpers.configs import TEST_API_KEY, disaggregated
from tests.helpers.standin_server import free_port
from tests.helpers.wait import wait_until


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
    # Through nginx's worker listeners on the load-balancer host, one loopback alias a replica.
    assert flag_values(argv, "--prefill") == ["http://127.1.0.1:5000", "http://127.1.0.2:5000"]
    assert flag_values(argv, "--decode") == ["http://127.1.0.3:5000", "http://127.1.0.4:5000"]
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


def _nginx_t(directory, conf: str) -> subprocess.CompletedProcess:
    tools.require("nginx")
    (directory / "nginx.conf").write_text(conf)
    return subprocess.run(
        ["nginx", "-t", "-e", "stderr", "-p", f"{directory}/", "-c", str(directory / "nginx.conf")],
        capture_output=True,
        text=True,
    )


def test_the_load_balancers_nginx_takes_the_pd_worker_listeners(bare_metal_raw, tmp_path):
    cluster = validate(disaggregated(bare_metal_raw))
    (tmp_path / "logs").mkdir()
    (tmp_path / nginx.KEYS_FILE).write_text(nginx.keys_conf([TEST_API_KEY]))
    conf = nginx.for_cluster(cluster, runtime_dir=str(tmp_path), log_dir=str(tmp_path / "logs"), user=None)
    conf = conf.replace(f"pid {'/var/run/nginx.pid'};", f"pid {tmp_path}/nginx.pid;")
    assert conf.count("listen 127.1.0.") == 4
    result = _nginx_t(tmp_path, conf)
    assert result.returncode == 0, result.stderr


def test_an_aws_proxy_reads_its_drain_file_only_when_disaggregated(aws_raw):
    pd = proxy.conf(validate(disaggregated(copy.deepcopy(aws_raw))), "worker-2")
    aws_raw["loadBalancer"] = {"routing": "cache-aware"}
    routed = proxy.conf(validate(aws_raw), "worker-2")
    include = f"include {nginx.CONTAINER_CONF_DIR}/drain*.conf;"
    assert include in pd and include not in routed


def test_an_aws_proxys_drain_file_turns_the_routers_health_checks_to_503(aws_raw, tmp_path):
    tools.require("nginx")
    cluster = validate(disaggregated(aws_raw))
    port = free_port()
    # The proxy's files where this test's nginx reads them; the node's address on loopback; no
    # vLLM behind it (without the drain file /health would be 502).
    conf = (
        proxy.conf(cluster, "worker-2")
        .replace(nginx.CONTAINER_CONF_DIR, str(tmp_path))
        .replace("192.168.1.102", "127.1.0.9")
        .replace(f":{cluster.router_worker_port};", f":{port};")
        .replace(f":{cluster.model_port};", f":{free_port()};")
        .replace("user nginx;", "")
        .replace("/var/run/nginx.pid", f"{tmp_path}/nginx.pid")
        .replace("/var/cache/nginx", str(tmp_path))
        .replace("/var/log/nginx", str(tmp_path))
    )
    (tmp_path / "nginx.conf").write_text(conf)
    (tmp_path / nginx.KEYS_FILE).write_text(nginx.keys_conf([TEST_API_KEY]))
    health = f"http://127.1.0.9:{port}/health"
    server = subprocess.Popen(
        ["nginx", "-p", f"{tmp_path}/", "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(lambda: _status(health) is not None, what="the proxy's router listener", timeout=10)
        assert _status(health) == 502
        (tmp_path / proxy.DRAIN_FILE).write_text("return 503;\n")
        server.send_signal(signal.SIGHUP)
        wait_until(lambda: _status(health) == 503, what="the drain file read at the reload", timeout=10)
    finally:
        server.terminate()
        server.wait(timeout=10)


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def test_the_pd_rollout_scripts_are_shellcheck_clean(tmp_path):
    common = {"replica": "r", "pd_worker_url": "http://127.1.0.1:5000"}
    server = ("192.168.1.100", 5000)
    for text in (
        rollout.drain_script(server, drain_timeout_seconds=5, fingerprint="x", **common),
        rollout.ready_script(server, health_timeout_seconds=5, fingerprint="x", only_if_down=False, **common),
        rollout.retire_script(server, drain_timeout_seconds=5, **common),
        ssm.shell_check_text(ssm.run_script(routed=True, pd=True)),
    ):
        shellcheck(text, tmp_path)


def test_aggregated_documents_keep_their_run_to_the_byte():
    assert ssm.run_script(routed=True) == ssm.run_script(routed=True, pd=False)
    assert "drain.conf" not in ssm.run_script(routed=True)


def test_kv_aware_routing_is_refused_with_disaggregated_serving(bare_metal_raw):
    bare_metal_raw["loadBalancer"] = {"routing": "kv-aware"}
    with pytest.raises(ConfigError, match="kv-aware with serving.mode disaggregated is not supported"):
        validate(disaggregated(bare_metal_raw))
