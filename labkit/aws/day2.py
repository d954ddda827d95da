"""Day 2 on the AWS lab: a change applied to the running lab under client load (new parameters
put, new nodes prepared as EC2 would launch them, the changed resources in the engine's order),
with the replicas out of the load balancer watched and the SSM runs reported."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

from labkit.aws import elb, model, settings, ssmrun
from labkit.aws.engine import AwsUp, apply, delete, not_succeeded, record_runs, target_state
from labkit.aws.machine import Machine
from labkit.aws.nodes import context, engines, lab_options, machines_up, node_etc, pulled_images, shut_down
from labkit.aws.settings import DEPLOYER_KEY, AwsLabError, AwsPlan, build, lab_config, s3_uri, weights_bucket
from labkit.aws.standins import api_add_nodes, lab_weights
from labkit.cluster import endpoint, lifecycle
from labkit.cluster.blueprint import Member
from labkit.engine import executor, substitutions
from labkit.hosts import netns
from qwen_cluster.config import NAMESPACE
from tooling import offline, stackfile


class TargetWatch:
    """The replica heads out of the load balancer (HAProxy not sending them connections), sampled
    every `interval` seconds: the most out at one moment."""

    def __init__(self, socket_path: str, heads: dict[str, str], interval: float = 0.1):
        self.socket_path, self.heads, self.interval = socket_path, heads, interval  # id -> node
        self.max_out, self.out_at_max, self.samples = 0, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                status = elb.haproxy_status(self.socket_path)
                out = [
                    node for target, node in self.heads.items() if not status.get(target, "").startswith("UP")
                ]
                self.samples += 1
                if len(out) > self.max_out:
                    self.max_out, self.out_at_max = len(out), out
            self.stop.wait(self.interval)

    def __enter__(self) -> TargetWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _parameter_updates(aws_plan: AwsPlan, stack: model.AwsStack, names: set[str]) -> list[str]:
    """PutParameter (Overwrite) for the changed parameters, as the provider updates `value`."""
    import boto3

    def call() -> list[str]:
        session = boto3.session.Session(aws_access_key_id=DEPLOYER_KEY, aws_secret_access_key="lab",
                                        region_name=stack.region)  # fmt: skip
        client = session.client("ssm", endpoint_url=f"https://{aws_plan.api.ip}",
                                verify=str(aws_plan.root / "endpoint" / "tls" / "ca.pem"))  # fmt: skip
        done = []
        for name in sorted(names):
            parameter = stack.parameters[name]
            client.put_parameter(Name=parameter["name"], Value=parameter["value"] or "-",
                                 Type=parameter["type"], Overwrite=True)  # fmt: skip
            done.append(parameter["name"])
        return done

    return netns.call_in(aws_plan.api.namespace, call)


def upgrade(label: str, changes: list[str], *, max_requests: int = 300) -> dict[str, Any]:
    """Apply `changes` to the running AWS lab under client load; the figures of labkit/cluster/upgrade.py
    plus the SSM runs (every document on every node)."""
    from labkit.cluster import upgrade as bare_upgrade
    from tooling import changes as change_syntax

    state = executor.load_state(lifecycle.state_file_for(label))
    if state is None:
        raise AwsLabError(f"lab {label} is not up (no applied state): run `lab.py up` first")
    saved = settings.saved_settings(label)
    settings.clock = saved["clock"]
    new_config = change_syntax.apply_changes(state.config, changes)
    cluster = stackfile.validate(new_config)
    aws_plan = build(cluster, label, new_config, saved["stack"])
    identity = endpoint.ensure(aws_plan.root / "endpoint", aws_plan.plan.load_balancer.ip)
    raw, _ = lab_config(new_config)
    rendered, _ = executor.render(raw, aws_plan.stack, settings.clock, None, identity)
    stack, machines = context(aws_plan, rendered)
    diff = executor.changes_between(state.render, rendered)
    acting = {name for name, change in diff.items() if change.action in ("create", "replace", "update")}
    parameters = {name for name in acting if name in stack.parameters}
    # A new value raises the parameter's version, which the associations reading it carry
    # (components/aws/proxy.py: SecretsVersion; replaced on change): the mocks compute no
    # version, so the lab follows the ARN to them.
    changed_arns = {stack.parameters[name]["arn"] for name in parameters}
    acting |= {
        name
        for name, association in stack.associations.items()
        if changed_arns & set(association.parameters.values())
    }
    old_plan = build(stackfile.validate(state.config), label, state.config, saved["stack"])
    before = {m.node for m in old_plan.plan.nodes}
    added = [m for m in aws_plan.plan.nodes if m.node not in before]
    staying = {m.node for m in aws_plan.plan.nodes}
    leaving = {m.node: m for m in old_plan.plan.nodes if m.node not in staying}
    removed = {name for name, change in diff.items() if change.action == "delete"}
    old_stack = model.read(state.render, stack.region, s3_uri(old_plan.plan.cluster))
    at_termination: dict[str, str] = {}

    def terminate(instance: model.Instance) -> str:
        seen = target_state(aws_plan, old_stack.target_group.arn, instance.instance_id)
        at_termination[instance.node] = seen
        return f"target {instance.instance_id}: {seen} at termination; " + shut_down(
            old_plan, leaving[instance.node]
        )

    prepared = _prepare(aws_plan, rendered, stack, machines, identity, added)
    # The replicas of the stack before the change: a node being added is not "out"; one still
    # loading after `up` is (clients have it no more than a drained one).
    heads = {stack.instances[m.node].instance_id: m.node for m in aws_plan.plan.heads if m.node in before}
    key = client_key(identity, state.config, new_config)
    load = bare_upgrade.LoadSettings(
        max_requests=max_requests, access=lifecycle.client_access(aws_plan.plan, key)
    )
    started = time.monotonic()
    with (
        TargetWatch(str(aws_plan.root / "haproxy.sock"), heads) as watch,
        bare_upgrade.ClientLoad(aws_plan.plan, load) as clients,
    ):
        time.sleep(0.3)  # the load is flowing before anything changes
        if parameters:
            _parameter_updates(aws_plan, stack, parameters)
        report = apply(aws_plan, rendered, stack, machines, only=acting - parameters)
        if report.ok and removed:
            report.steps += delete(aws_plan, state.render, old_stack, removed, terminate)
        time.sleep(0.3)
    seconds = time.monotonic() - started
    runs = record_runs(aws_plan, report, stack)
    executor.save_state(lifecycle.state_file(aws_plan.plan), new_config, rendered, {})
    outcomes = clients.outcomes
    ran = [step for step in report.steps if step.op != "same"]
    nodes = [m.node for m in aws_plan.plan.nodes]
    return {
        "requests": len(outcomes),
        "failed": sum(1 for o in outcomes if not o.ok and not o.cut),
        "streamsCut": sum(1 for o in outcomes if o.cut),
        "maxReplicasDown": watch.max_out,
        "seconds": round(seconds, 2),
        "steps": [
            {
                "resource": s.resource,
                "op": s.op,
                "node": s.node,
                "ok": s.ok,
                "at": s.started,
                "seconds": s.seconds,
                **({} if s.ok else {"detail": s.detail[-500:]}),
            }  # fmt: skip
            for s in ran
        ],
        "ok": report.ok,
        "lanes": [[replica.head.name for replica in lane] for lane in cluster.rollout_lanes],
        "ssm": {
            "documents": runs,
            "everyDocumentOnEveryNode": all(
                all(table.get(node) == ssmrun.SUCCESS for node in nodes)
                for document, table in runs.items()
                if document != "nodeProxy"
            )
            and all(runs.get("nodeProxy", {}).get(m.node) == ssmrun.SUCCESS for m in aws_plan.plan.heads),
            # This change's runs that did not succeed, with the end of their output (what
            # `get-command-invocation` shows): why a document is not Success above.
            "notSucceeded": not_succeeded(report, stack),
            # Association -> node -> status of this change's runs, State Manager's own included
            # (a tag-targeted association on an instance that came to match it).
            "runs": _runs_by_association(report),
        },
        "parametersUpdated": sorted(stack.parameters[name]["name"] for name in parameters),
        "nodesAdded": [m.node for m in added],
        "nodesRemoved": sorted(leaving),
        # What DescribeTargetHealth said of each removed node's target as its instance was
        # terminated: `unused` once drained and out of the group, `draining` while it drains.
        "targetAtTermination": at_termination,
        "clientKey": key,  # the lab key the client load used: one the stack accepts after the change
        "prepared": prepared,
        # Where a failed rollout stopped, and the replicas whose model-server run never started
        # (they serve what they served before).
        "stoppedAt": [f"{s.resource}: {_last_line(s.detail)}" for s in ran if not s.ok],
        "replicasNotReached": [
            m.node
            for m in aws_plan.plan.heads
            if f"gpu-nodes-{m.node}-server" in acting
            and f"gpu-nodes-{m.node}-server" not in {s.resource for s in ran}
        ],
        "failures": [
            f"{'stream' if o.streamed else 'chat'} at {o.started:.2f} s: {o.error or o.status}"
            for o in outcomes
            if not o.ok
        ][:20],  # fmt: skip
    }


def client_key(identity: endpoint.Identity, before: dict[str, Any], after: dict[str, Any]) -> int:
    """The lab key the clients use during a change: one the stack accepts before and after it
    (a rotation that keeps none: the new one)."""

    def accepted(config: dict[str, Any]) -> list[str]:
        copy = json.loads(json.dumps(config))
        substitutions.endpoint_secrets(copy, identity)
        keys = (copy.get(f"{NAMESPACE}:access") or {}).get("apiKeys") or []
        return [key.get("secure") if isinstance(key, dict) else key for key in keys]

    old, new = accepted(before), accepted(after)
    indexes = range(len(identity.api_keys))
    both = [i for i in indexes if identity.api_keys[i] in old and identity.api_keys[i] in new]
    return (both or [i for i in indexes if identity.api_keys[i] in new] or [0])[0]


def _prepare(
    aws_plan: AwsPlan,
    rendered: offline.Render,
    stack: model.AwsStack,
    machines: dict[str, Machine],
    identity: endpoint.Identity,
    added: list[Member],
) -> dict[str, Any]:
    """Before the change is applied: every image it pulls in the lab's registry (a new tag), and
    for nodes added to the stack the machines EC2 would launch: namespace, disk, Docker engine,
    IMDS and role in the API stand-in, a server in HAProxy (in maintenance until registered).
    What they run then (first boot, associations, registration) is the apply's."""
    started = time.monotonic()
    options = lab_options(settings.clock)
    if added:
        machines_up(aws_plan)  # new links; every member's routes to the new addresses
        bucket = weights_bucket(stack.weights_uri)
        node_etc(aws_plan, stack.region, bucket[0] if bucket else None)
    engines(aws_plan, machines, options)
    published = lifecycle.publish_images(aws_plan.plan, options, rendered, pulled_images(stack))
    if added:
        bucket = weights_bucket(stack.weights_uri)
        api_add_nodes(aws_plan, stack, identity, lab_weights(aws_plan.root) if bucket else None)
        for member in added:
            instance = stack.instances[member.node]
            elb.add_server(str(aws_plan.root / "haproxy.sock"), stack.target_group, instance.instance_id,
                           member.ip, settings.clock)  # fmt: skip
    return {"seconds": round(time.monotonic() - started, 2), "images": published}


def _last_line(detail: str) -> str:
    lines = [line for line in detail.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _runs_by_association(report: AwsUp) -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}
    for name, run in report.all_runs():
        table.setdefault(name, {}).update({i.instance: i.status for i in run.invocations})
    return table
