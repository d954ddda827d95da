"""The lab's executor without namespaces: the render it runs, its order, its substitutions."""

from __future__ import annotations

import pytest

from labkit import executor, sshd, standins, substitutions
from tooling import stackfile


@pytest.fixture(scope="module")
def onprem():
    rendered, made = executor.render(stackfile.read("onprem"), "onprem", 1 / 30)
    return rendered, made


def test_the_render_puts_the_stack_on_the_lab_clock_and_hosts(onprem):
    rendered, made = onprem
    assert "loadBalancer.idleTimeoutSeconds 3600 -> 120 (lab clock)" in made
    assert any(line.startswith("tuning.rdma true -> false") for line in made)
    assert "proxy_read_timeout 120s;" in rendered.named("load-balancer-config").inputs["create"]


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


def test_nginx_conf_moves_the_image_paths_and_the_mounts():
    text = (
        "user nginx;\npid /var/run/nginx.pid;\nerror_log /var/log/nginx/error.log;\n"
        "include /etc/nginx/up.conf;\n"
    )
    moved = substitutions.nginx_conf(text, run_dir="/r", mounts={"/etc/nginx/up.conf": "/h/up.conf"})
    assert moved == "pid /r/nginx.pid;\nerror_log /r/nginx/error.log;\ninclude /h/up.conf;\n"


def test_every_host_path_of_the_program_is_moved_and_none_is_left(onprem):
    rendered, _ = onprem
    for resource in rendered.of_type(executor.COMMAND):
        for key in ("create", "update", "delete"):
            text = resource.inputs.get(key)
            if text:
                moved = substitutions.script(text, resource=resource.name, etc_root="/e/n", state_dir="/r/n")
                assert not [word for word in substitutions.FORBIDDEN if word in moved], resource.name


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
