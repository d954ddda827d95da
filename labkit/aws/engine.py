"""The Pulumi engine's order over an AWS render in the lab: each resource when what it depends on
has finished (instances boot, associations run, attachments register), and the SSM runs kept
across `up` and `upgrade`."""

from __future__ import annotations

import json
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from labkit.aws import model, ssmrun
from labkit.aws.machine import Machine
from labkit.aws.settings import DEPLOYER_KEY, AwsPlan
from labkit.engine.executor import StepResult
from labkit.hosts import netns
from tooling import offline


@dataclass
class AwsUp:
    steps: list[StepResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: dict[str, ssmrun.AssociationRun] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)


def deployer_call(aws_plan: AwsPlan, action: str, target_group: str, target: str, port: int) -> str:
    """An ELBv2 call as `pulumi up` makes it (the deployer's credentials), from the admin side."""
    import boto3

    def call() -> str:
        session = boto3.session.Session(aws_access_key_id=DEPLOYER_KEY, aws_secret_access_key="lab",
                                        region_name=aws_plan.plan.cluster.aws.region)  # fmt: skip
        client = session.client(
            "elbv2",
            endpoint_url=f"https://{aws_plan.api.ip}",
            verify=str(aws_plan.root / "endpoint" / "tls" / "ca.pem"),
        )
        getattr(client, action)(TargetGroupArn=target_group, Targets=[{"Id": target, "Port": port}])
        return f"{action} {target}"

    return netns.call_in(aws_plan.api.namespace, call)


def apply(aws_plan: AwsPlan, rendered: offline.Render, stack: model.AwsStack, machines: dict[str, Machine],
          only: set[str] | None = None) -> AwsUp:  # fmt: skip
    """Run the render's resources in the engine's order; `only`: the resources that changed."""
    report = AwsUp()
    graph = rendered.dependencies()
    names = [r.name for r in rendered.custom_resources if only is None or r.name in only]
    by_name = {r.name: r for r in rendered.custom_resources}
    instance_of = {instance.resource: instance for instance in stack.instances.values()}
    pending = {name: {d for d in graph.get(name, set()) if d in names} for name in names}
    done: set[str] = set()
    failed = False
    t0 = time.monotonic()

    def step(name: str) -> StepResult:
        resource = by_name[name]
        started = time.monotonic() - t0
        if name in instance_of:
            instance = instance_of[name]
            status, code, output = machines[instance.node].first_boot()
            ok = status == ssmrun.SUCCESS
            detail = f"user data: {status} (exit {code})\n{output[-400:]}"
            result = StepResult(instance.node, "boot", ok, detail, resource=name, op="create")
        elif name in stack.associations:
            association = stack.associations[name]
            run = ssmrun.run(association, stack.documents[association.document], stack.instances,
                             lambda inst, planned: machines[inst.node].run_steps(inst, planned))  # fmt: skip
            report.runs[name] = run
            waited = association.wait_seconds is not None
            nodes = ",".join(i.instance for i in run.invocations) or "-"
            tail = "\n".join(
                f"{i.instance}: {i.status} exit {i.exit_code}\n{i.output[-600:]}" for i in run.invocations
            )
            detail = f"{run.status} {run.detail}\n{tail}"
            # Not waited for: the create returns before the run; a failed run does not stop `up`.
            result = StepResult(nodes, "association", run.status == ssmrun.SUCCESS or not waited, detail,
                                resource=name, op="create")  # fmt: skip
        elif resource.type == model.TG_ATTACHMENT:
            target, port = stack.registrations[name]
            detail = deployer_call(aws_plan, "register_targets", stack.target_group.arn, target, port)
            result = StepResult("-", "register", True, detail, resource=name, op="create")
        else:
            result = StepResult("-", "api", True, "held by the API stand-in", resource=name, op="same")
        result.started, result.seconds = round(started, 3), round(time.monotonic() - t0 - started, 3)
        return result

    with ThreadPoolExecutor(max_workers=8) as pool:
        running: dict[Future, str] = {}
        while pending or running:
            if not failed:
                for name in [n for n, deps in pending.items() if deps <= done]:
                    del pending[name]
                    running[pool.submit(step, name)] = name
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                try:
                    result = future.result()
                except Exception as error:  # the lab's own failure, named
                    result = StepResult(
                        "-", "lab", False, f"{type(error).__name__}: {error}", resource=name, op="create"
                    )
                report.steps.append(result)
                done.add(name)
                if not result.ok:
                    failed = True
    return report


def record_runs(aws_plan: AwsPlan, report: AwsUp, stack: model.AwsStack) -> dict[str, dict[str, str]]:
    """Document -> node -> the status of its last run there, kept across `up` and `upgrade`."""
    path = aws_plan.root / "ssm-runs.json"
    table: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    for name, run in report.runs.items():
        document = document_role(stack, stack.associations[name].document)
        for invocation in run.invocations:
            table.setdefault(document, {})[invocation.instance] = invocation.status
    path.write_text(json.dumps(table, indent=1, sort_keys=True))
    return table


def not_succeeded(report: AwsUp, stack: model.AwsStack) -> list[dict[str, str]]:
    return [
        {
            "document": document_role(stack, stack.associations[name].document),
            "node": invocation.instance,
            "status": invocation.status,
            "output": invocation.output[-1500:],
        }
        for name, run in report.runs.items()
        for invocation in run.invocations
        if invocation.status != ssmrun.SUCCESS
    ]


def document_role(stack: model.AwsStack, name: str) -> str:
    """A document by what it does (its step's name): modelStage, modelServer, nodeProxy, monitoring."""
    steps = stack.documents.get(name, {}).get("mainSteps") or [{}]
    return str(steps[0].get("name") or name)
