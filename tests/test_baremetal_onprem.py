"""The onprem stack rendered under Pulumi's mocks: what the bare-metal target registers."""

import json

import pytest

from components.baremetal import connection
from components.baremetal.host import steps_for
from qwen_cluster import config, sshhosts, tags
from qwen_cluster.render import privilege, ssm
from tooling import offline, stackfile

NODES = {
    "master": "192.168.1.100",
    "worker-1": "192.168.1.101",
    "worker-2": "192.168.1.102",
    "worker-3": "192.168.1.103",
}
ONPREM = stackfile.load("onprem")
# The chain's step names, from the chain itself (the same on every host).
STEPS = [step.name for step in steps_for(ONPREM, ONPREM.master)]
SECRET_SIG = "4dabf18193072939515e22adb298388d"
COMMAND = "command:remote:Command"
CONTAINER = "docker:index/container:Container"


@pytest.fixture(scope="module")
def render() -> offline.Render:
    result = offline.render_stack("onprem")
    assert result.error is None, result.error
    return result


def test_one_chain_per_host_in_order(render):
    for node in NODES:
        chain = [render.named(f"{node}-{step}") for step in STEPS]
        assert {c.parent for c in chain} == {node}
        assert chain[0].depends_on == []
        for before, after in zip(chain, chain[1:], strict=False):
            assert after.depends_on == [before.name]
    assert {r.name for r in render.of_type("qwen-cluster:baremetal:HostSetup")} == set(NODES)


def test_each_chain_connects_to_its_own_host_as_the_ssh_user(render):
    for node, ip in NODES.items():
        for step in STEPS:
            wire = render.named(f"{node}-{step}").inputs["connection"]
            assert wire[SECRET_SIG]  # the whole connection is secret because the key is
            assert wire["value"]["host"] == ip
            assert wire["value"]["user"] == "ubuntu"


def test_private_key_is_present_only_inside_secrets(render):
    key = offline.OFFLINE_SSH_KEY
    for resource in render.resources:
        for name, value in resource.inputs.items():
            text = json.dumps(value)
            if key.strip() in text or "offline-placeholder" in text:
                assert name == "connection" and SECRET_SIG in value, (resource.name, name)
    assert "offline-placeholder" not in json.dumps(render.outputs)


def test_nothing_disables_selinux(render):
    everything = json.dumps([r.inputs for r in render.resources])
    assert "setenforce 0" not in everything
    assert "SELINUX=disabled" not in everything


def test_triggers_hold_only_each_steps_identity(render):
    """Triggers are replaceOnChanges in pulumi-command: anything that changes with the config
    (a script, the firewall document) must not be in them, or every change replaces."""
    for node, ip in NODES.items():
        for step in STEPS:
            expected = [ip, "ufw"] if step == "firewall" else [ip]
            assert render.named(f"{node}-{step}").inputs["triggers"] == expected, (node, step)
        assert render.named(f"{node}-verify").inputs["triggers"] == [ip]


def test_the_firewall_script_carries_the_document_the_policy_pack_reads(render):
    from qwen_cluster.render import firewall as fw

    firewall = render.named("worker-2-firewall")
    (text,) = fw.embedded_documents(firewall.inputs["create"])
    document = json.loads(text)
    assert document["schema"] == "qwen-cluster/host-firewall@1"
    assert (document["host"], document["address"], document["role"]) == (
        "worker-2",
        "192.168.1.102",
        "gpu-node",
    )
    assert (document["loadBalancer"], document.get("listenerPort"), document["nicSpeedGbps"]) == (
        False,
        None,
        25,
    )
    assert {
        "action": "allow",
        "direction": "in",
        "protocol": "tcp",
        "ports": "5000",
        "sources": ["192.168.1.100/32"],
        "description": "model-service 5000/tcp from the load balancer only",
    } in document["rules"]
    cluster_sources = {
        source
        for r in document["rules"]
        if r["protocol"] == "all" and r.get("ports") is None
        for source in r["sources"]
    }
    assert cluster_sources == {"192.168.1.100/31", "192.168.1.103/32"}  # exact blocks of the others
    (master_text,) = fw.embedded_documents(render.named("master-firewall").inputs["create"])
    master = json.loads(master_text)
    assert (master["loadBalancer"], master["listenerPort"]) == (True, 80)


def test_reverts_are_wired_as_delete(render):
    assert "ufw delete" in render.named("master-firewall").inputs["delete"]
    assert "rm -f" in render.named("master-sysctl").inputs["delete"]
    assert "delete" not in render.named("master-preflight").inputs


def test_one_docker_provider_per_host_over_ssh(render):
    providers = {r.name: r.inputs for r in render.of_type("pulumi:providers:docker")}
    assert {p["host"] for p in providers.values()} == {f"ssh://ubuntu@{ip}" for ip in NODES.values()}


def test_vllm_containers_one_per_replica_head_with_pinned_ports_and_rdma(render):
    servers = [r for r in render.of_type(CONTAINER) if r.name.endswith("-vllm")]
    assert len(servers) == 4  # pipelineParallel 1: every node heads a replica
    for server in servers:
        node = server.name.removesuffix("-model-vllm")
        args = server.inputs
        envs = dict(e.split("=", 1) for e in args["envs"])
        assert envs["VLLM_HOST_IP"] == NODES[node]
        assert "VLLM_PORT" not in envs  # vLLM 0.33 opens nothing between nodes at it
        script = args["command"][0]
        assert "--port=5000" in script and "--tensor-parallel-size=4" in script
        assert 'export NCCL_SOCKET_IFNAME="=$iface" GLOO_SOCKET_IFNAME="$iface"' in script
        assert args["gpus"] == "all" and args["ipcMode"] == "host" and args["networkMode"] == "host"
        assert args["devices"] == [{"hostPath": "/dev/infiniband"}]
        assert args["capabilities"] == {"adds": ["IPC_LOCK"]}
        assert args["ulimits"] == [{"name": "memlock", "soft": -1, "hard": -1}]
        assert args["image"] == "vllm/vllm-openai:v0.33.0"
        assert server.depends_on == ["cluster-set-up", f"{node}-model-stage", f"{node}-drain"]
        assert server.provider.split("::")[-1].startswith(f"{node}-model-docker")


def test_nginx_runs_on_the_load_balancer_node_with_its_config_mounted_from_the_host(render):
    from qwen_cluster.render import nginx
    from tooling import stackfile

    lb = render.named("load-balancer-nginx")
    assert lb.provider.split("::")[-1].startswith("master-model-docker")
    assert "uploads" not in lb.inputs  # ForceNew: every config change would be a new container
    assert lb.inputs["volumes"] == [
        {
            "hostPath": "/etc/qwen-cluster/nginx",
            "containerPath": "/etc/nginx/qwen",
            "readOnly": True,
            "selinuxRelabel": "Z",
        }
    ]
    assert lb.inputs["command"] == ["nginx", "-c", "/etc/nginx/qwen/nginx.conf", "-g", "daemon off;"]
    assert lb.inputs["networkMode"] == "host"
    assert "load-balancer-config" in lb.depends_on

    config = render.named("load-balancer-config")
    assert config.inputs["connection"]["value"]["host"] == NODES["master"]
    assert config.inputs["triggers"] == [NODES["master"]]
    onprem = stackfile.load("onprem")
    conf = nginx.for_cluster(onprem, upstream_file="upstream.conf")
    installed = nginx.install_script(conf, nginx.upstream_servers(onprem))
    assert config.inputs["create"] == privilege.as_root(installed)
    assert "include upstream.conf;" in conf and "server 192.168.1.101:5000" not in conf


def test_nginx_container_may_open_the_files_its_config_asks_for(render):
    from qwen_cluster.render import nginx

    lb = render.named("load-balancer-nginx")
    limit = nginx.WORKER_RLIMIT_NOFILE
    assert f"worker_rlimit_nofile {limit};" in render.named("load-balancer-config").inputs["create"]
    assert lb.inputs["ulimits"] == [{"name": "nofile", "soft": limit, "hard": limit}]
    assert render.named("load-balancer-image").inputs["name"] == "nginx:1.30.6"


def test_containers_start_after_one_barrier_that_waits_for_every_hosts_setup(render):
    barrier = render.named("cluster-set-up")
    assert barrier.depends_on == [f"{n}-{STEPS[-1]}" for n in NODES]
    waiting = {r.name for r in render.resources if "cluster-set-up" in r.depends_on}
    assert {f"{n}-model-vllm" for n in NODES} | {f"{n}-model-image" for n in NODES} <= waiting
    assert {"load-balancer-config", "load-balancer-nginx", "cluster-started"} <= waiting


def test_a_barrier_runs_nothing_and_has_no_input_but_its_connection(render):
    for name in ("cluster-set-up", "cluster-started"):
        barrier = render.named(name)
        assert barrier.type == COMMAND
        assert set(barrier.inputs) == {"connection"}, name
        assert barrier.inputs["connection"]["value"]["host"] == NODES["master"]


def test_every_check_runs_after_one_barrier_that_waits_for_everything_started(render):
    started = render.named("cluster-started")
    expected = {"cluster-set-up", "load-balancer-nginx"}
    expected |= {f"{n}-model-vllm" for n in NODES} | {f"{n}-ready" for n in NODES}
    assert set(started.depends_on) == expected
    for node in NODES:
        if node != "master":
            assert render.named(f"{node}-verify").depends_on == ["cluster-started"]


def test_master_verify_comes_last(render):
    final = render.named("master-verify")
    assert final.inputs["connection"]["value"]["host"] == NODES["master"]
    expected = {"cluster-started"} | {f"{n}-verify" for n in NODES if n != "master"}
    assert set(final.depends_on) == expected
    assert render.critical_path()[-1] == "master-verify"
    assert "max_latency_ms=1" in final.inputs["create"]


def test_outputs(render):
    assert render.outputs["endpoint"] == "http://192.168.1.100:80"
    assert render.outputs["modelServers"] == [f"{ip}:5000" for ip in NODES.values()]


def test_pipeline_members_run_vllms_own_multinode_launch_against_their_head():
    from tooling import stackfile

    stack = stackfile.read("onprem")
    stack["qwen-cluster:model"] = {**stack["qwen-cluster:model"], "pipelineParallel": 2}
    result = offline.render(stack, "onprem")
    assert result.error is None, result.error
    head = result.named("master-model-vllm").inputs
    worker = result.named("worker-1-model-vllm").inputs
    # One container name on every node (and on AWS); the label says which role it plays.
    assert head["name"] == worker["name"] == tags.MODEL_SERVER_CONTAINER == ssm.CONTAINER_NAME
    assert {label["value"] for label in head["labels"]} == {tags.HEAD_CONTAINER}
    assert {label["value"] for label in worker["labels"]} == {tags.PIPELINE_WORKER_CONTAINER}
    multinode = (
        "--distributed-executor-backend=mp --nnodes=2 --node-rank={} "
        "--master-addr=192.168.1.100 --master-port=6010"
    )
    assert "exec vllm serve Qwen/Qwen3-32B --host=192.168.1.100 --port=5000" in head["command"][0]
    assert multinode.format(0) in head["command"][0]
    # The member runs in the background of its head's watch (vllm.member_script), not exec'd.
    assert "\nvllm serve Qwen/Qwen3-32B --headless" in worker["command"][0]
    assert "is gone" in worker["command"][0]
    assert multinode.format(1) in worker["command"][0]
    assert "--port" not in worker["command"][0] and "ray " not in worker["command"][0]
    assert not [e for e in worker["envs"] if e.startswith(("RAY_", "VLLM_PORT"))]
    assert result.outputs["modelServers"] == ["192.168.1.100:5000", "192.168.1.102:5000"]


def test_rdma_off_drops_the_device_and_disables_nccl_ib():
    from tooling import stackfile

    stack = stackfile.read("onprem")
    stack["qwen-cluster:tuning"] = {**stack["qwen-cluster:tuning"], "rdma": False}
    result = offline.render(stack, "onprem")
    server = result.named("worker-1-model-vllm").inputs
    assert "devices" not in server and "capabilities" not in server
    assert "NCCL_IB_DISABLE=1" in server["envs"]


def test_host_keys_and_bastion_reach_the_connection():
    from tooling import stackfile

    stack = stackfile.read("onprem")
    stack["qwen-cluster:bareMetal"] = {
        **stack["qwen-cluster:bareMetal"],
        "hostKeys": {"worker-1": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB"},
        "bastion": {"host": "203.0.113.10", "user": "jump"},
        "allowUnverifiedHosts": True,  # the other nodes and the bastion: an explicit choice
    }
    result = offline.render(stack, "onprem")
    assert result.error is None, result.error
    wire = result.named("worker-1-firewall").inputs["connection"]["value"]
    assert wire["hostKey"] == "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB"
    assert wire["proxy"]["host"] == "203.0.113.10" and wire["proxy"]["user"] == "jump"
    docker = result.named("worker-1-model-docker").inputs
    assert "jump@203.0.113.10:22" in docker["sshOpts"] and "StrictHostKeyChecking=yes" in docker["sshOpts"]
    assert (
        "KnownHostsCommand=/bin/echo 192.168.1.101 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB"
        in docker["sshOpts"]
    )


def test_docker_pins_the_bastion_host_key_through_a_proxy_command():
    cluster = stackfile.load("onprem")
    bare_metal = cluster.bare_metal.model_copy(
        update={"bastion": config.Bastion(host="203.0.113.10", port=2222, host_key="ssh-ed25519 AAAAB")}
    )
    cluster = cluster.model_copy(update={"bare_metal": bare_metal})
    _, options = sshhosts.docker_host(cluster, cluster.nodes[1])
    proxy = next(option for option in options if option.startswith("ProxyCommand="))
    assert "-J" not in options
    assert proxy == (
        'ProxyCommand=ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o "KnownHostsCommand=/bin/echo '
        '[203.0.113.10]:2222 ssh-ed25519 AAAAB" -p 2222 -W %h:%p ubuntu@203.0.113.10'
    )


def test_missing_key_without_agent_fails_clearly():
    import pulumi

    with pytest.raises(pulumi.RunError, match="sshPrivateKey is not set"):
        connection.check_credentials(None, environ={})
    connection.check_credentials(None, environ={"SSH_AUTH_SOCK": "/run/agent.sock"})


def test_unknown_host_key_node_is_a_config_error():
    from qwen_cluster import config
    from tooling import stackfile

    raw = stackfile.cluster_keys(stackfile.read("onprem"))
    raw["bareMetal"] = {**raw["bareMetal"], "hostKeys": {"worker-9": "ssh-ed25519 AAAA"}}
    with pytest.raises(config.ConfigError, match="bareMetal.hostKeys.worker-9 is not one of the nodes"):
        config.validate(raw)


def test_the_verify_step_waits_for_a_model_port_as_long_as_the_rollout_waits_for_health():
    """One bound: rollout.healthTimeoutSeconds, not a number of the verify step's own."""
    stack_config = stackfile.read("onprem")
    stack_config[f"{config.NAMESPACE}:rollout"] = {"healthTimeoutSeconds": 120}
    result = offline.render(stack_config, "onprem")
    assert result.error is None, result.error
    for node in NODES:
        script = result.named(f"{node}-verify").inputs["create"]
        assert "\nservice_wait=120\n" in script, node


def _without_host_key(node: str) -> dict:
    from tooling import stackfile

    stack = stackfile.read("onprem")
    keys = {k: v for k, v in stack["qwen-cluster:bareMetal"]["hostKeys"].items() if k != node}
    stack["qwen-cluster:bareMetal"] = {**stack["qwen-cluster:bareMetal"], "hostKeys": keys}
    return stack


def test_up_refuses_a_node_without_a_pinned_host_key_before_registering_anything():
    result = offline.render(_without_host_key("worker-2"), "onprem")
    assert result.error is not None
    assert "bareMetal.hostKeys pins no host key for worker-2" in result.error
    assert "scripts/hostkeys.py <stack> --write" in result.error
    assert "bareMetal.allowUnverifiedHosts: true" in result.error
    assert not result.of_type("command:remote:Command")


def test_a_preview_warns_of_the_unpinned_node_and_renders(caplog):
    result = offline.render(_without_host_key("worker-2"), "onprem", preview=True)
    assert result.error is None, result.error
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("pins no host key for worker-2" in line and "will refuse" in line for line in warned)


def test_a_stack_may_accept_unverified_hosts_explicitly():
    stack = _without_host_key("worker-2")
    stack["qwen-cluster:bareMetal"]["allowUnverifiedHosts"] = True
    result = offline.render(stack, "onprem")
    assert result.error is None, result.error
    assert "hostKey" not in result.named("worker-2-firewall").inputs["connection"]["value"]
