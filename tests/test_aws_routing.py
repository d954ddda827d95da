"""The dev stack with loadBalancer.routing cache-aware, rendered offline: one vLLM router on the
master (an SSM document and association), each head's proxy sending to it with its own vLLM as
backup and listening for it on the router-worker row, the model-server runs leaving and
rejoining the router, the ports member-only (security groups and the policy pack), and a
least-conn stack rendering none of it."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess

import pytest

from labkit.cluster import probes
from labkit.models import modelserver
from qwen_cluster import config, ports
from qwen_cluster.render import nginx, proxy, router, router_ssm, ssm
from qwen_cluster.render.monitoring import alerts, endpoint
from tests.helpers import aws_stacks, tools
from tests.helpers.baremetal import shellcheck
from tests.helpers.configs import TEST_API_KEY
from tests.helpers.policy_fixtures import aws_stack, ingress
from tests.helpers.standin_server import free_port, serving
from tests.helpers.wait import wait_until
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
    # The proxy's conf is the one main rendered before routing: its own vLLM alone.
    for head in DEV.topology.heads:
        assert proxy.conf(DEV, head.name) == nginx.render(
            [("127.0.0.1", DEV.model_port)],
            listen_port=DEV.model_port,
            listen_address=str(head.ip),
            idle_timeout_seconds=DEV.load_balancer.idle_timeout_seconds,
            api_keys=bool(DEV.access.api_keys),
            tls=DEV.load_balancer.tls is not None,
        )


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


@tools.needs("nginx")
def test_through_a_real_proxy_the_router_serves_and_a_dead_router_degrades_to_the_nodes_vllm(tmp_path):
    """The master's rendered proxy conf on loopback (the Debian nginx), a stand-in router and a
    stand-in vLLM: clients go to the router while it serves, the health check and the router's
    listener to this node's vLLM only, and with the router gone every request still succeeds on
    this node's vLLM."""
    head = CACHE_AWARE.master
    front, listener = free_port(), free_port()
    for sub in ("logs", "state"):
        (tmp_path / sub).mkdir()
    (tmp_path / nginx.KEYS_FILE).write_text(nginx.keys_conf([TEST_API_KEY]))
    router_context = serving(modelserver.Settings(node="router"))
    with (
        serving(modelserver.Settings(node="vllm")) as (vllm_port, vllm_server),
        contextlib.ExitStack() as stack,
    ):
        router_port, router_server = stack.enter_context(router_context)
        conf = (
            proxy.conf(CACHE_AWARE, head.name)
            .replace("user nginx;\n", "")
            .replace("/var/log/nginx", str(tmp_path / "logs"))
            .replace("/var/cache/nginx", str(tmp_path / "state"))
            .replace("/var/run/nginx.pid", str(tmp_path / "nginx.pid"))
            .replace(f"listen {head.ip}:{CACHE_AWARE.model_port};", f"listen 127.0.0.1:{front};")
            .replace(f"listen {head.ip}:30001;", f"listen 127.0.0.1:{listener};")
            .replace(f"server {head.ip}:30000 ", f"server 127.0.0.1:{router_port} ")
            .replace(f"server 127.0.0.1:{CACHE_AWARE.model_port}", f"server 127.0.0.1:{vllm_port}")
        )
        assert f"127.0.0.1:{router_port}" in conf and f"listen 127.0.0.1:{front};" in conf
        (tmp_path / "nginx.conf").write_text(conf)
        process = subprocess.Popen(
            ["nginx", "-p", f"{tmp_path}/", "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_until(
                lambda: probes.tcp_connect("127.0.0.1", front, timeout=0.2).open,
                what="the proxy listening on loopback",
                timeout=10,
            )
            keyed = probes.ClientAccess(api_key=TEST_API_KEY)

            def reached(server) -> dict[str, int]:
                return {path: count for (path, _), count in server.stats.requests.items() if count}

            assert [
                probes.request("127.0.0.1", front, "GET", "/v1/models", access=keyed).status for _ in range(6)
            ] == [200] * 6
            # (The stand-in counts a request once its answer is sent.)
            wait_until(lambda: reached(router_server) == {"/v1/models": 6}, what="6 on the router", timeout=5)
            assert reached(vllm_server) == {}
            # The NLB's health check: this node's vLLM, not the router.
            assert probes.request("127.0.0.1", front, "GET", "/health").status == 200
            wait_until(lambda: "/health" in reached(vllm_server), what="/health on this vLLM", timeout=5)
            assert "/health" not in reached(router_server)
            # The router's way in: no key, this vLLM only, never back to the router.
            assert probes.request("127.0.0.1", listener, "GET", "/v1/models").status == 200
            wait_until(lambda: reached(vllm_server).get("/v1/models") == 1, what="1 on this vLLM", timeout=5)
            assert reached(router_server) == {"/v1/models": 6}
            stack.close()  # the router is gone: refused connections from here on
            statuses = [
                probes.request("127.0.0.1", front, "GET", "/v1/models", access=keyed).status for _ in range(6)
            ]
            assert statuses == [200] * 6
            wait_until(lambda: reached(vllm_server)["/v1/models"] == 7, what="6 more on this vLLM", timeout=5)
        finally:
            process.terminate()
            process.wait(timeout=10)


def test_the_routers_document_declares_its_parameters_and_the_values_fit_its_patterns():
    import re

    document = json.loads(router_ssm.document())
    values = router_ssm.parameters(CACHE_AWARE)
    assert set(values) == set(document["parameters"]) == set(router_ssm.PARAMETERS)
    for name, value in values.items():
        assert re.fullmatch(document["parameters"][name]["allowedPattern"].strip("^$"), value), name
    # The change plan tells a model-server restart by this name; the router's run is not one.
    assert ssm.CONFIG_HASH_PARAMETER not in values


KV_AWARE_CONFIG = aws_stacks.variant("dev", loadBalancer={"routing": "kv-aware"})
KV_AWARE = config.validate(stackfile.cluster_keys(KV_AWARE_CONFIG))


def test_kv_aware_renders_the_routers_sources_and_the_heads_publishers_and_passes_the_pack():
    render = aws_stacks.render(KV_AWARE_CONFIG)
    argv = _decoded(render.named("router-master").inputs["parameters"]["Command"]).splitlines()
    assert argv == router.command(KV_AWARE)
    sources = [argv[i + 1] for i, word in enumerate(argv) if word == "--kv-event-source"]
    assert sources == [f"http://{head.ip}:30001=tcp://{head.ip}:5557" for head in KV_AWARE.topology.heads]
    scripts = [
        _decoded(association.inputs["parameters"]["ServerScript"])
        for association in render.of_type("aws:ssm/association:Association")
        if "ServerScript" in association.inputs.get("parameters", {})
    ]
    assert scripts and all("tcp://*:5557" in script and "--block-size=16" in script for script in scripts)
    assert policy_harness.mandatory(policy_harness.analyze_render(render, cluster=KV_AWARE)) == []


KV_WIDER = [
    ingress(
        "fail_kv_events_from_lb_sg",
        "dev-node-sg",
        referencedSecurityGroupId="dev-lb-sg-id",
        ipProtocol="tcp",
        fromPort=5557,
        toPort=5557,
    ),
    ingress(
        "fail_kv_events_world",
        "dev-node-sg",
        cidrIpv4="0.0.0.0/0",
        ipProtocol="tcp",
        fromPort=5557,
        toPort=5557,
    ),
    ingress(
        "fail_kv_events_from_monitoring",
        "dev-node-sg",
        cidrIpv4="10.20.0.0/16",
        ipProtocol="tcp",
        fromPort=5557,
        toPort=5557,
    ),
]


def test_the_policy_pack_refuses_the_kv_events_port_opened_wider():
    violations = policy_harness.analyze(aws_stack() + KV_WIDER, cluster=KV_AWARE)
    refused = {v.resource for v in violations if v.policy == "port-exposure"}
    assert refused == {r.name for r in KV_WIDER}
