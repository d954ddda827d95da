"""The Pulumi engine's order over an AWS render in the lab: each resource when what it depends on
has finished (instances boot, associations run, attachments register), the removed ones deleted
dependents first, and the SSM runs kept across `up` and `upgrade`."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from labkit.aws import model, ssmrun
from labkit.aws.machine import Machine
from labkit.aws.settings import DEPLOYER_KEY, AwsPlan
from labkit.engine.executor import StepResult, topological
from labkit.hosts import netns
from tooling import offline


@dataclass
class AwsUp:
    steps: list[StepResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: dict[str, ssmrun.AssociationRun] = field(default_factory=dict)
    # Runs of associations already in place on an instance that came to match their tag targets
    # (association resource, the run on that instance): no resource's create, State Manager's own.
    joined: list[tuple[str, ssmrun.AssociationRun]] = field(default_factory=list)

    def all_runs(self) -> list[tuple[str, ssmrun.AssociationRun]]:
        return [*self.runs.items(), *self.joined]

    @property
    def ok(self) -> bool:
        return all(step.ok for step in self.steps)


def _deployer_elbv2(aws_plan: AwsPlan):
    """An ELBv2 client with the deployer's credentials, to the lab's API stand-in (call it inside
    the API's namespace)."""
    import boto3

    session = boto3.session.Session(aws_access_key_id=DEPLOYER_KEY, aws_secret_access_key="lab",
                                    region_name=aws_plan.plan.cluster.aws.region)  # fmt: skip
    return session.client(
        "elbv2",
        endpoint_url=f"https://{aws_plan.api.ip}",
        verify=str(aws_plan.root / "endpoint" / "tls" / "ca.pem"),
    )


def deployer_call(aws_plan: AwsPlan, action: str, target_group: str, target: str, port: int) -> str:
    """An ELBv2 call as `pulumi up` makes it (the deployer's credentials), from the admin side."""

    def call() -> str:
        client = _deployer_elbv2(aws_plan)
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
        elif resource.type == LOCAL_COMMAND:
            inputs = model.substitute(resource.inputs, model.identities(rendered, stack.region))
            ok, detail = deployer_command(aws_plan, inputs, "create")
            result = StepResult("-", "local", ok, detail, resource=name, op="create")
        else:
            result = StepResult("-", "api", True, "held by the API stand-in", resource=name, op="same")
        result.started, result.seconds = round(started, 3), round(time.monotonic() - t0 - started, 3)
        return result

    def join(name: str, instance: model.Instance) -> None:
        association = stack.associations[name]
        run = ssmrun.run(association, stack.documents[association.document], {instance.node: instance},
                         lambda inst, planned: machines[inst.node].run_steps(inst, planned))  # fmt: skip
        report.joined.append((name, run))

    # State Manager applies an association whose targets are tags to an instance that comes to
    # match them, without any call (SSM API Reference, CreateAssociation: "For dynamic targets
    # ... State Manager ... applies the configuration when new managed nodes are added"): here
    # once the instance has booted, beside whatever the engine runs next.
    in_place = [
        name
        for name, association in stack.associations.items()
        if name not in names and any(str(t.get("key", "")).startswith("tag:") for t in association.targets)
    ]
    joining: dict[Future, str] = {}

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
                elif name in instance_of:
                    instance = instance_of[name]
                    for association in in_place:
                        if instance in ssmrun.targets(stack.associations[association], stack.instances):
                            joining[pool.submit(join, association, instance)] = association
        for future in wait(joining).done:
            future.result()
    return report


def record_runs(aws_plan: AwsPlan, report: AwsUp, stack: model.AwsStack) -> dict[str, dict[str, str]]:
    """Document -> node -> the status of its last run there, kept across `up` and `upgrade`."""
    path = aws_plan.root / "ssm-runs.json"
    table: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    for name, run in report.all_runs():
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
        for name, run in report.all_runs()
        for invocation in run.invocations
        if invocation.status != ssmrun.SUCCESS
    ]


def document_role(stack: model.AwsStack, name: str) -> str:
    """A document by what it does (its step's name): modelStage, modelServer, nodeProxy, monitoring."""
    steps = stack.documents.get(name, {}).get("mainSteps") or [{}]
    return str(steps[0].get("name") or name)


def target_state(aws_plan: AwsPlan, target_group: str, target: str) -> str:
    """What DescribeTargetHealth says of `target` (`unused` once it is out of the group), asked
    as the deployer: what the lab saw the moment something acted on the target."""

    def call() -> str:
        client = _deployer_elbv2(aws_plan)
        found = client.describe_target_health(TargetGroupArn=target_group, Targets=[{"Id": target}])
        states = [d["TargetHealth"]["State"] for d in found["TargetHealthDescriptions"]]
        return states[0] if states else "unused"

    return netns.call_in(aws_plan.api.namespace, call)


LOCAL_COMMAND = "command:local:Command"


def deployer_command(aws_plan: AwsPlan, inputs: dict, what: str = "delete") -> tuple[bool, str]:
    """A `command:local:Command`'s `delete` as pulumi-command runs it where `pulumi up` runs
    (local/commandController.go: `sh -c`, the engine's environment plus `environment`): here the
    deployer's AWS CLI in the `aws` namespace, with the deployer's credentials and the CLI's
    waiters on the lab clock. Exit 0 is success."""
    text = inputs.get(what)
    if not text:
        return True, f"no {what} command"
    env = {
        "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(aws_plan.root),
        "AWS_ACCESS_KEY_ID": DEPLOYER_KEY,
        "AWS_SECRET_ACCESS_KEY": "lab",
        "AWS_CA_BUNDLE": str(aws_plan.root / "endpoint" / "tls" / "ca.pem"),
        "AWS_DATA_PATH": str(aws_plan.root / "aws-data"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": aws_plan.plan.cluster.aws.region,
        **{str(k): str(v) for k, v in (inputs.get("environment") or {}).items()},
    }
    done = subprocess.run(["ip", "netns", "exec", aws_plan.api.namespace, "sh", "-c", str(text)],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    return (
        done.returncode == 0,
        f"sh -c {text!r}: exit {done.returncode}\n{(done.stdout + done.stderr)[-600:]}",
    )


def delete(
    aws_plan: AwsPlan,
    old: offline.Render,
    old_stack: model.AwsStack,
    names: set[str],
    terminate: Callable[[model.Instance], str],
) -> list[StepResult]:
    """The resources that left the stack, after every create and update: one at a time, each
    after whatever depended on it (reverse dependency order of the old render, as the engine
    deletes, and as labkit/engine/executor.py does on bare metal); the first failure stops there.
    What each delete does is the provider's: an attachment's is DeregisterTargets and returns
    (terraform-provider-aws internal/service/elbv2/target_group_attachment.go
    resourceAttachmentDelete: no wait for the drain); an association's is DeleteAssociation, which
    undoes no run; an instance's is TerminateInstances, waited for until terminated (`terminate`:
    the machine shuts down)."""
    steps: list[StepResult] = []
    instance_of = {instance.resource: instance for instance in old_stack.instances.values()}
    order = topological(old.dependencies(), [r.name for r in old.custom_resources])
    by_name = {r.name: r for r in old.custom_resources}
    t0 = time.monotonic()
    for name in reversed([n for n in order if n in names]):
        resource = by_name[name]
        started = time.monotonic() - t0
        try:
            if name in instance_of:
                result = StepResult(instance_of[name].node, "terminate", True, terminate(instance_of[name]),
                                    resource=name, op="delete")  # fmt: skip
            elif resource.type == model.TG_ATTACHMENT:
                target, port = old_stack.registrations[name]
                group = old_stack.target_group.arn
                detail = deployer_call(aws_plan, "deregister_targets", group, target, port)
                result = StepResult("-", "deregister", True, detail, resource=name, op="delete")
            elif resource.type == LOCAL_COMMAND:
                inputs = model.substitute(resource.inputs, model.identities(old, old_stack.region))
                result = StepResult("-", "local", *deployer_command(aws_plan, inputs),
                                    resource=name, op="delete")  # fmt: skip
            elif resource.type == model.ASSOCIATION:
                result = StepResult("-", "association", True, "DeleteAssociation (a run made stays made)",
                                    resource=name, op="delete")  # fmt: skip
            else:
                result = StepResult(
                    "-", "api", True, "gone from the API stand-in", resource=name, op="delete"
                )
        except Exception as error:  # the lab's own failure, named
            failure = f"{type(error).__name__}: {error}"
            result = StepResult("-", "lab", False, failure, resource=name, op="delete")
        result.started, result.seconds = round(started, 3), round(time.monotonic() - t0 - started, 3)
        steps.append(result)
        if not result.ok:
            break
    return steps
