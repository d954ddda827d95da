"""The lab for real: the onprem stack in network namespaces, checked, and broken on purpose.

Needs root, iproute2, ping, iperf3, nginx, nft and ufw (CI runs as root with them). The lab
goes up once for the module (its own label, so a developer's lab is left alone); every
fault test puts back what it broke; all traffic stays inside the lab's namespaces.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from labkit import cli as lab_cli
from labkit.cluster import blueprint, check, lifecycle, probes, renderers
from labkit.engine import executor, substitutions
from labkit.hosts import dockerd, netns
from labkit.images.imagesite import huggingface_hub as hub
from qwen_cluster.ports import Vantage
from qwen_cluster.render.firewall import Rule
from tests.helpers.wait import wait_until
from tooling import stackfile

ONPREM = stackfile.load("onprem")
LABEL = f"t{os.getpid() % 100000}"
BINARIES = ("ip", "ping", "iperf3", "nginx", "nft", "ufw")
MISSING = netns.missing_requirements() + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")
# nginx marks a replica failed for fail_timeout after max_fails; rejoining can take that long.
REJOIN_SECONDS = 40


def _host_snapshot() -> dict:
    """What the lab must never change on the host."""
    files = {}
    for root in ("/etc/ufw", "/etc/sysctl.d", "/etc/default/ufw", "/etc/nftables.conf", "/etc/sysctl.conf"):
        path = Path(root)
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                files[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    keys = sorted(ONPREM.tuning.sysctl)
    sysctl = subprocess.run(["sysctl", *keys], capture_output=True, text=True).stdout
    ruleset = subprocess.run(["nft", "-s", "list", "ruleset"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {"files": files, "sysctl": sysctl, "nft": ruleset, "bridges": "br0" in links.split()}


@pytest.fixture(scope="session")
def host_before() -> dict:
    return _host_snapshot()


@pytest.fixture(scope="module")
def running(host_before):
    """The module's one lab, shared by its tests; down before the next module's lab goes up."""
    lifecycle.down(LABEL)
    lab_plan = blueprint.build(ONPREM, LABEL)
    options = lifecycle.Options()
    try:
        report = lifecycle.up(lab_plan, options)
        yield lab_plan, options, report
    finally:
        lifecycle.down(LABEL)


def _client(lab_plan):
    return lab_plan.vantage(Vantage.CLIENT).namespace


def _lb(lab_plan):
    return lab_plan.load_balancer.ip, lab_plan.cluster.load_balancer.port


def _wait_for_rejoin(lab_plan, node: str) -> float:
    """Seconds until `node` answers again among 8 requests through the load balancer, none failing."""
    started = time.monotonic()
    wait_until(
        lambda: netns.call_in(
            _client(lab_plan), probes.spread, *_lb(lab_plan), 8, access=lifecycle.client_access(lab_plan)
        ),
        what=f"{node} back in the load balancer's rotation",
        timeout=REJOIN_SECONDS,
        interval=0.5,
        done=lambda spread: bool(spread.counts.get(node)) and not spread.failures,
    )
    return time.monotonic() - started


def _wait_for_replies(load: Load, count: int, what: str) -> None:
    already = len(load.replies)
    wait_until(
        lambda: len(load.replies) - already,
        what=f"{count} replies {what}",
        timeout=30,
        done=lambda replies: replies >= count,
    )


class Load:
    """Non-streaming requests from the client namespace, two at a time, until stopped."""

    def __init__(self, lab_plan, workers: int = 2):
        self.replies: list[probes.Reply] = []
        self.stop = threading.Event()
        ip, port = _lb(lab_plan)
        access = lifecycle.client_access(lab_plan)

        def body():
            while not self.stop.is_set():
                self.replies.append(probes.chat(ip, port, "under load", timeout=20, access=access))

        self.threads = [
            threading.Thread(target=netns.call_in, args=(_client(lab_plan), body)) for _ in range(workers)
        ]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def test_up_runs_every_rendered_step_on_every_node(running):
    lab_plan, _, report = running
    failed = [(step.node, step.step, step.detail[-300:]) for step in report.steps if not step.ok]
    assert not failed
    steps = {(step.node, step.step) for step in report.steps}
    for member in lab_plan.nodes:
        assert {(member.node, s) for s in ("preflight", "sysctl", "firewall", "model", "iperf3")} <= steps
    assert (lab_plan.load_balancer.node, "nginx") in steps


def test_every_node_staged_the_image_and_the_weights_into_its_host_cache(running):
    lab_plan, _, report = running
    ran = {step.resource: step for step in report.steps if step.resource}
    for member in lab_plan.nodes:
        state = lifecycle.node_state(lab_plan, member)
        # Pulled through the lab's registry into the node's own Docker engine.
        engine = lifecycle.daemon(lab_plan, member)
        assert dockerd.docker(engine, "image", "inspect", ONPREM.model.image, check=False).returncode == 0
        cache = substitutions.host_path(
            ONPREM.bare_metal.weights_cache, etc_root=lifecycle.node_etc(member), state_dir=state
        )
        fetched = json.loads((Path(cache) / hub.LAB_WEIGHTS_DIR / "Qwen--Qwen3-32B.json").read_text())
        assert fetched == {
            "model": "Qwen/Qwen3-32B",
            "image": ONPREM.model.image,
            "endpoint": "https://huggingface.co",
        }
        stage, server = ran[f"{member.node}-model-stage"], ran[f"{member.node}-model-vllm"]
        assert stage.ok and stage.started + stage.seconds <= server.started + 0.01


def test_up_runs_what_the_program_registered_in_the_engines_order(running):
    lab_plan, _, report = running
    rendered = executor.load_state(lifecycle.state_file(lab_plan)).render
    ran = {step.resource: step for step in report.steps if step.resource}
    assert set(ran) == {resource.name for resource in rendered.custom_resources}
    assert {ran[name].op for name in ran} == {"create"}
    for name, waits_for in executor.graph(rendered).items():
        for other in waits_for:
            assert ran[other].started + ran[other].seconds <= ran[name].started + 0.01, (other, name)
    # Independent hosts' chains ran side by side, as the engine runs them.
    firewalls = sorted((ran[f"{m.node}-firewall"].started, m.node) for m in lab_plan.nodes)
    assert (
        firewalls[-1][0]
        < ran[f"{firewalls[0][1]}-firewall"].started + ran[f"{firewalls[0][1]}-firewall"].seconds
    )


def test_check_is_green_from_every_vantage_and_speaks_json(running, capsys):
    status = lab_cli.main(["check", "onprem", "--label", LABEL, "--json"])
    document = json.loads(capsys.readouterr().out)
    # What failed, whole (the dicts' repr is cut where the observed value is).
    failures = [
        f"{r['group']} {r['source']}->{r['target']} {r['what']}: {r['observed']}"
        for r in document["results"]
        if r["status"] == "fail"
    ]
    assert status == 0 and document["ok"] and not failures, failures
    groups = {r["group"] for r in document["results"]}
    assert groups == {
        "containment",
        "sysctl",
        "verify",
        "ports",
        "listeners",
        "latency",
        "bandwidth",
        "load balancer",
        "endpoint",
        "monitoring",
    }
    sources = {r["source"] for r in document["results"] if r["group"] == "ports"}
    assert {"client", "monitoring", "admin", "outsider", "intruder", "master", "worker-3"} <= sources
    assert document["summary"].startswith("GREEN")


def test_no_listener_outside_the_port_table_from_a_member_or_any_vantage(running):
    """ss in every node's namespace, then a connect to every listener found from a member and
    from every vantage: nothing listens on a non-loopback address outside the table, each
    vantage reaches only what the table promises it, and the intruder on the node segment and
    the outsider reach nothing."""
    lab_plan, _, _ = running
    results = check.listeners(lab_plan)
    assert [r for r in results if not r.ok] == []
    vantages = {v.vantage.value for v in lab_plan.vantages}
    assert {r.source for r in results} == {*(n.node for n in lab_plan.nodes), *vantages}
    reached = {r.source: r.observed for r in results if r.target == "every node"}
    assert reached["intruder"] == reached["outsider"] == "nothing"
    lb = lab_plan.load_balancer
    assert reached["client"] == f"{lb.node}:{lab_plan.cluster.load_balancer.port}"
    where = lab_plan.cluster.monitoring_node
    scanned = next(r for r in results if r.source == where.name and r.target == where.name)
    assert f"{where.ip}:9090 (prometheus)" in scanned.observed  # the cluster address, not 0.0.0.0


def test_lab_leaves_the_host_network_and_etc_alone(running, host_before):
    now = _host_snapshot()
    assert now["files"] == host_before["files"]
    assert now["sysctl"] == host_before["sysctl"]
    assert now["nft"] == host_before["nft"]
    assert now["bridges"] == host_before["bridges"]
    for member in running[0].members:
        route = netns.run(["ip", "-n", member.namespace, "route", "show", "default"]).stdout
        assert route.strip() == "", f"{member.namespace} has a default route"


def _node_state(lab_plan) -> dict[str, tuple[str, str]]:
    state = {}
    for member in lab_plan.nodes:
        ruleset = netns.exec_in(member.namespace, ["nft", "-s", "list", "ruleset"]).stdout
        drop_in = netns.NETNS_ETC / member.namespace / "sysctl.d" / Path(renderers.SYSCTL_DROPIN).name
        state[member.node] = (ruleset, drop_in.read_text())
    return state


def _changed_chains(before: str, after: str) -> set[str]:
    chains, chain = set(), None
    for line in difflib.ndiff(before.splitlines(), after.splitlines()):
        text = line[2:].strip()
        if text.startswith("chain "):
            chain = text.split()[1]
        if line[:2] in ("- ", "+ "):
            chains.add(chain)
    return chains


def test_rerunning_every_command_changes_no_ruleset_and_no_drop_in(running):
    """Every registered command run again (as an in-place update runs it): a second run equals
    the third. The first ufw enable (inactive -> active) leaves ufw's own IPv6 rate-limit
    chains without their final rule; the reload of the second run completes them. Nothing
    else may differ, and nothing ever does after that."""
    lab_plan, options, _ = running
    first = _node_state(lab_plan)
    rerun = lifecycle.up(lab_plan, options, rerun=True)
    assert rerun.ok, [(s.node, s.step, s.resource, s.op, s.detail) for s in rerun.steps if not s.ok]
    second = _node_state(lab_plan)
    third_report = lifecycle.up(lab_plan, options, rerun=True)
    third = _node_state(lab_plan)
    assert third == second
    for node, (ruleset, drop_in) in first.items():
        assert drop_in == second[node][1]
        assert _changed_chains(ruleset, second[node][0]) <= {"ufw6-user-limit", "ufw6-user-limit-accept"}
    assert {step.detail for step in third_report.steps if step.step == "model"} == {"running"}


def _listen_on_ephemeral_port() -> socket.socket:
    server = socket.socket()
    server.bind(("0.0.0.0", 0))  # the kernel picks from ip_local_port_range, as NCCL's sockets do
    server.listen(8)
    return server


def _strict_rules(lab_plan, node: str) -> list[Rule]:
    """The guide's rule: 6000-6100/tcp between nodes, instead of the project's all-traffic rule."""
    rules = renderers.firewall_rules(lab_plan.cluster, node)
    strict = [r for r in rules if r.name != "cluster-all"]
    strict += [Rule("inter-node", r.source, "6000-6100", "tcp") for r in rules if r.name == "cluster-all"]
    return strict


@pytest.mark.parametrize("flavour", ["ufw", "nftables"])
def test_strict_6000_6100_rule_blocks_an_ephemeral_port_the_cluster_rule_admits(running, flavour):
    lab_plan, _, _ = running
    target, source = lab_plan.node("worker-1"), lab_plan.node("worker-2")
    server = netns.call_in(target.namespace, _listen_on_ephemeral_port)
    port = server.getsockname()[1]
    assert not 6000 <= port <= 6100
    try:
        rules = _strict_rules(lab_plan, target.node)
        strict = lifecycle.firewall(lab_plan, target, flavour=flavour, rules=rules)
        assert strict.ok, strict.detail
        blocked = netns.call_in(source.namespace, probes.tcp_connect, target.ip, port, 1.0)
        project = lifecycle.firewall(lab_plan, target, flavour=flavour)
        assert project.ok, project.detail
        admitted = netns.call_in(source.namespace, probes.tcp_connect, target.ip, port, 1.0)
    finally:
        server.close()
        if flavour == "nftables":  # back to the stack's own flavour alone
            from qwen_cluster.render import firewall as firewall_render

            revert = firewall_render.revert_script(
                "nftables",
                etc=lifecycle.node_etc(target),
                state_dir=lifecycle.node_state(lab_plan, target),
                persist=False,
            )
            netns.exec_in(target.namespace, ["bash", "-c", revert])
    assert not blocked.open and blocked.detail == "timeout", blocked
    assert admitted.open, admitted


def test_a_replica_killed_under_load_loses_no_request_and_rejoins(running):
    lab_plan, options, _ = running
    victim = lab_plan.node("worker-2")
    with Load(lab_plan) as load:
        _wait_for_replies(load, 4, "before the kill")
        lifecycle.stop_model_server(lab_plan, victim)
        # More requests than there are replicas: the balancer must have picked the dead one.
        _wait_for_replies(load, 3 * len(lab_plan.heads), f"with {victim.node}'s model server stopped")
        assert lifecycle.start_model_server(lab_plan, victim, options).ok
        _wait_for_replies(load, 4, f"after {victim.node}'s model server restarted")
    failed = [reply.error or reply.status for reply in load.replies if not reply.ok]
    assert not failed
    _wait_for_rejoin(lab_plan, victim.node)


def test_a_cut_link_costs_at_most_the_connect_timeout(running):
    lab_plan, _, _ = running
    victim = lab_plan.node("worker-3")
    # A request sent to the cut replica costs one connect timeout, then the next replica
    # answers. Under two timeouts: never two tries into the cut link, nor nginx's 60 s default;
    # the rest is left for the answer itself, which took 3.9 s once at load average 20.
    limit = 2 * renderers.nginx_connect_timeout_seconds()
    netns.run(["ip", "-n", lab_plan.switch, "link", "set", victim.switch_port, "down"])
    try:
        replies = [
            netns.call_in(
                _client(lab_plan),
                probes.chat,
                *_lb(lab_plan),
                f"cut {i}",
                timeout=30,
                access=lifecycle.client_access(lab_plan),
            )
            for i in range(8)
        ]
    finally:
        netns.run(["ip", "-n", lab_plan.switch, "link", "set", victim.switch_port, "up"])
    assert all(reply.ok for reply in replies), [reply.error or reply.status for reply in replies]
    assert max(reply.seconds for reply in replies) < limit, [round(reply.seconds, 2) for reply in replies]
    assert victim.node not in {reply.node for reply in replies}
    _wait_for_rejoin(lab_plan, victim.node)


def test_all_replicas_down_gives_a_prompt_502_or_503_and_recovers(running):
    lab_plan, options, _ = running
    for head in lab_plan.heads:
        lifecycle.stop_model_server(lab_plan, head)
    try:
        replies = [
            netns.call_in(
                _client(lab_plan),
                probes.chat,
                *_lb(lab_plan),
                timeout=15,
                access=lifecycle.client_access(lab_plan),
            )
            for _ in range(3)
        ]
    finally:
        for head in lab_plan.heads:
            assert lifecycle.start_model_server(lab_plan, head, options).ok
    assert [reply.status for reply in replies] in ([502] * 3, [503] * 3, [502, 503, 503], [502, 502, 503])
    # Prompt: every replica refuses at once, nothing waits out a connect timeout (2.6 s was
    # seen at load average 20, so the bound is the timeout, not a guess at the machine's speed).
    assert max(reply.seconds for reply in replies) < renderers.nginx_connect_timeout_seconds()
    waited = _wait_for_rejoin(lab_plan, lab_plan.heads[0].node)
    assert waited < REJOIN_SECONDS


def test_a_stack_that_fails_validation_builds_nothing(tmp_path, capsys):
    document = yaml.safe_load(stackfile.stack_path("onprem").read_text())
    document["config"]["qwen-cluster:nodes"][1]["ip"] = "192.168.2.5"  # outside network.cidr
    (tmp_path / "Pulumi.broken.yaml").write_text(yaml.safe_dump(document))
    status = lab_cli.main(["up", "broken", "--root", str(tmp_path)])
    output = capsys.readouterr().out
    assert status == 2 and "nothing built" in output and "192.168.2.5 is outside network.cidr" in output
    # Only this stack's: the other workers' labs come and go meanwhile (a clean-clone run saw
    # test_lab_upgrade's lab go down between a before and an after of the whole list).
    assert not [name for name in netns.listed() if name.startswith("qcl-broken")]
    assert not any(
        name.startswith("qcl-broken") for name in os.listdir("/run/netns") if os.path.isdir("/run/netns")
    )


def test_down_after_a_crash_finds_everything_by_its_prefix(running):
    """Last in the module: it takes the module's lab down (the fixture's own `down` then finds
    nothing left), rather than bringing up a lab of its own to crash."""
    lab_plan, _, _ = running
    label = lab_plan.label
    pids = [pid for member in lab_plan.members for pid in netns.pids(member.namespace)]
    marked = netns.marked_pids(label)  # dockerd, containerd, containers, sshd, registry, ...
    assert pids and len(marked) > len(pids)
    # A crash, and the namespaces deleted from outside: `down` knows only the label.
    for name in lab_plan.namespaces:
        netns.run(["ip", "netns", "del", name])
    lifecycle.down(label)
    assert not [name for name in netns.listed() if name.startswith(f"qcl-{label}-")]
    assert not [p for p in netns.NETNS_ETC.glob(f"qcl-{label}-*")]
    assert not Path(lab_plan.state_dir).exists()
    assert (
        not (lifecycle.DOCKER_DATA_ROOT / label).exists() and not (lifecycle.DOCKER_RUN_ROOT / label).exists()
    )
    assert not [pid for pid in {*pids, *marked} if _alive(pid)]
    assert netns.marked_pids(label) == []


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (killed, its exit status not yet collected by its parent,
    e.g. a daemon's init) is not alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
