"""Run the real Pulumi program under Pulumi's mocks and record what it registers.

No Pulumi CLI, engine, provider plugin or cloud account is involved: the mocks answer
every resource registration and invoke. Tests, the offline preview and the policy harness
all go through `render`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import pulumi.runtime
import pulumi.runtime.mocks
from pulumi.output import Unknown
from pulumi.runtime import rpc, settings
from pulumi.runtime.mocks import MockMonitor
from pulumi.runtime.stack import wait_for_rpcs
from pulumi.runtime.sync_await import _sync_await

from qwen_cluster import config
from tooling import sdk_speedup, stackfile

PROGRAM = stackfile.PROJECT_ROOT / "__main__.py"
# Placeholder handed to the program for `sshPrivateKey` when a stack file has none:
# the offline render never connects anywhere.
OFFLINE_SSH_KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\noffline-placeholder\n-----END OPENSSH PRIVATE KEY-----\n"
)
# Placeholder for `rayAuthToken` when a stack file has none (needed with pipelineParallel > 1):
# a secret like the real one, so a render (and the lab) shows where it travels.
OFFLINE_RAY_TOKEN = "offline-ray-token-placeholder"


@dataclass
class RecordedResource:
    type: str
    name: str
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    custom: bool
    provider: str | None = None
    parent: str | None = None  # the parent's name ("" for the stack)
    parent_type: str | None = None
    depends_on: list[str] = field(default_factory=list)  # explicit dependsOn names
    urn: str = ""
    # The resource options that decide how a change is carried out (tooling/changes/).
    delete_before_replace: bool = False
    ignore_changes: list[str] = field(default_factory=list)  # input property paths, camelCase
    replace_on_changes: list[str] = field(default_factory=list)
    # Input property -> names of the resources it depends on, as the SDK tells the engine (the
    # engine hands them to the policy pack); None where not recorded (hand-written fixtures).
    property_dependencies: dict[str, list[str]] | None = None


@dataclass
class Render:
    stack: str
    resources: list[RecordedResource]
    outputs: dict[str, Any]
    invokes: list[tuple[str, dict[str, Any]]]
    error: str | None = None

    def of_type(self, type_: str) -> list[RecordedResource]:
        return [r for r in self.resources if r.type == type_]

    def named(self, name: str) -> RecordedResource:
        matches = [r for r in self.resources if r.name == name]
        if len(matches) != 1:
            raise KeyError(f"{len(matches)} resources named {name!r}")
        return matches[0]

    @property
    def custom_resources(self) -> list[RecordedResource]:
        return [r for r in self.resources if r.custom]

    def dependencies(self) -> dict[str, set[str]]:
        """Which custom resources each custom resource waits for at deploy time.

        Explicit `depends_on`, the property dependencies the SDK sent with the registration
        (what the engine orders by; they also hold values the mocks cannot mark, such as a
        placement group's computed name or an image reference), and every input that carries
        another resource's id, ARN or DNS name (the mocks make those unique per resource)."""
        custom = self.custom_resources
        names = {r.name for r in custom}
        marks = references(custom)
        graph: dict[str, set[str]] = {}
        for resource in custom:
            found = {marks[value].name for value in strings(resource.inputs) if value in marks}
            recorded = resource.property_dependencies or {}
            found |= {name for deps in recorded.values() for name in deps if name in names}
            found |= {name for name in resource.depends_on if name in names}
            found.discard(resource.name)
            graph[resource.name] = found
        return graph

    def critical_path(self, counts: Callable[[RecordedResource], bool] | None = None) -> list[str]:
        """The longest chain of custom resources that must happen one after another, in
        dependency order: by default the one with the most resources; with `counts`, the one
        with the most resources for which `counts` is true (e.g. health gates: the day-2
        chain in gated steps), as many of those first and then as short as possible, and
        from its first counted resource to its last ([] when none counts).

        Iterative (a rollout chain is thousands of links deep) and linear in the graph: each
        resource's best chain is found once, after those of what it waits for. A cycle (which
        the engine refuses) is cut where the walk meets it again."""
        graph = self.dependencies()
        by_name = {r.name: r for r in self.custom_resources}

        def weight(name: str) -> int:
            return 1 if counts is None or counts(by_name[name]) else 0

        # Per resource: (counted resources, -resources) of its best chain and its predecessor.
        best: dict[str, tuple[tuple[int, int], str | None]] = {}
        state: dict[str, int] = {}  # 1 on the walk's stack, 2 done
        for root in graph:
            if root in state:
                continue
            stack: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
            state[root] = 1
            while stack:
                name, pending = stack[-1]
                following = next((d for d in pending if state.get(d) != 1), None)
                if following is not None:
                    if following not in state:
                        state[following] = 1
                        stack.append((following, iter(sorted(graph.get(following, ())))))
                    continue
                stack.pop()
                state[name] = 2
                score, before = (0, 0), None
                for dependency in sorted(graph.get(name, ())):
                    if state.get(dependency) == 2 and dependency in best and best[dependency][0] > score:
                        score, before = best[dependency][0], dependency
                counted = weight(name)
                if counts is not None and score[0] == 0:
                    before, score = None, (0, 0)  # a chain starts at its first counted resource
                best[name] = ((score[0] + counted, score[1] - 1), before)
        if not best:
            return []
        last = max(best, key=lambda name: best[name][0])
        if counts is not None and best[last][0][0] == 0:
            return []
        path: list[str] = []
        cursor: str | None = last
        while cursor is not None:
            path.append(cursor)
            cursor = best[cursor][1]
        return path[::-1]


# Values a real provider computes, enough for the program's outputs to resolve.
_COMPUTED: dict[str, dict[str, Any]] = {
    "aws:lb/loadBalancer:LoadBalancer": {"dnsName": "{name}-0123456789.elb.amazonaws.com"},
    "aws:ec2/instance:Instance": {"privateIp": "{privateIp}", "primaryNetworkInterfaceId": "{name}-eni"},
    "aws:ec2/launchTemplate:LaunchTemplate": {"latestVersion": 1},
    "aws:ec2/placementGroup:PlacementGroup": {"name": "{name}-0123456"},  # auto-named by the engine
    "aws:iam/role:Role": {"name": "{name}-0123456"},
    "aws:iam/instanceProfile:InstanceProfile": {"name": "{name}-0123456"},
    "aws:ssm/document:Document": {"name": "{name}-0123456"},
}


# The region the mocks answer for when a stack names none (no aws:region, no AWS target).
FALLBACK_REGION = "us-west-2"
_ZONES_PER_REGION = 3  # a plausible few; the program needs two (the NLB's second subnet)
# Zone-id prefixes abbreviate the region's words ("us-east-1" -> "use1", "ap-southeast-2" ->
# "apse2"; AWS docs, "Availability Zone IDs for your AWS resources").
_REGION_WORDS = {"northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}


def stack_region(stack_config: Mapping[str, Any]) -> str:
    """The region the stack's AWS provider works in: `aws:region`, or else the region of
    `aws.availabilityZone` (config.AwsTarget.region; config.validate requires the two to agree
    when both are set), or FALLBACK_REGION for a stack with neither."""
    region = stack_config.get("aws:region")
    if isinstance(region, str) and region:
        return region
    target = stack_config.get(f"{config.NAMESPACE}:aws")
    zone = target.get("availabilityZone") if isinstance(target, Mapping) else None
    if isinstance(zone, str) and zone:
        return config.AwsTarget.model_construct(availability_zone=zone).region
    return FALLBACK_REGION


def availability_zones(region: str) -> dict[str, list[str]]:
    """What aws:index/getAvailabilityZones answers in `region`: its first zones, by name and id."""
    *words, number = region.split("-")
    prefix = words[0] + "".join(_REGION_WORDS.get(word, word[:1]) for word in words[1:]) + number
    letters = "abcdefghij"[:_ZONES_PER_REGION]
    return {
        "names": [f"{region}{letter}" for letter in letters],
        "zoneIds": [f"{prefix}-az{index}" for index in range(1, len(letters) + 1)],
    }


class RecordingMocks(pulumi.runtime.Mocks):
    """Mocks that record inputs and outputs (the inputs plus ids/ARNs and what a provider
    computes), and answer invokes plausibly, for the stack's region (`region`).

    `preview`: answer like the engine in a preview of a new stack: a new resource's id and
    whatever its provider computes (ARN, DNS name, ...) are unknown; inputs stay known.

    `echo_inputs`: also send the inputs back to the SDK as outputs. Off by default outside a
    preview: there the SDK itself resolves every input property the engine did not return to
    the value the program passed (pulumi/runtime/rpc.py resolve_outputs, "input prop the engine
    didn't give us a final value for"), so every Output resolves the same, without one more
    serialisation of every input (the interfaces of 256 launch templates). A test renders every
    stack both ways and compares. In a preview the SDK does not fill them in: always echoed."""

    def __init__(
        self,
        invoke_results: dict[str, dict[str, Any]] | None = None,
        *,
        preview: bool = False,
        echo_inputs: bool = False,
        region: str = FALLBACK_REGION,
    ):
        self.resources: list[RecordedResource] = []
        self.invokes: list[tuple[str, dict[str, Any]]] = []
        self.invoke_results = invoke_results or {}
        self.preview = preview
        self.echo_inputs = echo_inputs
        self.region = region

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        if self.preview:
            inputs = _as_sent(dict(args.inputs))
            outputs = dict(inputs)
            for key in (*_COMPUTED.get(args.typ, {}), "arn"):
                outputs.setdefault(key, rpc.UNKNOWN)
            self.resources.append(
                RecordedResource(args.typ, args.name, inputs, outputs, args.custom, args.provider or None)
            )
            return [None, outputs]
        outputs = dict(args.inputs)
        for key, template in _COMPUTED.get(args.typ, {}).items():
            if not isinstance(template, str):
                outputs.setdefault(key, template)
                continue
            with contextlib.suppress(KeyError):  # an input the template names was not given
                outputs.setdefault(key, template.format(name=args.name, **_str_keys(args.inputs)))
        outputs.setdefault("arn", f"arn:aws:mock:::{args.typ.split(':')[-1].lower()}/{args.name}")
        self.resources.append(
            RecordedResource(
                args.typ, args.name, dict(args.inputs), outputs, args.custom, args.provider or None
            )
        )
        if self.echo_inputs:
            return [f"{args.name}-id", outputs]
        return [f"{args.name}-id", {key: value for key, value in outputs.items() if key not in args.inputs}]

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.invokes.append((args.token, dict(args.args)))
        if args.token in self.invoke_results:
            return self.invoke_results[args.token]
        if args.token == "aws:ec2/getAmi:getAmi":
            return {
                "id": "ami-0123456789abcdef0",
                "name": "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261101",
                "architecture": "x86_64",
            }
        if args.token == "aws:ec2/getVpc:getVpc":
            # An existing VPC spanning the private ranges (a test may answer otherwise).
            return {
                "id": args.args.get("id", "vpc-0123456789abcdef0"),
                "cidrBlock": "10.0.0.0/8",
                "cidrBlockAssociations": [
                    {"cidrBlock": "10.0.0.0/8"},
                    {"cidrBlock": "172.16.0.0/12"},
                    {"cidrBlock": "192.168.0.0/16"},
                ],
            }
        if args.token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            return availability_zones(self.region)
        return {}


def _as_sent(value: Any) -> Any:
    """Unknown inputs as the engine hands them on (the SDK's unknown sentinel string)."""
    if isinstance(value, Unknown):
        return rpc.UNKNOWN
    if isinstance(value, Mapping):
        return {key: _as_sent(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_as_sent(item) for item in value]
    return value


class _RecordingMonitor(MockMonitor):
    """The mock monitor, also keeping each registration's property dependencies (URNs)."""

    def __init__(self, mocks: pulumi.runtime.Mocks):
        super().__init__(mocks)
        self.names: dict[str, str] = {}  # urn -> resource name
        self.property_dependencies: dict[tuple[str, str], dict[str, list[str]]] = {}

    def RegisterResource(self, request):
        response = super().RegisterResource(request)
        self.names[response.urn] = request.name
        self.property_dependencies[(request.type, request.name)] = {
            key: list(deps.urns) for key, deps in request.propertyDependencies.items() if deps.urns
        }
        return response


def strings(value: Any) -> Iterator[str]:
    """Every string inside a nested input value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings(item)


def references(resources: list[RecordedResource]) -> dict[str, RecordedResource]:
    """Values that name one of `resources` under these mocks: its id (`<name>-id`), its ARN, its
    DNS name and a name the engine chose for it. An input holding one of them came from that
    resource's output, which is how the engine's dependencies (and the policy pack's property
    dependencies) are rebuilt."""
    marks: dict[str, RecordedResource] = {}
    for resource in resources:
        marks[f"{resource.name}-id"] = resource
        for key in ("arn", "dnsName"):
            if isinstance(resource.outputs.get(key), str):
                marks[resource.outputs[key]] = resource
        if "name" in _COMPUTED.get(resource.type, {}) and "name" not in resource.inputs:
            marks[str(resource.outputs.get("name"))] = resource  # a name the engine chose
    marks.pop(rpc.UNKNOWN, None)  # in a preview, unknown values name nothing
    return marks


def _str_keys(inputs: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in inputs.items() if isinstance(k, str) and k.isidentifier()}


def render(
    stack_config: dict[str, Any],
    stack: str = "dev",
    *,
    program: Path = PROGRAM,
    ssh_private_key: str | None = OFFLINE_SSH_KEY,
    invoke_results: dict[str, dict[str, Any]] | None = None,
    preview: bool = False,
    echo_inputs: bool = False,
    speedup: bool = True,
) -> Render:
    """Run `program` with `stack_config` (the `config:` map of a stack file) under mocks;
    `preview`: as `pulumi preview` of a new stack (ids and computed outputs unknown);
    `echo_inputs`: see RecordingMocks (the same render, slower); `speedup`: with
    tooling/sdk_speedup.py where the installed SDK is the one it was written for."""
    values, secret_keys = stackfile.as_pulumi_config(stack_config)
    key_name = "qwen-cluster:sshPrivateKey"
    if ssh_private_key is not None and key_name not in values:
        values[key_name] = ssh_private_key
        secret_keys.append(key_name)
    token_name = "qwen-cluster:rayAuthToken"
    if token_name not in values:
        values[token_name] = OFFLINE_RAY_TOKEN
        secret_keys.append(token_name)
    mocks = RecordingMocks(
        invoke_results, preview=preview, echo_inputs=echo_inputs, region=stack_region(stack_config)
    )
    settings.ROOT.set(None)
    # The config reaches the program as under the CLI: the language host puts it in the
    # environment (PULUMI_CONFIG, PULUMI_CONFIG_SECRET_KEYS), where the program lists its keys
    # with the public `pulumi.runtime.get_config_env`, and the SDK's launcher hands the same to
    # `pulumi.runtime.set_all_config` before the program starts (pulumi/pulumi
    # sdk/python/cmd/pulumi-language-python-exec).
    environment = {
        "PULUMI_CONFIG": json.dumps(values),
        "PULUMI_CONFIG_SECRET_KEYS": json.dumps(secret_keys),
    }
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    pulumi.runtime.set_all_config(values, secret_keys)
    monitor = _RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="qwen-cluster", stack=stack, preview=preview, monitor=monitor)

    lineage: dict[tuple[str, str], tuple[str | None, str | None, list[Any]]] = {}
    options: dict[tuple[str, str], tuple[bool, list[str], list[str]]] = {}

    def remember(args: pulumi.ResourceTransformationArgs):
        opts = args.opts
        parent = opts.parent if opts is not None else None
        depends = opts.depends_on if opts is not None and opts.depends_on else []
        if not isinstance(depends, list):
            depends = [depends]
        # An item may be an Input that resolves later (pulumi.deferred_output): named after the run.
        lineage[(args.type_, args.name)] = (
            getattr(parent, "_name", None),
            getattr(parent, "_type", None),
            depends,
        )
        if opts is not None:
            options[(args.type_, args.name)] = (
                bool(opts.delete_before_replace),
                list(opts.ignore_changes or []),
                list(opts.replace_on_changes or []),
            )
        return None

    pulumi.runtime.register_stack_transformation(remember)
    error: str | None = None
    root = str(program.parent)
    added = root not in sys.path
    if added:
        sys.path.insert(0, root)
    # The mock monitor answers each registration on an executor thread and serialises the
    # outputs there by pumping a fresh event loop; plain values never suspend, so they are
    # serialised without one (the loop's epoll call hands the GIL to the main thread on every
    # registration). Anything that does suspend goes the SDK's way.
    pulumi.runtime.mocks._sync_await = _await_plain
    outputs: dict[str, Any] = {}
    with sdk_speedup.applied(speedup):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(program), run_name="__main__")
                _sync_await(wait_for_rpcs())
        except (pulumi.RunError, ValueError) as exc:
            error = str(exc)
        finally:
            pulumi.runtime.mocks._sync_await = _sync_await
            if added:
                sys.path.remove(root)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        stack_resource = settings.get_root_resource()
        if error is None and stack_resource is not None:
            for name, value in getattr(stack_resource, "outputs", {}).items():
                outputs[name] = _resolve(value)
    for resource in mocks.resources:
        parent, parent_type, depends = lineage.get((resource.type, resource.name), (None, None, []))
        resource.parent, resource.parent_type = parent, parent_type
        resource.depends_on = [_dependency_name(d) for d in depends]
        dbr, ignored, replaced = options.get((resource.type, resource.name), (False, [], []))
        resource.delete_before_replace, resource.ignore_changes, resource.replace_on_changes = (
            dbr,
            ignored,
            replaced,
        )
        urns = monitor.property_dependencies.get((resource.type, resource.name), {})
        resource.property_dependencies = {
            key: [monitor.names[urn] for urn in deps if urn in monitor.names] for key, deps in urns.items()
        }
    return Render(stack, mocks.resources, outputs, mocks.invokes, error)


def _dependency_name(dependency: Any) -> str:
    """The name of a `depends_on` item: a resource, or an Input of one resolved by now."""
    if isinstance(dependency, pulumi.Output):
        dependency = _sync_await(dependency.future())
    return getattr(dependency, "_name", str(dependency))


def _await_plain(awaitable: Any) -> Any:
    """Run a coroutine to its result without an event loop while it does not suspend; where
    it waits on a future, the SDK's `_sync_await` pumps its loop until that future is done
    (what an asyncio Task does between two steps), then it carries on."""
    if not inspect.iscoroutine(awaitable):
        return _sync_await(awaitable)
    while True:
        try:
            waited_on = awaitable.send(None)
        except StopIteration as done:
            return done.value
        waited_on._asyncio_future_blocking = False
        _sync_await(waited_on)


def _resolve(value: Any) -> Any:
    """Resolve an exported value (Outputs nested in dicts and lists) to plain data, None if
    any part is unknown (as `Output.from_input(value).future()` answers). Each Output is
    awaited where it sits: lifting the whole value into one Output first builds an Output per
    nested item, hundreds per node map at scale."""
    unknown = False

    async def plain(item: Any) -> Any:
        nonlocal unknown
        if isinstance(item, pulumi.Output):
            if not await item.is_known():
                unknown = True
                return None
            return await plain(await item.future())
        if isinstance(item, Mapping):
            return {key: await plain(entry) for key, entry in item.items()}
        if isinstance(item, list | tuple):
            return [await plain(entry) for entry in item]
        return item

    resolved = _sync_await(plain(value))
    return None if unknown else json.loads(json.dumps(resolved, default=str))


def render_stack(stack: str, **kwargs: Any) -> Render:
    """Render a stack file of this project (`Pulumi.<stack>.yaml`)."""
    return render(stackfile.read(stack), stack, **kwargs)
