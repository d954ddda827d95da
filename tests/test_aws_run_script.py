"""The model-server run (qwen_cluster/render/ssm.py) on a node, against stand-in docker and aws
commands (tests/helpers/ssm_run.py): a new stack's replicas start without waiting for a model
load; a replica that served is drained first, only once every other registered target is in
service, and gates its lane on /health; a pipeline worker drains its replica's head before it
restarts."""

from __future__ import annotations

import contextlib
import http.server
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwen_cluster.render import ssm
from tests.helpers.http_thread import in_thread
from tests.helpers.ssm_run import Node
from tooling import stackfile

TARGET_GROUP = "arn:aws:elasticloadbalancing:tg/heads"
TARGET = "Id=i-0head,Port=5000"
REGISTER = f"elbv2 register-targets --target-group-arn {TARGET_GROUP} --targets {TARGET}"
DEREGISTER = "elbv2 de" + REGISTER.removeprefix("elbv2 ")


def parameters(node_name: str = "master", pipeline: int = 1) -> dict[str, str]:
    from qwen_cluster import config
    from tests.helpers.aws_stacks import variant

    cluster = config.validate(stackfile.cluster_keys(variant("prod", model={"pipelineParallel": pipeline})))
    values = ssm.parameters(
        cluster, node_name, target_group_arn=TARGET_GROUP, target_id="i-0head"
    )
    return {name: str(value) for name, value in values.items()}


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def test_on_a_new_stack_the_head_starts_registers_and_returns_without_waiting_for_health(node):
    run = node.run(parameters())
    assert run.returncode == 0, run.output
    assert run.called("docker run") and run.called(REGISTER)
    assert not (run.called("curl") or run.called("deregister-targets") or run.called("target-in-service"))


def test_a_head_that_served_is_drained_before_its_container_goes_and_waits_for_health(node):
    node.runs("an-older-configuration")
    node.serving()
    run = node.run(parameters(), health_seconds=60)
    assert run.returncode == 0, run.output
    assert run.index("deregister-targets") < run.index("wait target-deregistered") < run.index("docker rm")
    assert run.index("docker run") < run.index("curl") < run.index("elbv2 register-targets") < run.index(
        "target-in-service"
    )


def test_a_head_that_served_drains_only_once_every_other_target_is_in_service(node):
    # The other replica still loads (its target `initial`, as after a day 0 that did not wait),
    # then it is in service: only then may this one leave (rollout.maxUnavailable 1).
    node.runs("an-older-configuration")
    node.serving()
    node.out_of_service("i-0other", "i-0other", "")
    run = node.run(parameters(), health_seconds=60)
    assert run.returncode == 0, run.output
    asked = [n for n, call in enumerate(run.calls) if "describe-target-health" in call and "initial" in call]
    assert len(asked) == 3 and all("i-0head" in run.calls[n] for n in asked)
    assert asked[-1] < run.index("deregister-targets") < run.index("docker stop")


def test_a_head_whose_other_targets_stay_out_of_service_fails_and_keeps_serving(node):
    node.runs("an-older-configuration")
    node.serving()
    node.out_of_service("i-0other")
    run = node.run(parameters(), health_seconds=0)
    assert run.returncode == 1
    assert "i-0other" in run.output and "rollout.maxUnavailable" in run.output, run.output
    assert not (run.called("deregister-targets") or run.called("docker stop") or run.called("docker run"))


def test_a_new_head_joining_a_serving_cluster_waits_for_health(node):
    node.healthy_targets(3)
    node.serving()
    run = node.run(parameters(), health_seconds=60)
    assert run.returncode == 0 and run.called("curl") and run.called("target-in-service"), run.output
    assert not run.called("deregister-targets")


def test_a_head_that_never_answers_health_fails_the_run_and_stays_out(node):
    node.runs("an-older-configuration")
    run = node.run(parameters(), health_seconds=0)
    assert run.returncode == 1
    assert "rollout.healthTimeoutSeconds" in run.output and "its lane stops here" in run.output
    assert run.called("deregister-targets") and not run.called("elbv2 register-targets")


def test_an_unchanged_serving_head_is_not_restarted_or_drained(node):
    values = parameters()
    node.runs(values["ConfigHash"])
    node.serving()
    run = node.run(values, health_seconds=60)
    assert run.returncode == 0, run.output
    assert not run.called("docker run") and not run.called("deregister-targets")


def test_a_pipeline_worker_drains_its_replicas_head_before_it_restarts(node):
    node.runs("an-older-configuration")
    run = node.run(parameters("worker-1", pipeline=2))
    assert run.returncode == 0, run.output
    assert run.called(DEREGISTER)
    assert run.index("deregister-targets") < run.index("docker rm") < run.index("docker run")
    assert not run.called("curl") and not run.called("elbv2 register-targets")


def test_a_replicas_members_share_one_hash_so_a_worker_change_restarts_its_head():
    assert parameters("worker-1", pipeline=2)["ConfigHash"] == parameters("master", pipeline=2)["ConfigHash"]


# --- with vLLM's router (loadBalancer.routing cache-aware) ----------------------------------


class _Router(http.server.BaseHTTPRequestHandler):
    """A stand-in for vllm-router 0.1.17's admin routes: POST /remove_worker?url= and
    /add_worker?url= answer 200 "Successfully ..." (as measured with the wheel), or the status
    in `status`; each call is logged in the node's call log, in order with the run's own."""

    calls: Path
    status = 200

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        with self.calls.open("a") as log:
            log.write(f"router POST {self.path}\n")
        body = f"Successfully handled {self.path}".encode() if self.status == 200 else b"boom"
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def router_at(node: Node, status: int = 200) -> Iterator[str]:
    handler = type("Handler", (_Router,), {"calls": node.root / "calls", "status": status})
    with in_thread(http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)) as port:
        yield f"127.0.0.1:{port}"


def routed_parameters(address: str, node_name: str = "master", pipeline: int = 1) -> dict[str, str]:
    from qwen_cluster import config
    from tests.helpers.aws_stacks import variant

    raw = variant("prod", model={"pipelineParallel": pipeline}, loadBalancer={"routing": "cache-aware"})
    cluster = config.validate(stackfile.cluster_keys(raw))
    values = ssm.parameters(cluster, node_name, target_group_arn=TARGET_GROUP, target_id="i-0head")
    return {**{name: str(value) for name, value in values.items()}, "RouterAddress": address}


def test_a_routed_head_leaves_the_router_before_it_drains_and_rejoins_after_its_gate(node):
    node.runs("an-older-configuration")
    node.healthy_targets(1)
    node.serving()
    with router_at(node) as address:
        parameters = routed_parameters(address)
        run = node.run(parameters, health_seconds=5, routed=True)
    assert run.returncode == 0, run.output
    worker = parameters["RouterWorker"]
    remove, add = f"router POST /remove_worker?url={worker}", f"router POST /add_worker?url={worker}"
    assert run.index(remove) < run.index("deregister-targets") < run.index("docker rm")
    assert run.index("docker run") < run.index("curl") < run.index(add) < run.index("elbv2 register-targets")
    assert f"router: remove {worker}: ok" in run.output and f"router: add {worker}: ok" in run.output


def test_a_routed_pipeline_worker_takes_its_heads_url_out_of_the_router(node):
    node.runs("an-older-configuration")
    with router_at(node) as address:
        parameters = routed_parameters(address, "worker-1", pipeline=2)
        run = node.run(parameters, routed=True)
    assert run.returncode == 0, run.output
    head_url = routed_parameters(address, "master", pipeline=2)["RouterWorker"]
    assert parameters["RouterWorker"] == head_url
    assert run.index(f"router POST /remove_worker?url={head_url}") < run.index("deregister-targets")
    assert not run.called("/add_worker")


def test_a_router_that_is_not_running_is_passed_over(node):
    """Nothing listens at the router's address: each proxy sends to its own vLLM meanwhile, and
    a router that starts takes its workers from its command line."""
    node.runs("an-older-configuration")
    node.healthy_targets(1)
    node.serving()
    with router_at(node) as address:
        pass  # closed: its port refuses now
    run = node.run(routed_parameters(address), health_seconds=5, routed=True)
    assert run.returncode == 0, run.output
    assert run.called("deregister-targets") and run.called("elbv2 register-targets")
    assert f"router: {address} does not answer (not running, or its node is gone); skipping leave" in (
        run.output
    )
    assert "skipping join" in run.output


def test_a_router_that_refuses_the_removal_stops_the_run_before_the_drain(node):
    """The replica is never stopped while the router may still send it requests."""
    node.runs("an-older-configuration")
    node.healthy_targets(1)
    node.serving()
    with router_at(node, status=500) as address:
        run = node.run(routed_parameters(address), health_seconds=5, routed=True)
    assert run.returncode != 0
    assert run.called("/remove_worker")
    assert not run.called("deregister-targets") and not run.called("docker rm")


# --- with the router in P/D mode (serving.mode disaggregated) -------------------------------


class _PdRouter(http.server.BaseHTTPRequestHandler):
    """A stand-in for vllm-router 0.1.17 in P/D mode: GET /workers lists the worker healthy unless
    the node's proxy answers its health checks 503, i.e. while the proxy's drain file exists (the
    router's health checker, measured with the wheel); admin calls are logged (the run makes none)."""

    calls: Path
    drain_file: Path
    worker: str

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        healthy = "false" if self.drain_file.exists() else "true"
        with self.calls.open("a") as log:
            log.write(f"router GET {self.path} healthy={healthy}\n")
        body = f'{{"workers":[{{"url":"{self.worker}","worker_type":"prefill","is_healthy":{healthy}}}]}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        with self.calls.open("a") as log:
            log.write(f"router POST {self.path}\n")
        self.send_response(400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def pd_parameters(address: str) -> dict[str, str]:
    from qwen_cluster import config
    from tests.helpers.aws_stacks import variant

    serving = {"mode": "disaggregated", "prefill": {"nodes": ["master", "worker-1"]}}
    raw = variant("prod", serving={**serving, "decode": {"nodes": ["worker-2", "worker-3"]}})
    cluster = config.validate(stackfile.cluster_keys(raw))
    values = ssm.parameters(cluster, "master", target_group_arn=TARGET_GROUP, target_id="i-0head")
    return {**{name: str(value) for name, value in values.items()}, "RouterAddress": address}


def test_a_pd_head_leaves_the_routers_choice_through_its_proxy_and_comes_back_after_its_gate(node):
    node.runs("an-older-configuration")
    node.healthy_targets(1)
    node.serving()
    drain_file = node.root / "etc" / "proxy" / "drain.conf"
    worker = pd_parameters("x")["RouterWorker"]
    handler = type(
        "Handler", (_PdRouter,), {"calls": node.root / "calls", "drain_file": drain_file, "worker": worker}
    )
    with in_thread(http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)) as port:
        run = node.run(pd_parameters(f"127.0.0.1:{port}"), health_seconds=5, routed=True, pd=True)
    assert run.returncode == 0, run.output
    out = run.index("router GET /workers healthy=false")
    assert run.index("docker kill --signal=HUP qwen-proxy") < out < run.index("deregister-targets")
    assert run.index("docker run") < run.index("curl") < run.index("router GET /workers healthy=true")
    assert f"router: {worker} is unhealthy" in run.output and f"router: {worker} is healthy" in run.output
    assert not run.called("router POST") and not drain_file.exists()
