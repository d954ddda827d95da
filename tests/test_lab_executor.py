"""The lab's executor without namespaces: the render it runs, its order, its substitutions."""

from __future__ import annotations

import os
import re

import pytest

from labkit.engine import dockerprovider, executor, substitutions
from labkit.hosts import dockerd, sshd
from labkit.images import standins
from tooling import offline, stackfile


@pytest.fixture(scope="module")
def onprem():
    rendered, made = executor.render(stackfile.read("onprem"), "onprem", 1 / 30)
    return rendered, made


def test_the_render_puts_the_stack_on_the_lab_clock_and_hosts(onprem):
    rendered, made = onprem
    assert "loadBalancer.idleTimeoutSeconds 3600 -> 120 (lab clock)" in made
    assert any(line.startswith("tuning.rdma true -> false") for line in made)
    assert "proxy_read_timeout 120s;" in rendered.named("load-balancer-config").inputs["create"]


def test_waits_on_real_speed_work_keep_the_configured_timeout():
    """The health gates wait for a container's start and a server's load, which run at real
    speed: the lab clock leaves rollout.healthTimeoutSeconds as configured (scaled, 300 s was
    10 s and a good change failed on a busy machine), and the gate's message names it."""
    config = stackfile.read("onprem")
    config["qwen-cluster:rollout"] = {"healthTimeoutSeconds": 300, "drainTimeoutSeconds": 300}
    rendered, made = executor.render(config, "onprem", 1 / 30)
    assert "rollout.drainTimeoutSeconds 300 -> 10 (lab clock)" in made
    assert not any(line.startswith("rollout.healthTimeoutSeconds") for line in made)
    gate = rendered.named("master-ready").inputs["update"]
    assert "\nhealth_timeout=300\n" in gate
    assert "rollout.healthTimeoutSeconds=$health_timeout;" in gate


def test_every_resource_follows_what_it_waits_for(onprem):
    rendered, _ = onprem
    deps = executor.graph(rendered)
    order = executor.topological(deps, [r.name for r in rendered.custom_resources])
    position = {name: index for index, name in enumerate(order)}
    assert set(order) == {r.name for r in rendered.custom_resources}
    for name, waits_for in deps.items():
        assert all(position[other] < position[name] for other in waits_for), name
    # The container waits for its docker provider as well as for every host's setup (through
    # the barrier that waits for them all).
    assert "master-model-docker" in deps["master-model-vllm"]
    assert "cluster-set-up" in deps["master-model-vllm"]
    assert "worker-3-selinux" in deps["cluster-set-up"]
    assert position["master-verify"] == len(order) - 1


def test_a_dependency_cycle_is_named():
    with pytest.raises(executor.ExecutorError, match="a -> b -> a"):
        executor.topological({"a": {"b"}, "b": {"a"}}, ["a", "b"])


def test_day_zero_creates_every_custom_resource(onprem):
    rendered, _ = onprem
    changes = executor.changes_between(None, rendered)
    assert {change.action for change in changes.values()} == {"create"}
    assert set(changes) == {r.name for r in rendered.custom_resources}


def test_the_stored_render_round_trips_without_the_key(onprem):
    rendered, _ = onprem
    document = executor.render_to_json(rendered)
    again = executor.render_from_json(document)
    assert [r.inputs for r in again.resources] == [r.inputs for r in rendered.resources]
    connection = again.named("master-firewall").inputs["connection"]
    assert connection["host"] == "192.168.1.100" and "privateKey" not in connection


def test_commands_connect_to_the_nodes_containers_through_their_provider(onprem, tmp_path):
    rendered, _ = onprem
    hosts = {
        ip: standins.Host(name, f"ns-{name}", ip, "/etc/netns/x", "/run/x", "/run/x/bin")
        for name, ip in (("master", "192.168.1.100"), ("worker-1", "192.168.1.101"))
    }
    engine = executor.Executor(hosts, log_dir=tmp_path)
    assert engine.host_of(rendered.named("worker-1-firewall"), rendered).node == "worker-1"
    assert engine.host_of(rendered.named("master-model-vllm"), rendered).node == "master"
    assert engine.host_of(rendered.named("master-model-docker"), rendered) is None
    with pytest.raises(executor.ExecutorError, match="192.168.1.102 is not a node of the lab"):
        engine.host_of(rendered.named("worker-2-firewall"), rendered)


def test_scripts_get_the_node_paths_and_a_leftover_host_path_is_refused(onprem):
    rendered, _ = onprem
    text = rendered.named("master-firewall").inputs["create"]
    assert "/var/lib/qwen-cluster" in text
    script = substitutions.script(text, resource="f", etc_root="/etc/netns/n", state_dir="/run/l/master")
    assert "/var/lib/qwen-cluster" not in script and "/run/l/master" in script
    sysctl = substitutions.script(
        rendered.named("master-sysctl").inputs["create"], resource="s", etc_root="/e", state_dir="/s"
    )
    assert "--system" not in sysctl and 'sysctl -e -p "$dropin"' in sysctl
    with pytest.raises(substitutions.SubstitutionError, match="x: the script still names --system"):
        substitutions.script("sysctl --system", resource="x", etc_root="/e", state_dir="/s")


def test_each_container_image_has_one_stand_in(onprem):
    rendered, _ = onprem
    kinds = {}
    for name in ("load-balancer-nginx", "worker-2-model-vllm"):
        container = standins.Container.from_inputs(name, rendered.named(name).inputs)
        kinds[name] = (standins.stand_in_for(container).kind, standins.serves(container))
    assert kinds["load-balancer-nginx"] == ("nginx", [80])
    assert kinds["worker-2-model-vllm"] == ("model", [5000])
    unknown = standins.Container.from_inputs("x", {"image": "redis:7", "name": "cache"})
    with pytest.raises(standins.StandInError, match="image redis:7 has no stand-in"):
        standins.stand_in_for(unknown)


def test_every_host_tree_the_lab_layer_copies_exists():
    """The lab's code layer copies host trees into every stand-in image; one that is not there
    fails the image's build at `up`, on every node, long after the change that moved it."""
    trees = standins.app_layer(standins.busybox_layer()).trees
    assert [host for host, _ in trees if not os.path.exists(host)] == []


def test_the_provider_creates_with_the_inputs_and_clamps_only_the_ulimits(onprem):
    """The Engine API body carries what the program registered, as kreuzwerker builds it;
    the lab moves host paths and clamps ulimits to this machine's limits, nothing else."""
    rendered, _ = onprem

    def moved(path):
        return substitutions.host_path(path, etc_root="/e/n", state_dir="/r/n")

    inputs = executor.plain(rendered.named("master-model-vllm").inputs)
    body, notes = dockerprovider.create_body(inputs, moved)
    assert body["Image"] == inputs["image"] and body["Entrypoint"] == ["/bin/bash", "-c"]
    assert body["Cmd"] == inputs["command"] and body["Env"] == inputs["envs"]
    assert body["Labels"] == {"qwen-cluster.role": "head"}
    assert body["StopTimeout"] == inputs["stopTimeout"]
    host = body["HostConfig"]
    assert host["NetworkMode"] == "host" and host["IpcMode"] == "host"
    assert host["RestartPolicy"]["Name"] == "unless-stopped"
    assert host["DeviceRequests"][0]["Count"] == -1 and host["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert host["Binds"] == ["/r/n/cache/huggingface:/root/.cache/huggingface:rw,z"]
    assert notes == []

    rdma = {**inputs, "ulimits": [{"name": "memlock", "soft": -1, "hard": -1}]}
    body, notes = dockerprovider.create_body(rdma, moved)
    limit = dockerd.HARD_LIMITS["memlock"]
    assert body["HostConfig"]["Ulimits"] == [{"Name": "memlock", "Soft": limit, "Hard": limit}]
    assert notes and "CAP_SYS_RESOURCE" in notes[0]

    exporter = executor.plain(rendered.named("master-monitoring-node-exporter").inputs)
    mount = dockerprovider.create_body(exporter, moved)[0]["HostConfig"]["Mounts"][0]
    assert mount == {
        "Type": "bind",
        "Target": "/host",
        "Source": "/",
        "ReadOnly": True,
        "BindOptions": {"Propagation": "rslave"},
    }


def _one_container(image: str) -> offline.Render:
    provider = offline.RecordedResource(
        "pulumi:providers:docker", "n1-docker", {"host": "ssh://u@10.0.0.1"}, {}, True
    )
    container = offline.RecordedResource(
        executor.CONTAINER,
        "n1-model",
        {"name": "qwen-head", "image": image, "restart": "unless-stopped"},
        {},
        True,
        provider="urn:pulumi:s::p::pulumi:providers:docker::n1-docker::id",
        delete_before_replace=True,
    )
    return offline.Render("s", [provider, container], {}, [])


def test_a_container_that_fails_to_start_stays_in_the_state_and_the_next_change_converges(tmp_path):
    """A create that docker accepted and a start that failed: the state keeps the container with
    its id and init errors (the engine's partial create); the next apply with the same inputs
    updates it (starts it again), one with a new image deletes it by id first: no name conflict."""
    host = standins.Host("n1", "ns", "10.0.0.1", "/e", str(tmp_path), "/b")
    calls = []

    def fake(self, resource, rendered, request, timeout):
        calls.append(request)
        image = (request.get("body") or {}).get("Image", "")
        if request["op"] == "create" and image.endswith("bad"):
            return {
                "ok": False,
                "id": "c1",
                "stage": "start",
                "error": "Unable to start container: exec failed",
            }
        if request["op"] == "create":
            return {"ok": True, "id": "c2", "state": {"Running": True}}
        if request["op"] == "inspect":
            return {"ok": True, "state": {"Running": False}}
        return {"ok": True, "id": request.get("id")}

    executor.Executor._docker, original = fake, executor.Executor._docker
    try:
        bad = _one_container("vllm/vllm-openai:bad")
        first = executor.Executor({"10.0.0.1": host}, log_dir=tmp_path / "s").apply(None, bad)
        assert not first.ok
        assert first.state["n1-model"].outputs == {
            "id": "c1",
            "initErrors": ["Unable to start container: exec failed"],
        }
        old = executor.state_render("s", first.state, bad)

        calls.clear()
        again = executor.Executor({"10.0.0.1": host}, log_dir=tmp_path / "s").apply(old, bad)
        assert [call["op"] for call in calls] == ["update", "inspect", "start"]
        assert again.ok and again.state["n1-model"].outputs == {"id": "c1", "mustRun": True}

        calls.clear()
        good = _one_container("vllm/vllm-openai:good")
        fixed = executor.Executor({"10.0.0.1": host}, log_dir=tmp_path / "s").apply(old, good)
        assert [call["op"] for call in calls] == ["delete", "create"]
        assert calls[0]["id"] == "c1"
        assert fixed.ok and fixed.state["n1-model"].outputs == {"id": "c2", "mustRun": True}
    finally:
        executor.Executor._docker = original


def _container_with_grace(image: str, grace: int) -> offline.Render:
    render = _one_container(image)
    render.resources[1].inputs["destroyGraceSeconds"] = grace
    return render


@pytest.mark.parametrize(("real_model", "grace"), [(False, 3), (True, 90)])
def test_the_model_servers_stop_grace_follows_its_shutdown_clock(tmp_path, real_model, grace):
    """The stand-in puts --shutdown-timeout on the lab clock, so its grace follows (90 s: 3 s at
    1/30); the real vLLM shuts down at real speed, so its grace stays whole, whatever the clock."""
    from labkit.cluster import blueprint, lifecycle

    plan = blueprint.build(stackfile.load("onprem"), "t")
    clock = 1 / 3 if real_model else 1 / 30
    options = lifecycle.Options(clock_scale=clock, real_model=real_model)
    host = lifecycle.host(plan, plan.members[0], options)
    host = standins.Host("n1", "ns", "10.0.0.1", "/e", str(tmp_path), "/b", lab_env=host.lab_env)
    calls = []

    def fake(self, resource, rendered, request, timeout):
        calls.append(request)
        return {"ok": True, "id": request.get("id") or "c1", "state": {"Running": True}}

    executor.Executor._docker, original = fake, executor.Executor._docker
    try:
        first = executor.Executor({"10.0.0.1": host}, log_dir=tmp_path / "s").apply(
            None, _container_with_grace("vllm/vllm-openai:a", 90)
        )
        old = executor.state_render("s", first.state, _container_with_grace("vllm/vllm-openai:a", 90))
        calls.clear()
        executor.Executor({"10.0.0.1": host}, log_dir=tmp_path / "s").apply(
            old, _container_with_grace("vllm/vllm-openai:b", 90)
        )
    finally:
        executor.Executor._docker = original
    assert [(call["op"], call.get("grace")) for call in calls][0] == ("delete", grace)


def test_every_host_path_of_the_program_is_moved_and_none_is_left(onprem):
    rendered, _ = onprem
    for resource in rendered.of_type(executor.COMMAND):
        for key in ("create", "update", "delete"):
            text = resource.inputs.get(key)
            if text:
                moved = substitutions.script(text, resource=resource.name, etc_root="/e/n", state_dir="/r/n")
                assert not [word for word in substitutions.FORBIDDEN if word in moved], resource.name


def test_the_scripts_polls_and_measurements_run_on_the_lab_clock(onprem):
    """The lab's render paces the scripts' own waits (substitutions.script_clock): the verify's
    5 s service poll, ping's 0.2 s interval and iperf3's 3 s on a 1/30 clock, and says so."""
    rendered, made = onprem
    assert substitutions.SCRIPT_CLOCK_NOTE in made
    verify = rendered.named("worker-1-verify").inputs["create"]
    assert re.search(r"^\s*sleep 0\.167$", verify, re.MULTILINE)
    assert "-i 0.2 " not in verify and "ping -n -c 5 -i 0.01 -W 1" in verify
    assert "-t 1 -P" in verify and "-t 3 " not in verify
    assert not re.search(r"^\s*sleep \d+$", verify, re.MULTILINE)


def test_script_clock_changes_only_the_polls_and_measurements():
    text = (
        'set -e\n  sleep 5\nsleep 1 && echo later\nping -n -c 5 -i 0.2 -W 1 "$ip"\n'
        "iperf3 -c x -p 1 -t 3 -P 4 -J\n    sleep 2\n\n  sleep 3\t\n\necho sleep 9\n"
    )
    paced = substitutions.script_clock(text, 1 / 30)
    assert paced.splitlines() == [
        "set -e",
        "  sleep 0.167",
        "sleep 1 && echo later",  # not a whole-line sleep: left as written
        'ping -n -c 5 -i 0.01 -W 1 "$ip"',
        "iperf3 -c x -p 1 -t 1 -P 4 -J",
        "    sleep 0.1",  # 2/30 s, raised to the floor
        "",  # blank lines around a sleep stay
        "  sleep 0.1",
        "",
        "echo sleep 9",
    ]
    assert substitutions.script_clock(text, 1.0) == text


def test_each_node_stages_under_its_own_lock(onprem):
    """The staging's flock on /run/lock is a host's own; the lab's namespaces share this
    machine's /run/lock, so each node's lock moves into its lab dir: four nodes, four locks
    (one shared lock would make every node's pull wait for the others')."""
    rendered, _ = onprem
    stages = [
        resource for resource in rendered.of_type(executor.COMMAND) if resource.name.endswith("-model-stage")
    ]
    assert len(stages) == 4
    locks = set()
    for resource in stages:
        state = f"/r/{resource.name}"
        moved = substitutions.script(
            resource.inputs["create"], resource=resource.name, etc_root="/e", state_dir=state
        )
        locks |= set(re.findall(r"exec 9>(\S+)", moved))
        assert f"exec 9>{state}/{substitutions.NODE_LOCK_DIR}/qwen-cluster-stage.lock" in moved
    assert len(locks) == 4


def test_a_command_over_the_kernels_argument_limit_fails_as_sshd_would(onprem, tmp_path):
    """sshd runs a command as `$SHELL -c '<the command>'`: one argument, which Linux caps at
    128 KiB. The lab's ssh client holds it as one argument too, so it fails to start here as it
    would on a host; the step says why (nothing runs: the limit hits before any connection)."""
    import dataclasses

    rendered, _ = onprem
    preflight = rendered.named("master-preflight")
    text = "#!/usr/bin/env bash\n" + "# padding\n" * (executor.MAX_ARG_STRLEN // 10)
    huge = dataclasses.replace(preflight, inputs={**preflight.inputs, "create": text})
    host = standins.Host(
        node="master",
        namespace="qcl-no-such-namespace",
        ip="192.168.1.100",
        etc_root=str(tmp_path / "etc"),
        state_dir=str(tmp_path / "state"),
        bin_dir=str(tmp_path / "bin"),
    )
    client = sshd.Client("qcl-no-such-namespace", tmp_path / "id_ed25519")
    engine = executor.Executor({"192.168.1.100": host}, log_dir=tmp_path / "scripts", ssh=client)
    step = engine.run_op("create", huge, rendered)
    assert not step.ok
    assert step.detail == (
        f"the command is {len(text.encode())} bytes, over Linux's limit of 131072 for one argument "
        "or environment string: a host's sshd could not run it either"
    )


def test_a_disaggregated_model_container_serves_its_nixl_ports_so_the_holder_leaves_them():
    """The lab's holder listens on every probed port no container serves: on NIXL's side channel it
    took the real server's bind (`Address already in use`, the decode side's handshakes lost)."""
    from tooling.changes import edit

    raw = edit.apply_changes(
        stackfile.read("onprem"),
        [
            "serving.mode=disaggregated",
            'serving.prefill={"nodes":["master","worker-1"]}',
            'serving.decode={"nodes":["worker-2","worker-3"]}',
            "bareMetal.gpuModel=H100",
        ],
    )
    rendered, _ = executor.render(raw, "onprem", 1 / 30)
    for node in ("master", "worker-2"):
        container = standins.Container.from_inputs(node, rendered.named(f"{node}-model-vllm").inputs)
        assert standins.serves(container) == [5000, 5600, 5601, 5680]


def test_a_kv_aware_model_container_serves_its_events_port_so_the_holder_leaves_it():
    """With loadBalancer.routing kv-aware the holder took the events publisher's 5557 first and the
    real server's engine died at bind (`ZMQError: Address already in use`), restarting in a loop."""
    from tooling.changes import edit

    raw = edit.apply_changes(stackfile.read("onprem"), ["loadBalancer.routing=kv-aware"])
    rendered, _ = executor.render(raw, "onprem", 1 / 30)
    container = standins.Container.from_inputs("master", rendered.named("master-model-vllm").inputs)
    assert standins.serves(container) == [5000, 5557]


def _kv_aware(flags: dict | None = None) -> dict:
    config = stackfile.read("onprem")
    balancer = config.get("qwen-cluster:loadBalancer", {})
    config["qwen-cluster:loadBalancer"] = {**balancer, "routing": "kv-aware"}
    if flags is not None:
        config["qwen-cluster:model"] = {**config.get("qwen-cluster:model", {}), "vllmFlags": flags}
    return config


def test_the_real_vllm_gets_a_block_size_its_cpu_build_takes_on_the_replicas_and_the_router_alike():
    """kv-aware renders --block-size 16 by default, which the CPU build refuses; the lab changes
    the stack's key, so the router's --kv-event-block-size follows (a server-line change alone
    would leave the router hashing other blocks than the events name)."""
    config, made = substitutions.real_vllm_config(_kv_aware())
    assert len(made) == 1 and "-> 128" in made[0]
    rendered, _ = executor.render(config, "onprem", 1 / 30)
    command = [str(word) for word in rendered.named("router-router").inputs["command"]]
    assert command[command.index("--kv-event-block-size") + 1] == "128"
    for node in ("master", "worker-1"):
        assert "--block-size=128" in str(rendered.named(f"{node}-model-vllm").inputs)
    # A stack's own block size, and a stack that is not kv-aware, are left alone.
    own = _kv_aware({"--block-size": 64})
    assert substitutions.real_vllm_config(own) == (own, [])
    assert substitutions.real_vllm_config(stackfile.read("onprem"))[1] == []


def test_a_real_model_labs_engines_get_cores_of_their_own_by_default(monkeypatch):
    """Left to vLLM, every engine of a 2-core machine binds core 0, and the replicas starve each
    other (93-94 of 96 requests on one replica, whatever the routing); the stand-in needs none."""
    from labkit.cluster import blueprint, lifecycle

    monkeypatch.setattr(lifecycle.os, "cpu_count", lambda: 2)
    plan = blueprint.load("onprem", nodes=2, label="cores")
    real = lifecycle.engine_cores(plan, lifecycle.Options(real_model=True))
    assert real == {str(head.ip): core for head, core in zip(plan.heads, (0, 1), strict=True)}
    assert lifecycle.engine_cores(plan, lifecycle.Options()) == {}
