"""The policy pack over the analyzer protocol, started and driven the way the Pulumi CLI does it.

How the CLI runs a Python pack (pulumi/pulumi, read for this test):
- pkg/resource/plugin/analyzer_plugin.go NewPolicyAnalyzer hands the language host one argument,
  the engine's address (`host.ServerAddr()`); sdk/python/cmd/pulumi-language-python/main.go
  RunPlugin runs `python -u -m pulumi.policy <engine-address> <pack-dir>` with cwd = the pack
  directory, and sets PULUMI_CONFIG (the stack config as JSON, every value a string),
  PULUMI_PROJECT, PULUMI_STACK, PULUMI_ORGANIZATION and PULUMI_DRY_RUN from the ConfigureStack
  call it awaits first (sdk/policy_proxy.go, which forwards that call to the pack too). When the
  engine has no stack options (`pulumi policy analyze`) no ConfigureStack comes and none of
  these variables is set.
- The pack prints its port on stdout. The engine calls GetAnalyzerInfo, then Configure with the
  policy config reconciled with the schema defaults (pkg/resource/analyzer/config.go
  ReconcilePolicyPackConfig), Analyze for each resource with its inputs, and at the end
  AnalyzeStack with every resource's outputs, parent, dependencies and property dependencies
  (pkg/resource/deploy/step_generator.go).
- Properties are marshalled with KeepUnknowns, KeepSecrets and SkipInternalKeys
  (sdk/go/common/resource/plugin/rpc.go): numbers are doubles in a google.protobuf.Struct,
  secrets stay wrapped in their signature object, unknowns are sentinel strings, top-level
  `__` keys are dropped.
- The engine address: pulumi.policy (sdk/python/lib/pulumi/policy/__main__.py) parses it but
  configures the runtime without an engine, so the pack's logging goes to stderr and nothing
  calls back. A fake engine still answers on that address here, in case a future SDK does.

The verdicts over gRPC must equal the offline harness's (tooling/policy_harness.py), message for message.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2, json_format, struct_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc, engine_pb2, engine_pb2_grpc

from policies import guard
from qwen_cluster import kvlink
from tests.helpers.policy_fixtures import (
    monitoring_port_on_every_node,
    mutation_cases,
    pd_config,
    pd_rendered,
    previewed,
    publishing_container,
    rendered,
    split_world,
)
from tooling import policy_harness, stackfile
from tooling.offline import RecordedResource

POLICIES_DIR = Path(__file__).resolve().parent.parent / "policies"
EXAMPLE_CONFIG = POLICIES_DIR / "config.json"
START_TIMEOUT_SECONDS = 60
LEVELS = {
    analyzer_pb2.ADVISORY: "advisory",
    analyzer_pb2.MANDATORY: "mandatory",
    analyzer_pb2.REMEDIATE: "remediate",
    analyzer_pb2.DISABLED: "disabled",
}
LEVEL_NUMBERS = {name: number for number, name in LEVELS.items()}
SIG_KEY = "4dabf18193072939515e22adb298388d"


class FakeEngine(engine_pb2_grpc.EngineServicer):
    """The engine's callback service; records what the pack asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def Log(self, request, context):
        self.calls.append(("Log", request.message))
        return empty_pb2.Empty()

    def GetRootResource(self, request, context):
        self.calls.append(("GetRootResource", None))
        return engine_pb2.GetRootResourceResponse(urn="")

    def SetRootResource(self, request, context):
        self.calls.append(("SetRootResource", request.urn))
        return engine_pb2.SetRootResourceResponse()


# --- the wire, as the engine writes it -----------------------------------------------------------


def wire(properties: Mapping[str, Any]) -> struct_pb2.Struct:
    """MarshalProperties(KeepUnknowns, KeepSecrets, SkipInternalKeys) of recorded properties.

    The mocks record what the SDK sent the engine, already in wire form (a secret is its
    signature object, an unknown its sentinel string), so only the Struct itself is built here."""
    struct = struct_pb2.Struct()
    json_format.ParseDict({k: v for k, v in properties.items() if not k.startswith("__")}, struct)
    return struct


def options(parent_urn: str | None) -> analyzer_pb2.AnalyzerResourceOptions:
    return analyzer_pb2.AnalyzerResourceOptions(
        parent=parent_urn or "",
        customTimeouts=analyzer_pb2.AnalyzerResourceOptions.CustomTimeouts(),
    )


def reconciled_config(info: analyzer_pb2.AnalyzerInfo, given: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """ReconcilePolicyPackConfig: each policy's level and schema defaults from GetAnalyzerInfo,
    then the given config (a level string, or an object with enforcementLevel and properties)."""
    result: dict[str, dict[str, Any]] = {}
    for policy in info.policies:
        schema = json_format.MessageToDict(policy.configSchema.properties)
        defaults = {key: spec["default"] for key, spec in schema.items() if "default" in spec}
        result[policy.name] = {"enforcementLevel": LEVELS[policy.enforcementLevel], **defaults}
    for name, value in given.items():
        entry = result.setdefault(name, {})
        if isinstance(value, str):
            entry["enforcementLevel"] = value
        else:
            entry.update(value)
    return result


# --- the pack process ----------------------------------------------------------------------------


@dataclass
class Pack:
    """One pack process, as the CLI starts it, and the engine's side of the conversation."""

    stack: str | None  # the stack whose config it was started with; None: no PULUMI_CONFIG
    process: subprocess.Popen
    stderr_path: Path
    stack_config: dict[str, Any] | None = None  # its config, when not the stack file's
    stub: analyzer_pb2_grpc.AnalyzerStub | None = None
    info: analyzer_pb2.AnalyzerInfo | None = None
    policy_config: dict[str, dict[str, Any]] = field(default_factory=dict)

    def connect(self) -> None:
        port = self._read_port()
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 400 * 1024 * 1024)]
        )
        self.stub = analyzer_pb2_grpc.AnalyzerStub(channel)
        if self.stack is not None:  # the language host's proxy forwards ConfigureStack
            values, secret_keys = stackfile.as_pulumi_config(self.stack_config or stackfile.read(self.stack))
            self.stub.ConfigureStack(
                analyzer_pb2.AnalyzerStackConfigureRequest(
                    stack=self.stack,
                    project=policy_harness.PROJECT,
                    organization="organization",
                    dry_run=True,
                    config=values,
                    config_secret_keys=secret_keys,
                )
            )
        self.info = self.stub.GetAnalyzerInfo(empty_pb2.Empty())
        self.configure(reconciled_config(self.info, json.loads(EXAMPLE_CONFIG.read_text())))

    def configure(self, policy_config: dict[str, dict[str, Any]]) -> None:
        assert self.stub is not None
        self.policy_config = policy_config
        request = analyzer_pb2.ConfigureAnalyzerRequest()
        for name, entry in policy_config.items():
            properties = struct_pb2.Struct()
            properties.update({k: v for k, v in entry.items() if k != "enforcementLevel"})
            request.policyConfig[name].CopyFrom(
                analyzer_pb2.PolicyConfig(
                    enforcementLevel=LEVEL_NUMBERS[entry["enforcementLevel"]], properties=properties
                )
            )
        self.stub.Configure(request)

    def _read_port(self) -> int:
        """The first line on stdout is the port (newPlugin reads it byte by byte)."""
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        line = b""
        while not line.endswith(b"\n"):
            if not selector.select(timeout=START_TIMEOUT_SECONDS):
                raise AssertionError(
                    f"the pack printed no port in {START_TIMEOUT_SECONDS} s: {self.stderr()}"
                )
            byte = os.read(self.process.stdout.fileno(), 1)
            if not byte:
                raise AssertionError(f"the pack exited before printing its port: {self.stderr()}")
            line += byte
        return int(line)

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-4000:]

    def analyze(self, stack: str, resources: list[RecordedResource]) -> list[policy_harness.Violation]:
        """What the engine sees in a preview: Analyze per resource (inputs), then AnalyzeStack."""
        assert self.stub is not None
        violations: list[policy_harness.Violation] = []
        by_name = {}
        for resource in resources:
            by_name.setdefault(resource.name, resource)
        for resource in resources:
            parent = by_name.get(resource.parent) if resource.parent else None
            response = self.stub.Analyze(
                analyzer_pb2.AnalyzeRequest(
                    urn=policy_harness.urn_of(stack, resource),
                    type=resource.type,
                    name=resource.name,
                    properties=wire(resource.inputs),
                    options=options(policy_harness.urn_of(stack, parent) if parent else None),
                )
            )
            violations += self._verdicts(response, resource.name, resource.type, {})
        stack_view = policy_harness.policy_resources(stack, resources, outputs=True)
        request = analyzer_pb2.AnalyzeStackRequest()
        for resource, view in zip(resources, stack_view, strict=True):
            entry = request.resources.add(
                urn=view.urn,
                type=resource.type,
                name=resource.name,
                properties=wire(resource.outputs),
                options=options(view.opts.parent),
                parent=view.parent.urn if view.parent else "",
                dependencies=[d.urn for d in view.dependencies],
            )
            for key, deps in view.property_dependencies.items():
                entry.propertyDependencies[key].urns.extend(d.urn for d in deps)
        by_urn = {view.urn: view for view in stack_view}
        violations += self._verdicts(self.stub.AnalyzeStack(request), None, None, by_urn)
        return violations

    def _verdicts(self, response, name, type_, by_urn) -> list[policy_harness.Violation]:
        found = []
        for diagnostic in response.diagnostics:
            message = diagnostic.message.removeprefix(diagnostic.description + "\n")
            resource_name, resource_type = name, type_
            if diagnostic.urn:
                target = by_urn[diagnostic.urn]
                resource_name, resource_type = target.name, target.resource_type
            found.append(
                policy_harness.Violation(
                    diagnostic.policyName,
                    LEVELS[diagnostic.enforcementLevel],
                    resource_name,
                    resource_type,
                    message,
                )
            )
        return found


def start(
    stack: str | None, engine_address: str, tmp: Path, stack_config: dict[str, Any] | None = None
) -> Pack:
    """The pack as the CLI starts it for `stack`, with its stack file's config (or `stack_config`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULUMI_")}
    if stack is not None:
        values, _ = stackfile.as_pulumi_config(stack_config or stackfile.read(stack))
        env |= {
            "PULUMI_CONFIG": json.dumps(values),
            "PULUMI_PROJECT": policy_harness.PROJECT,
            "PULUMI_STACK": stack,
            "PULUMI_ORGANIZATION": "organization",
            "PULUMI_DRY_RUN": "true",
        }
    stderr_path = tmp / f"pack-{stack or 'no-config'}{'-given' if stack_config else ''}.stderr"
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-u", "-m", "pulumi.policy", engine_address, str(POLICIES_DIR)],
            cwd=POLICIES_DIR,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    return Pack(stack, process, stderr_path, stack_config)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def packs(engine, tmp_path_factory) -> Iterator[dict[str | None, Pack]]:
    """One pack per configuration, all started at once: each stack's config, and none."""
    _, address = engine
    tmp = tmp_path_factory.mktemp("packs")
    started = {stack: start(stack, address, tmp) for stack in (*stackfile.STACKS, None)}
    try:
        for pack in started.values():
            pack.connect()
        yield started
    finally:
        for pack in started.values():
            pack.process.terminate()
        for pack in started.values():
            pack.process.wait(timeout=10)
            if pack.process.stdout is not None:
                pack.process.stdout.close()


def direct(stack: str, resources: list[RecordedResource], configured: bool, pack: Pack) -> list:
    cluster = stackfile.load(stack) if configured else None
    return policy_harness.analyze(resources, stack=stack, cluster=cluster, policy_config=pack.policy_config)


def ordered(violations: list[policy_harness.Violation]) -> list[policy_harness.Violation]:
    return sorted(violations, key=lambda v: (v.policy, v.resource or "", v.message, v.enforcement))


# --- the tests -----------------------------------------------------------------------------------


def test_the_pack_describes_its_policies_and_schemas_over_grpc(packs):
    info = packs[None].info
    assert info.name == guard.PACK_NAME and info.supportsConfig
    assert [p.name for p in info.policies] == [p.name for p in guard.POLICIES]
    for policy in info.policies:
        schema = json_format.MessageToDict(policy.configSchema.properties)
        assert schema.keys() == guard.SCHEMAS[policy.name].keys(), policy.name


def test_configure_delivers_the_example_config_over_the_schema_defaults(packs):
    config = packs["dev"].policy_config
    # The guide's minimum (the config's) is mandatory, its recommendation advisory.
    assert config["bandwidth-class"] == {"enforcementLevel": "mandatory", "minBandwidthGbps": 10}
    assert config["bandwidth-recommended"] == {"enforcementLevel": "advisory", "recommendedBandwidthGbps": 25}
    assert config["baseline-idle-timeout"]["enforcementLevel"] == "advisory"
    assert config["node-count"] == {"enforcementLevel": "mandatory", "minNodes": 2}


@pytest.mark.parametrize("configured", [True, False], ids=["with PULUMI_CONFIG", "without PULUMI_CONFIG"])
@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_the_real_stacks_get_the_same_verdicts_over_grpc(packs, stack, configured):
    pack = packs[stack if configured else None]
    render, _ = rendered(stack)
    over_grpc = pack.analyze(stack, render.resources)
    assert ordered(over_grpc) == ordered(direct(stack, render.resources, configured, pack))
    assert policy_harness.mandatory(over_grpc) == []
    advisories = [v.policy for v in over_grpc if v.enforcement == "advisory"]
    # With its config the pack knows the stack serves API keys without TLS (the committed stacks
    # do; offline they carry the throwaway key) and that its monitoring hosts are clients too
    # (monitoringCidrs inside clientCidrs), and says so; without it, that it cannot know.
    expected = ["keys-in-clear", "monitoring-inside-clients"] if configured else ["stack-config"]
    assert sorted(advisories) == expected
    if configured:
        (advisory,) = [v for v in over_grpc if v.policy == "keys-in-clear"]
        assert advisory.message.startswith("access.apiKeys are set and loadBalancer.tls is not")


@pytest.mark.parametrize("configured", [True, False], ids=["with PULUMI_CONFIG", "without PULUMI_CONFIG"])
@pytest.mark.parametrize(
    ("stack", "label", "mutate", "policy"),
    [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in mutation_cases(stackfile.STACKS)],
)
def test_a_refused_mutation_gets_the_same_verdicts_over_grpc(packs, stack, label, mutate, policy, configured):
    pack = packs[stack if configured else None]
    render, _ = rendered(stack)
    resources = mutate(render.resources)
    over_grpc = pack.analyze(stack, resources)
    assert ordered(over_grpc) == ordered(direct(stack, resources, configured, pack))
    assert policy in {v.policy for v in policy_harness.mandatory(over_grpc)}


@pytest.mark.parametrize("configured", [True, False], ids=["with PULUMI_CONFIG", "without PULUMI_CONFIG"])
@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_a_preview_gets_the_same_verdicts_over_grpc(packs, stack, configured):
    """Ids and computed outputs unknown (sentinel strings on the wire), property dependencies
    as the SDK sent them: the pack resolves references through those, as under the CLI."""
    pack = packs[stack if configured else None]
    preview = previewed(stack)
    over_grpc = pack.analyze(stack, preview.resources)
    assert ordered(over_grpc) == ordered(direct(stack, preview.resources, configured, pack))
    assert policy_harness.mandatory(over_grpc) == []


@pytest.mark.parametrize(
    ("stack", "label", "mutate", "policy"),
    [pytest.param(*case, id=f"{case[0]}: {case[1]}") for case in mutation_cases(stackfile.STACKS)],
)
def test_a_refused_mutation_of_a_preview_gets_the_same_verdicts_over_grpc(
    packs, stack, label, mutate, policy
):
    pack = packs[stack]
    resources = mutate(previewed(stack).resources)
    over_grpc = pack.analyze(stack, resources)
    assert ordered(over_grpc) == ordered(direct(stack, resources, True, pack))
    assert policy in {v.policy for v in policy_harness.mandatory(over_grpc)}


def _dev_with(type_: str, **changes: Any) -> list[RecordedResource]:
    render, _ = rendered("dev")
    resources = []
    for resource in render.resources:
        if resource.type == type_:
            inputs, outputs = {**resource.inputs, **changes}, {**resource.outputs, **changes}
            resource = RecordedResource(
                resource.type, resource.name, inputs, outputs, resource.custom, parent=resource.parent
            )
        resources.append(resource)
    return resources


@pytest.mark.parametrize("stack", ["dev", "onprem"])
def test_over_grpc_prometheus_opened_on_every_node_is_refused(packs, stack):
    render, _ = rendered(stack)
    resources = monitoring_port_on_every_node(render.resources)
    over_grpc = packs[stack].analyze(stack, resources)
    assert ordered(over_grpc) == ordered(direct(stack, resources, True, packs[stack]))
    refused = [v for v in policy_harness.mandatory(over_grpc) if v.policy == "port-exposure"]
    assert refused and all("runs on master only (monitoring.node)" in v.message for v in refused)


def test_over_grpc_a_target_group_on_port_8000_is_refused(packs):
    resources = _dev_with("aws:lb/targetGroup:TargetGroup", port=8000)
    refused = [v for v in packs["dev"].analyze("dev", resources) if v.policy == "required-paths"]
    assert [(v.enforcement, v.resource_type) for v in refused] == [
        ("mandatory", "aws:lb/targetGroup:TargetGroup")
    ]
    assert "forwards to port 8000; the model listens on 5000" in refused[0].message


def test_over_grpc_an_nlb_idle_timeout_of_60_s_is_flagged(packs):
    resources = _dev_with("aws:lb/listener:Listener", tcpIdleTimeoutSeconds=60)
    flagged = [v for v in packs["dev"].analyze("dev", resources) if v.policy == "baseline-idle-timeout"]
    assert [(v.enforcement, v.message) for v in flagged] == [
        ("advisory", "tcpIdleTimeoutSeconds 60 is below 600 s: a silent, thinking answer is cut off")
    ]


def test_over_grpc_the_policy_config_applies_and_its_numbers_print_as_integers(packs):
    pack = packs[None]
    example = pack.policy_config
    try:
        pack.configure({**example, "node-count": {"enforcementLevel": "mandatory", "minNodes": 3}})
        refused = [v for v in pack.analyze("dev", rendered("dev")[0].resources) if v.policy == "node-count"]
    finally:
        pack.configure(example)
    assert [v.enforcement for v in refused] == ["mandatory"]
    assert refused[0].message.endswith("; the cluster needs at least 3 (4 or more recommended)")


def test_over_grpc_without_the_stack_config_ssh_split_in_two_halves_is_refused(packs):
    """Each half alone is 0.0.0.0/1 or 128.0.0.0/1; together they are the world, on port 22."""
    resources = split_world(rendered("dev")[0].resources, "22")
    refused = [v for v in packs[None].analyze("dev", resources) if v.policy == "port-exposure"]
    assert {(v.enforcement, v.resource) for v in refused} == {
        ("mandatory", "hand-added-22-low"),
        ("mandatory", "hand-added-22-high"),
    }
    assert all("port 22 (SSH/RDP) is never open to the world" in v.message for v in refused)


def test_over_grpc_a_container_publishing_a_port_is_refused(packs):
    resources = publishing_container(rendered("onprem")[0].resources)
    refused = [
        v for v in packs["onprem"].analyze("onprem", resources) if v.policy == "container-host-network"
    ]
    assert {v.enforcement for v in refused} == {"mandatory"}
    assert {v.resource for v in refused} == {r.name for r in resources if r.name.endswith("-vllm")}
    assert any(v.message.startswith("ports[0] publishes 0.0.0.0:5000->5000/tcp") for v in refused)


@pytest.mark.parametrize("variant", ["onprem", "onprem-roce"])
def test_over_grpc_without_the_stack_config_the_kv_link_floor_is_judged_from_the_declaration(packs, variant):
    """The disaggregated onprem on its 25 Gbit/s NICs is refused, on 3200 Gbit/s it passes: the pack
    knows neither the serving mode nor the figures but from the KvLink declaration the program
    registers (components/kvlink.py), whose numbers arrive as doubles."""
    resources = pd_rendered(variant).resources
    over_grpc = packs[None].analyze("onprem", resources)
    assert ordered(over_grpc) == ordered(direct("onprem", resources, False, packs[None]))
    refused = [v for v in policy_harness.mandatory(over_grpc) if v.policy == "kv-link-floor"]
    if variant == "onprem-roce":
        assert policy_harness.mandatory(over_grpc) == []
    else:
        assert [(v.resource, v.resource_type) for v in refused] == [("kv-link", kvlink.DECLARATION_TYPE)]
        assert "25 Gbit/s per node is below the link floor of 63.2 Gbit/s" in refused[0].message


@pytest.fixture(scope="module")
def disaggregated_pack(engine, tmp_path_factory) -> Iterator[Pack]:
    """The pack started with the config of onprem made disaggregated on its 25 Gbit/s NICs."""
    _, address = engine
    pack = start("onprem", address, tmp_path_factory.mktemp("pd-pack"), pd_config("onprem"))
    try:
        pack.connect()
        yield pack
    finally:
        pack.process.terminate()
        pack.process.wait(timeout=10)
        if pack.process.stdout is not None:
            pack.process.stdout.close()


def test_over_grpc_with_the_stack_config_the_kv_link_floor_is_judged_from_the_config(disaggregated_pack):
    """PULUMI_CONFIG holds `serving` as JSON text, as the language host hands it over; the pack
    validates it as the program does and judges the floor from it, whatever the resources declare."""
    resources = [r for r in pd_rendered("onprem").resources if r.type != kvlink.DECLARATION_TYPE]
    over_grpc = disaggregated_pack.analyze("onprem", resources)
    cluster = stackfile.validate(pd_config("onprem"))
    direct_verdicts = policy_harness.analyze(
        resources, stack="onprem", cluster=cluster, policy_config=disaggregated_pack.policy_config
    )
    assert ordered(over_grpc) == ordered(direct_verdicts)
    (refused,) = [v for v in policy_harness.mandatory(over_grpc) if v.policy == "kv-link-floor"]
    assert refused.resource is None  # the stack: no KvLink resource here
    assert "25 Gbit/s per node is below the link floor of 63.2 Gbit/s" in refused.message
