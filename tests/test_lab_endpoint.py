"""The locked endpoint in the lab: through the load balancer from the client namespace, only the
OpenAI routes and /health reach a model server, only with a valid key, only over TLS 1.2/1.3;
keys rotate under load with no failed request and no model server restarted.

One lab (onprem, two nodes) for the whole module. Needs root and the lab's binaries.
"""

from __future__ import annotations

import os
import shutil

import pytest

from labkit import cli as lab_cli
from labkit.cluster import blueprint, check, lifecycle, probes, upgrade
from labkit.hosts import netns
from qwen_cluster.config import NAMESPACE
from qwen_cluster.ports import Vantage
from tests.helpers.wait import wait_until

LABEL = f"e{os.getpid() % 100000}"
BINARIES = ("ip", "nginx", "nft", "ufw", "sysctl", "openssl")
MISSING = netns.missing_requirements() + [f"{b} not installed" for b in BINARIES if not shutil.which(b)]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="; ".join(MISSING) or "ok")


@pytest.fixture(scope="module")
def lab():
    lifecycle.down(LABEL)
    lab_plan = blueprint.load("onprem", nodes=2, label=LABEL)
    options = lifecycle.Options(token_delay=0.01)
    try:
        up = lifecycle.up(lab_plan, options)
        assert up.ok, [(step.node, step.step, step.detail[-300:]) for step in up.steps if not step.ok]
        yield lab_plan, options, {result.what: result for result in check.endpoint(lab_plan)}
    finally:
        lifecycle.down(LABEL)


def test_a_command_without_nodes_works_on_the_two_node_lab_as_it_is(lab, capsys):
    """The lab was brought up with two nodes (the stack file has four): `check` without --nodes
    plans the lab as it runs, every namespace of it there; another --nodes is refused."""
    planned = lab_cli.lab_plan_for("onprem", label=LABEL, as_applied=True)
    assert [member.node for member in planned.nodes] == ["master", "worker-1"]
    assert all(netns.exists(member.namespace) for member in planned.nodes)
    assert lab_cli.main(["check", "onprem", "--label", LABEL, "--nodes", "4"]) == 2
    assert capsys.readouterr().out.strip() == (
        f"lab {LABEL} is up with 2 nodes, not --nodes 4: leave --nodes out, or `lab.py down` it first"
    )


def _failed(results) -> list:
    return [(r.what, r.observed) for r in results if not r.ok]


def test_the_default_rehearsal_runs_with_the_endpoint_locked(lab):
    lab_plan, _, _ = lab
    assert lab_plan.cluster.access.api_keys and not lab_plan.cluster.access.open_endpoint
    assert lifecycle.client_access(lab_plan).api_key and lifecycle.client_access(lab_plan).ca_file


def test_no_key_and_a_wrong_key_get_401_and_reach_no_model_server(lab):
    _, _, seen = lab
    wanted = (
        "POST /v1/chat/completions with no key",
        "POST /v1/chat/completions with a wrong key",
        "requests without a valid key",
    )
    assert _failed([seen[what] for what in wanted]) == []


def test_every_openai_route_and_health_reach_a_model_server_with_the_key(lab):
    _, _, seen = lab
    allowed = [result for what, result in seen.items() if result.expected == "reaches a model server"]
    assert len(allowed) == 7 and _failed(allowed) == []


def test_every_other_route_and_spelling_is_refused_and_reaches_no_model_server(lab):
    _, _, seen = lab
    refused = [result for result in seen.values() if result.expected == check.REFUSED]
    assert len(refused) == len(check.refused_requests())
    assert _failed(refused) == []
    assert seen[f"{len(refused)} refused requests"].ok, seen[f"{len(refused)} refused requests"].observed


def test_the_key_never_reaches_a_model_server(lab):
    _, _, seen = lab
    assert seen["Authorization headers received"].ok, seen["Authorization headers received"].observed


def test_tls_1_0_and_1_1_handshakes_are_refused_by_the_server(lab):
    _, _, seen = lab
    for version in ("TLSv1", "TLSv1.1"):
        result = seen[f"{version} handshake"]
        # The server's alert, not this client declining to offer the version.
        assert not result.ok or "ALERT" in result.observed or "UNSUPPORTED" in result.observed, result
        assert result.ok, result.observed
    assert seen["TLSv1.2 handshake"].ok and seen["TLSv1.3 handshake"].ok


def _config_with_keys(lab_plan, keys: list[str]) -> dict:
    config = lifecycle.stack_config(lab_plan)
    access = dict(config[f"{NAMESPACE}:access"])
    access["apiKeys"] = list(keys)
    return {**config, f"{NAMESPACE}:access": access}


def _model_pids(lab_plan) -> dict[str, str]:
    """Each node's model container, as its id and when it last started (a restart changes it)."""
    return {
        f"{member.node}/{name}": f"{shown['Id']} {shown['State']['StartedAt']}"
        for member in lab_plan.nodes
        for name, shown in lifecycle.containers(lab_plan, member, "model").items()
    }


def test_rotating_keys_under_load_fails_no_request_restarts_no_model_server_and_refuses_the_old_key(lab):
    lab_plan, options, _ = lab
    identity = lifecycle.endpoint_identity(lab_plan)
    old, new = identity.api_keys[0], identity.api_keys[1]
    pids = _model_pids(lab_plan)
    load = upgrade.LoadSettings(max_requests=60, rate=20.0, workers=2, stream_every=3, stream_tokens=5)

    def rotate(keys: list[str], client_key: int) -> list[upgrade.Outcome]:
        settings = upgrade.LoadSettings(**{**load.__dict__, "access": identity.client(client_key)})
        with upgrade.ClientLoad(lab_plan, settings) as clients:
            report = lifecycle.apply(lab_plan, options, config=_config_with_keys(lab_plan, keys))
            assert report.ok, [(s.node, s.step, s.detail[-300:]) for s in report.steps if not s.ok]
        return clients.outcomes

    # Add the new key while clients use the old one, then move them and remove the old key.
    during_add = rotate([old, new], client_key=0)
    # As an operator does before moving the clients: the new key answers. nginx's reload is a
    # signal: for a moment after `pulumi up` returns, an old worker may still take a connection.
    client = lab_plan.vantage(Vantage.CLIENT).namespace
    ip, port = lab_plan.load_balancer.ip, lab_plan.cluster.load_balancer.port

    def five_with_key(index: int) -> list[int]:
        access = identity.client(index)
        return [netns.call_in(client, probes.chat, ip, port, access=access).status for _ in range(5)]

    wait_until(
        lambda: five_with_key(1),
        what="five requests in a row with the new key answered 200",
        timeout=10,
        done=lambda statuses: statuses == [200] * 5,
    )
    during_remove = rotate([new], client_key=1)
    for outcomes in (during_add, during_remove):
        assert outcomes and [o.error or o.status for o in outcomes if not o.ok] == []
    assert _model_pids(lab_plan) == pids
    # The same signal the other way: once the reload is through (a clean-clone run at load
    # average 7 saw one 200 for the old key just after the apply returned), the old key is
    # refused, and stays refused.
    wait_until(
        lambda: five_with_key(0),
        what="five requests in a row with the old key refused 401",
        timeout=10,
        done=lambda statuses: statuses == [401] * 5,
    )
    assert five_with_key(0) == [401] * 5 and five_with_key(1) == [200] * 5
