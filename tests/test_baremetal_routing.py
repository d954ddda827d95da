"""The onprem stack with loadBalancer.routing cache-aware, rendered offline: vLLM's router beside
nginx on the load-balancer host, nginx sending to it with the replicas as backups, the rollout
taking replicas out of the router and back, and the policy pack still clean."""

from __future__ import annotations

import pytest

from qwen_cluster import ports, tags
from qwen_cluster.render import firewall, nginx, router
from tests.helpers.baremetal import ONPREM, ONPREM_CACHE_AWARE, cache_aware_stack, shellcheck
from tooling import offline, policy_harness


@pytest.fixture(scope="module")
def render() -> offline.Render:
    return offline.render(cache_aware_stack(), "onprem")


def test_the_router_runs_on_the_load_balancer_host_with_host_networking(render):
    container = render.named("router-router")
    assert container.inputs["name"] == router.CONTAINER_NAME
    assert container.inputs["image"] == router.IMAGE
    assert container.inputs["networkMode"] == "host"
    assert container.inputs["command"] == router.command(ONPREM_CACHE_AWARE)
    assert {"label": tags.CONTAINER_ROLE_LABEL, "value": tags.ROUTER_CONTAINER} in container.inputs["labels"]
    lb = ONPREM_CACHE_AWARE.load_balancer_node.name
    assert render.named("router-image").provider.split("::")[-1] == f"{lb}-model-docker-id"


def test_nginx_sends_to_the_router_with_the_replicas_as_backups(render):
    script = render.named("load-balancer-config").inputs["create"]
    assert "server 127.0.0.1:30000 max_fails=3 fail_timeout=30s;" in script
    assert 'flag=" backup"' in script


def test_nginx_leaves_the_routers_address_for_the_rollout(render):
    script = render.named("load-balancer-config").inputs["create"]
    line = "127.0.0.1:30000 127.0.0.1:29000"  # the API, then the metrics listener
    assert f"printf '%s\\n' '{line}' >\"$conf_dir/{nginx.ROUTER_FILE}.new\"" in script


def test_each_drain_leaves_the_router_and_each_gate_rejoins_it(render):
    for head in ONPREM_CACHE_AWARE.topology.heads:
        worker = router.worker_url(str(head.ip), ONPREM_CACHE_AWARE.model_port)
        drain = render.named(f"{head.name}-drain").inputs["update"]
        gate = render.named(f"{head.name}-ready").inputs["update"]
        assert "router_leave\nif server_flag" in drain
        assert worker in drain and worker in gate
        # Back in nginx first, then in the router's worker set, both after the health wait.
        assert gate.index("until [") < gate.index("  mark up") < gate.index("\nrouter_join\n")


def test_least_conn_renders_no_router_at_all():
    """A stack that does not route by cache runs the scripts it ran before routing existed: no
    router call, no router file, no router container, nothing that would drain a replica or
    reload anything on a program upgrade (scripts/plan.py onprem --against <older commit>)."""
    least_conn = offline.render_stack("onprem")
    texts = [str(value) for r in least_conn.custom_resources for value in r.inputs.values()]
    assert not [t for t in texts if "router" in t or nginx.ROUTER_FILE in t]
    assert not least_conn.of_type("docker:index/container:Container") or all(
        c.inputs["name"] != router.CONTAINER_NAME
        for c in least_conn.of_type("docker:index/container:Container")
    )


def test_the_heads_serve_the_routes_the_router_tokenizes_through(render):
    for head in ONPREM_CACHE_AWARE.topology.heads:
        assert "--enable-scale-out" in render.named(f"{head.name}-model-vllm").inputs["command"][0]
    assert (
        "--enable-scale-out"
        not in offline.render_stack("onprem").named("master-model-vllm").inputs["command"][0]
    )


def test_the_router_starts_after_every_replicas_gate_and_nothing_waits_for_it_but_the_checks(render):
    graph = render.dependencies()
    gates = {f"{head.name}-ready" for head in ONPREM_CACHE_AWARE.topology.heads}
    assert gates <= graph["router-router"]
    assert not [name for name, deps in graph.items() if "router-router" in deps and name != "cluster-started"]


def test_the_rollout_scripts_are_shellcheck_clean(render, tmp_path):
    head = ONPREM_CACHE_AWARE.topology.heads[0].name
    for name, key in ((f"{head}-drain", "update"), (f"{head}-ready", "update"), (f"{head}-ready", "delete")):
        shellcheck(render.named(name).inputs[key], tmp_path)


def test_the_policy_pack_passes_the_cache_aware_stack(render):
    violations = policy_harness.analyze_render(render, cluster=ONPREM_CACHE_AWARE)
    assert policy_harness.mandatory(violations) == []


def test_the_router_row_opens_nothing_new_in_the_host_firewall():
    """A cluster row is reached through the all-traffic rule between members alone: the firewall
    rules, and the document the pack reads from them, are the least-conn stack's."""
    for node in ONPREM_CACHE_AWARE.nodes:
        rules = firewall.host_rules(ONPREM_CACHE_AWARE, node.name)
        assert rules == firewall.host_rules(ONPREM, node.name)
        assert firewall.policy_document(ONPREM_CACHE_AWARE, node.name, rules) == firewall.policy_document(
            ONPREM, node.name, rules
        )


def test_only_members_may_reach_the_routers_port():
    expectations = ports.reachability(
        ONPREM_CACHE_AWARE.ports, listener_port=ONPREM_CACHE_AWARE.load_balancer.port, ssh_to_nodes=True
    )
    opened = {e.vantage for e in expectations if e.name == ports.ROUTER and e.open}
    assert opened == {ports.Vantage.NODE}


def test_the_summary_says_how_requests_are_routed(render):
    endpoint = render.outputs["summary"]["endpoint"]
    assert endpoint["routing"] == "cache-aware"
    assert endpoint["router"] == {
        "image": router.IMAGE,
        "node": "master",
        "listen": "127.0.0.1:30000",
        "balanceThresholds": {"absolute": 4, "relative": 1.25},
    }
    assert offline.render_stack("onprem").outputs["summary"]["endpoint"]["router"] is None
