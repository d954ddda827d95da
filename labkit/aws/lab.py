"""`lab.py up|upgrade|down` for an AWS stack: the GPU nodes as namespaces at the addresses the
program pins, first boot and every SSM association run on them in the engine's order, the AWS
APIs in the `aws` namespace (labkit/aws/service.py) and HAProxy as the NLB in the `lb`
namespace (labkit/aws/elb.py); clients in the `client` namespace reach the model only through
the load balancer, with the lab's key, over TLS when the stack has it.

What the engine would do with each registered resource, here:
- `aws:ec2/instance:Instance` (a GPU node): the instance boots: its launch template's user data
  runs once as root (machine.py, cloud-init semantics);
- `aws:lb/targetGroupAttachment:TargetGroupAttachment`: RegisterTargets, as the deployer;
- `aws:ssm/association:Association`: its document runs on its targets within its rate controls
  (ssmrun.py); the create waits for the run when `waitForSuccessTimeoutSeconds` is set (the
  provider's waitAssociationSuccess), else the run goes on without holding anything
  (terraform-provider-aws internal/service/ssm/association.go);
- everything else (VPC, subnets, SGs, IAM, documents, parameters, the NLB): the API stand-in
  holds what the nodes read (parameters, policies, the target group); nothing to run.
Resources start when everything they depend on (`Render.dependencies()`) has finished,
independent ones in parallel; the first failure starts nothing new.

The rooms of this one: settings.py (the plan, the clock), nodes.py (the machines and their
engines), standins.py (the API and NLB stand-ins started), engine.py (the engine's order),
day2.py (`upgrade`); this module is the entry `scripts/lab.py` and the tests use.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from labkit.aws import model, settings, ssmrun  # noqa: F401 (model: the callers' stack reader)
from labkit.aws.day2 import TargetWatch, client_key, upgrade  # noqa: F401 (the public entry)
from labkit.aws.engine import AwsUp, apply, deployer_call, record_runs  # noqa: F401
from labkit.aws.nodes import (  # noqa: F401 (the public entry)
    context,
    engines,
    lab_options,
    machines_up,
    node_daemon,
    node_etc,
    node_machines,
    pulled_images,
    waiters_on_the_clock,
)
from labkit.aws.settings import (  # noqa: F401 (the public entry)
    SETTINGS_FILE,
    AwsLabError,
    AwsPlan,
    build,
    is_aws,
    lab_config,
    load,
    pace_documents,
    s3_uri,
    save_settings,
    weights_bucket,
)
from labkit.aws.standins import lab_weights, start_api, start_haproxy
from labkit.cluster import endpoint, lifecycle
from labkit.cluster.blueprint import STATE_ROOT
from labkit.engine import executor, substitutions
from labkit.engine.executor import StepResult
from tooling import offline


def up(
    aws_plan: AwsPlan, *, clock_scale: float = lifecycle.DEFAULT_CLOCK_SCALE
) -> tuple[AwsUp, offline.Render]:
    """Day 0: machines (each with its disk and Docker engine), the images in the lab's registry,
    the API and load balancer stand-ins, then every resource in order."""
    settings.clock = clock_scale
    plan = aws_plan.plan
    raw, made = lab_config(plan.stack_config or {})
    machines_up(aws_plan)
    identity = endpoint.ensure(aws_plan.root / "endpoint", plan.load_balancer.ip)
    rendered, more = executor.render(raw, aws_plan.stack, clock_scale, None, identity)
    region = offline.stack_region(raw)
    stack = model.read(rendered, region, s3_uri(plan.cluster))
    made += pace_documents(stack, clock_scale)
    bucket = weights_bucket(stack.weights_uri)
    node_etc(aws_plan, region, bucket[0] if bucket else None)
    machines = node_machines(aws_plan, stack, identity)
    options = lab_options(clock_scale)
    fixtures = engines(aws_plan, machines, options)
    published = lifecycle.publish_images(plan, options, rendered, pulled_images(stack))
    fixtures.append(StepResult("-", "images", True, "; ".join(published), op="fixture"))
    start_haproxy(aws_plan, stack)
    start_api(aws_plan, stack, identity, lab_weights(aws_plan.root) if bucket else None)
    report = apply(aws_plan, rendered, stack, machines)
    report.steps[:0] = fixtures
    report.notes = made + more + [f"docker: {what} ({why})" for what, why in substitutions.DOCKER.items()]
    record_runs(aws_plan, report, stack)
    save_settings(aws_plan, clock_scale)
    executor.save_state(lifecycle.state_file(plan), plan.stack_config or {}, rendered, {})
    return report, rendered


def down(label: str) -> list[str]:
    """Everything of the lab `label`: namespaces (and their processes), /etc/netns, state."""
    removed = lifecycle.down(label)
    shutil.rmtree(Path(STATE_ROOT) / label, ignore_errors=True)
    return removed
