"""The dev stack with loadBalancer.routing cache-aware, rendered offline: one vLLM router on the
master (an SSM document and association), each head's proxy sending to it with its own vLLM as
backup and listening for it on the router-worker row, the model-server runs leaving and
rejoining the router, the ports member-only (security groups and the policy pack), and a
least-conn stack rendering none of it."""

from __future__ import annotations

import base64
import json

import pytest

from qwen_cluster import config, ports
from qwen_cluster.render import proxy, router, router_ssm, ssm
from qwen_cluster.render.monitoring import alerts, endpoint
from tests.helpers import aws_stacks
from tests.helpers.baremetal import shellcheck
from tests.helpers.policy_fixtures import aws_stack, ingress
from tooling import offline, policy_harness, stackfile

CACHE_AWARE_CONFIG = aws_stacks.variant("dev", loadBalancer={"routing": "cache-aware"})
CACHE_AWARE = config.validate(stackfile.cluster_keys(CACHE_AWARE_CONFIG))
DEV = stackfile.load("dev")


@pytest.fixture(scope="module")
def render() -> offline.Render:
    return aws_stacks.render(CACHE_AWARE_CONFIG)


def _decoded(value: str) -> str:
    return base64.b64decode(value).decode()


def test_one_router_runs_on_the_master_with_the_heads_proxy_listeners_as_workers(render):
    association = render.named("router-master")
    master_server = render.named(f"gpu-nodes-{CACHE_AWARE.master.name}-server")
    assert association.inputs["targets"] == master_server.inputs["targets"]
    argv = _decoded(association.inputs["parameters"]["Command"]).splitlines()
    assert argv == router.command(CACHE_AWARE)
    assert argv[argv.index("--host") + 1] == str(CACHE_AWARE.master.ip)
    workers = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    assert workers == [f"http://{head.ip}:30001" for head in CACHE_AWARE.topology.heads]
    # Metrics stay on loopback.
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert association.inputs["parameters"]["Image"] == router.IMAGE
    document = json.loads(render.named("router-document").inputs["content"])
    assert document == json.loads(router_ssm.document())
    assert (
        len([a for a in render.of_type("aws:ssm/association:Association") if a.name.startswith("router-")])
        == 1
    )


def test_each_proxy_sends_to_the_router_with_its_own_vllm_as_backup(render):
    master_ip = CACHE_AWARE.master.ip
    for head in CACHE_AWARE.topology.heads:
        conf = _decoded(render.named(f"node-proxy-{head.name}").inputs["parameters"]["NginxConf"])
        assert f"server {master_ip}:30000 max_fails=3 fail_timeout=30s;" in conf
        assert "server 127.0.0.1:5000 max_fails=3 fail_timeout=30s backup;" in conf
        # The router's way in: the node's address, the router-worker row, to this vLLM only.
        listener = conf[conf.index("upstream qwen_local") :]
        assert f"listen {head.ip}:30001;" in listener
        assert "server 127.0.0.1:5000;" in listener
        assert str(master_ip) + ":30000" not in listener and "qwen_model" not in listener


def test_a_least_conn_proxy_and_model_server_render_no_router_at_all():
    least_conn = aws_stacks.render_stack("dev")
    texts = [json.dumps(r.inputs, default=str) for r in least_conn.custom_resources]
    decoded = [
        _decoded(value)
        for r in least_conn.of_type("aws:ssm/association:Association")
        for key, value in r.inputs.get("parameters", {}).items()
        if key in ("NginxConf",)
    ]
    assert not [t for t in texts + decoded if "router" in t.lower() or "30000" in t or "30001" in t]
    assert proxy.conf(DEV, "master") == proxy.conf(DEV, "master").replace("backup", "")


def test_the_model_server_runs_leave_the_router_before_the_drain_and_rejoin_after_the_gate(render):
    document = json.loads(render.named("model-server-document").inputs["content"])
    run = "\n".join(document["mainSteps"][0]["inputs"]["runCommand"])
    assert run == ssm.run_script(routed=True).rstrip("\n")
    assert set(ssm.ROUTED_PARAMETERS) <= set(document["parameters"])
    leave, deregister = run.index("router_step router_leave"), run.index("aws elbv2 deregister-targets")
    health, join = (
        run.index('until curl --silent --fail --max-time 5 "$URL"'),
        run.index("router_step router_join"),
    )
    register = run.index("  aws elbv2 wait target-in-service")
    assert leave < deregister and health < join < register
    for head in CACHE_AWARE.topology.heads:
        parameters = render.named(f"gpu-nodes-{head.name}-server").inputs["parameters"]
        assert parameters["RouterAddress"] == f"{CACHE_AWARE.master.ip}:30000"
        assert parameters["RouterWorker"] == f"http://{head.ip}:30001"


def test_a_pipeline_worker_names_its_heads_worker_url():
    cluster = config.validate(
        stackfile.cluster_keys(
            aws_stacks.variant("prod", loadBalancer={"routing": "cache-aware"}, model={"pipelineParallel": 2})
        )
    )
    replica = cluster.topology.replicas[0]
    parameters = ssm.parameters(cluster, replica.workers[0].name)
    assert parameters["RouterWorker"] == f"http://{replica.head.ip}:30001"


def test_the_least_conn_model_server_document_is_mains_to_the_byte():
    """No routed parameter, no router call: a least-conn stack's document and config hash are
    what they were before routing existed (scripts/plan.py dev --against <older commit>)."""
    assert "router" not in ssm.document() and "router" not in ssm.run_script()
    assert not set(ssm.ROUTED_PARAMETERS) & set(ssm.parameters(DEV, "master"))


def test_the_routed_scripts_are_shellcheck_clean(tmp_path):
    shellcheck(ssm.shell_check_text(ssm.run_script(routed=True)), tmp_path)
    shellcheck(router_ssm.shell_check_text(), tmp_path)


def test_the_ports_are_member_only_and_add_no_security_group_rule(render):
    assert aws_stacks.rule_set(render) == aws_stacks.rule_set(aws_stacks.render_stack("dev"))
    expectations = ports.reachability(
        CACHE_AWARE.ports, listener_port=CACHE_AWARE.load_balancer.port, ssh_to_nodes=True
    )
    for name in (ports.ROUTER, ports.ROUTER_WORKER):
        assert {e.vantage for e in expectations if e.name == name and e.open} == {ports.Vantage.NODE}


def test_the_policy_pack_passes_the_cache_aware_stack(render):
    violations = policy_harness.analyze_render(render, cluster=CACHE_AWARE)
    assert policy_harness.mandatory(violations) == []


WIDER = [
    ingress(
        "fail_router_from_lb_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-lb-sg-id",
        ipProtocol="tcp",
        fromPort=30000,
        toPort=30000,
    ),
    ingress(
        "fail_router_from_clients",
        "dev-node-sg",
        cidrIpv4="10.0.0.0/8",
        ipProtocol="tcp",
        fromPort=30000,
        toPort=30000,
    ),
    ingress(
        "fail_router_worker_world",
        "dev-node-sg",
        cidrIpv4="0.0.0.0/0",
        ipProtocol="tcp",
        fromPort=30001,
        toPort=30001,
    ),
    ingress(
        "fail_router_worker_from_monitoring",
        "dev-node-sg",
        cidrIpv4="10.20.0.0/16",
        ipProtocol="tcp",
        fromPort=30001,
        toPort=30001,
    ),
]


def test_the_policy_pack_refuses_the_routers_ports_opened_wider():
    violations = policy_harness.analyze(aws_stack() + WIDER, cluster=CACHE_AWARE)
    refused = {v.resource for v in violations if v.policy == "port-exposure"}
    assert refused == {r.name for r in WIDER}


def test_the_master_scrapes_the_router_and_the_alerts_apply():
    sources = endpoint.aggregator_config(CACHE_AWARE, CACHE_AWARE.master.name)["sources"]
    assert {"name": "router", "url": "http://127.0.0.1:29000/metrics"} in sources
    names = {alert.name for alert in alerts.alerts(CACHE_AWARE)}
    assert {"QwenRouterDown", "QwenRouterLostWorkers"} <= names
    assert not {"QwenRouterDown", "QwenRouterLostWorkers"} & {alert.name for alert in alerts.alerts(DEV)}


def test_doctor_names_a_router_that_is_not_running_on_the_master():
    from qwen_cluster.render import nodecheck

    section = nodecheck.router_section(CACHE_AWARE, CACHE_AWARE.master.name)
    assert "qwen-router" in section and "each proxy sends to its own vLLM" in section
    worker = next(node.name for node in CACHE_AWARE.nodes if node.name != CACHE_AWARE.master.name)
    assert nodecheck.router_section(CACHE_AWARE, worker) == ""
    assert nodecheck.router_section(DEV, DEV.master.name) == ""


def test_the_summary_says_where_the_router_listens(render):
    assert render.outputs["summary"]["endpoint"]["router"]["listen"] == f"{CACHE_AWARE.master.ip}:30000"
    assert render.outputs["summary"]["endpoint"]["router"]["node"] == CACHE_AWARE.master.name
