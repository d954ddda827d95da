"""`lab.py check` for an AWS stack: what the running AWS lab shows, as labkit/cluster/check.py Results.

What applies from the bare-metal check, run as it is: containment (no route off the lab) and
the nodes' latency. The rest is the AWS side's own, read from what runs:
- every SSM document's last run Success on every node it targets (`ssm-runs.json`, kept by
  `up` and `upgrade`), and the model-server and proxy containers running on each node's dockerd;
- the NLB: every replica head in service in HAProxy (the target group's health check passed),
  every replica answering through it with the lab's key over TLS, none without a key (401), and
  a stream with a silent thinking pause just over nginx's default read timeout (on the lab clock)
  not cut by the NLB's idle timeout or the node's proxy.
Not run here, as they have no AWS counterpart in the lab: the rendered bare-metal verify script,
the firewall's port probes and listeners (security groups are not enforced between
namespaces), iperf3 (a veth is this machine's CPU), the monitoring probes.
"""

from __future__ import annotations

import json
from pathlib import Path

from labkit.aws import elb, lab, ssmrun
from labkit.cluster import check, lifecycle, probes
from labkit.cluster.check import Result, _status
from labkit.engine import executor
from labkit.hosts import netns
from qwen_cluster.ports import Vantage
from qwen_cluster.render import proxy, ssm


def run(label: str) -> tuple[lab.AwsPlan, list[Result]]:
    state = executor.load_state(lifecycle.state_file_for(label))
    if state is None:
        raise lab.AwsLabError(f"lab {label} is not up (no applied state): run `lab.py up` first")
    settings = json.loads((Path(lab.STATE_ROOT) / label / lab.SETTINGS_FILE).read_text())
    from tooling import stackfile

    aws_plan = lab.build(stackfile.validate(state.config), label, state.config, settings["stack"])
    plan = aws_plan.plan
    options = lab.lab_options(settings["clock"])
    results = check.containment(plan) + check.latency(plan)
    results += ssm_runs(aws_plan) + containers(aws_plan)
    results += load_balancer(aws_plan, state.config, options)
    return aws_plan, results


def ssm_runs(aws_plan: lab.AwsPlan) -> list[Result]:
    path = aws_plan.root / "ssm-runs.json"
    table: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    results = []
    for document, runs in sorted(table.items()):
        for node, status in sorted(runs.items()):
            results.append(Result("ssm", node, node, f"{document} document", ssmrun.SUCCESS, status,
                                  _status(status == ssmrun.SUCCESS)))  # fmt: skip
    if not table:
        results.append(Result("ssm", "-", "-", "SSM runs", "recorded", f"none in {path}", "fail"))
    return results


def containers(aws_plan: lab.AwsPlan) -> list[Result]:
    """The model server (every node) and the proxy (every replica head), as each node's dockerd
    reports them."""
    plan = aws_plan.plan
    heads = {member.node for member in plan.heads}
    results = []
    for member in plan.nodes:
        try:
            found = lifecycle.containers(plan, member)
        except Exception as error:  # the engine does not answer: that is the finding
            found, detail = {}, f"{type(error).__name__}: {error}"
        else:
            detail = ""
        wanted = [ssm.CONTAINER_NAME, *([proxy.CONTAINER_NAME] if member.node in heads else [])]
        for name in wanted:
            entry = found.get(name)
            running = bool(entry and entry["State"].get("Running"))
            seen = (
                f"running ({entry['Image']})" if running else (detail or ("stopped" if entry else "absent"))
            )
            results.append(
                Result("containers", member.node, member.node, name, "running", seen, _status(running))
            )
    return results


def load_balancer(aws_plan: lab.AwsPlan, config: dict, options: lifecycle.Options) -> list[Result]:
    plan = aws_plan.plan
    lb, port = plan.load_balancer, plan.cluster.load_balancer.port
    client = plan.vantage(Vantage.CLIENT).namespace
    identity = lifecycle.endpoint_identity(plan)
    access = lifecycle.client_access(plan, lab.client_key(identity, config, config))
    results = []
    status = elb.haproxy_status(str(aws_plan.root / "haproxy.sock"))
    stack, _ = lab.context(aws_plan, executor.load_state(lifecycle.state_file(plan)).render)
    for head in plan.heads:
        seen = status.get(stack.instances[head.node].instance_id, "absent")
        results.append(Result("load balancer", lb.node, head.node, "target in service", "UP", seen,
                              _status(seen == "UP")))  # fmt: skip
    requests = check.SPREAD_PER_HEAD * len(plan.heads)
    spread = netns.call_in(client, probes.spread, lb.ip, port, requests, access=access)
    missing = [head.node for head in plan.heads if not spread.counts.get(head.node)]
    counts = ", ".join(f"{head.node} {spread.counts.get(head.node, 0)}" for head in plan.heads)
    results.append(Result("load balancer", "client", f"{lb.node}:{port}", f"{requests} requests",
                          "every replica answers, no failures",
                          counts + (f"; {len(spread.failures)} failed" if spread.failures else ""),
                          _status(not missing and not spread.failures)))  # fmt: skip
    if not plan.cluster.access.open_endpoint:
        bare = netns.call_in(
            client, probes.chat, lb.ip, port, "no key", access=lifecycle.client_access(plan, None)
        )
        results.append(Result("load balancer", "client", f"{lb.node}:{port}", "a request without a key",
                              "401", str(bare.status), _status(bare.status == 401)))  # fmt: skip
    scale = options.clock_scale
    pause = lifecycle.THINKING_PAUSE * scale
    seen = netns.call_in(client, probes.stream, lb.ip, port, headers={"X-Lab-Think": f"{pause:.3f}"},
                         timeout=pause + 30, access=access)  # fmt: skip
    first_ok = seen.first_event is not None and seen.end is not None and seen.first_event < seen.end
    observed = (
        f"first event {seen.first_event:.3f} s, [DONE] at {seen.end:.2f} s, {seen.tokens} tokens"
        if seen.ok and first_ok
        else (seen.error or f"HTTP {seen.status}")
    )
    results.append(Result("load balancer", "client", f"{lb.node}:{port}",
                          f"stream, silent {pause:.2f} s (= {pause / scale:.0f} s x{check.clock(scale)})",
                          "first event before the end; not cut", observed,
                          _status(seen.ok and first_ok and seen.longest_silence >= pause * 0.9)))  # fmt: skip
    return results
