"""What a change does to serving, decided from two offline renders and their diff
(tooling/changes/compare.py): nodes replaced, model servers restarted, replicas drained, the
most replicas out of service at once given the engine's dependency order, and whether the
endpoint stays up.

Decided per resource:
- machine: an EC2 instance of a GPU node (tag ROLE_TAG=GPU_NODE, qwen_cluster/tags.py)
  replaced or deleted;
- server: a model server restarted: an SSM association of the model-server document created
  anew or updated on an existing node, or a model-server container (CONTAINER_ROLE_LABEL head /
  pipeline-worker) replaced;
- drain: a replica taken out of the load balancer without a restart: a bare-metal drain step
  (named in DRAIN_SUFFIXES) that re-runs. It stays out until its health gate puts it back;
- endpoint: the NLB, its listener or target group, or the load-balancer container
  (CONTAINER_ROLE_LABEL load-balancer) replaced or deleted: every client connection drops;
- a health gate waits until its replica serves again before anything that depends on it starts:
  an SSM association with waitForSuccessTimeoutSeconds (its create waits; an update does not,
  see tooling/changes/rules.py), a container with `wait: true`, or a command named in
  HEALTH_GATE_SUFFIXES.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qwen_cluster import tags
from qwen_cluster.render import ssm
from qwen_cluster.render.rollout import DRAIN_SUFFIX, READY_SUFFIX
from tooling.changes.compare import Change, diff
from tooling.offline import RecordedResource, Render, references, strings

# components/baremetal/rollout.py: `<head>-ready` waits for the replica's /health (create only
# for a server marked down, update always) before the next replica's drain starts.
HEALTH_GATE_SUFFIXES: tuple[str, ...] = (READY_SUFFIX,)
# components/baremetal/rollout.py: `<head>-drain` has only an `update` (out of rotation, wait
# for the streams in flight). pulumi-command runs it on every update, whatever input changed
# (provider/pkg/provider/remote/commandController.go Update), and nothing on create or delete: a
# replaced drain (new `triggers`) runs nothing either.
DRAIN_SUFFIXES: tuple[str, ...] = (DRAIN_SUFFIX,)
# Rollout steps run on the load balancer's host but belong to the replica named by their head.
ROLLOUT_STEP_SUFFIXES: tuple[str, ...] = (*DRAIN_SUFFIXES, *HEALTH_GATE_SUFFIXES)

_ENDPOINT_TYPES = (
    "aws:lb/loadBalancer:LoadBalancer",
    "aws:lb/listener:Listener",
    "aws:lb/targetGroup:TargetGroup",
)
# Values of tags.CONTAINER_ROLE_LABEL on bare metal (components/baremetal/serving.py).
_SERVER_LABELS = (tags.HEAD_CONTAINER, tags.PIPELINE_WORKER_CONTAINER)
_LOAD_BALANCER_LABEL = tags.LOAD_BALANCER_CONTAINER
# On the load balancer's host but no replica's: nginx, and vLLM's router behind it. A router
# replaced costs no request (nginx sends to the replicas meanwhile: render/nginx.py
# router_server), so its change is no serving impact.
_BALANCER_LABELS = (tags.LOAD_BALANCER_CONTAINER, tags.ROUTER_CONTAINER)
# The model-server document's parameters (qwen_cluster/render/ssm.py): a run restarts the
# container only when the hash of what it runs changed, or on a new instance (targets).
_SERVER_CONFIG_PARAMETER = ssm.CONFIG_HASH_PARAMETER


@dataclass
class Rollout:
    replicas: int
    max_replicas_out_of_service: int
    nodes_replaced: list[str]
    servers_restarted: list[str]
    replicas_drained: list[str]  # replicas taken out of the load balancer, named as in steps
    endpoint_stays_up: bool
    endpoint_changes: list[str]
    collisions: list[str]
    steps: list[list[str]]  # replicas out of service together, in the order the engine reaches them
    # The lanes the change rolls in (replicas it takes out, lane by lane; rollout.maxUnavailable),
    # what every lane waits for first (the program's staged resources that change), and the
    # longest the rollout can take: the longest lane times one replica's bound (its drain and
    # health timeouts, plus the image pull on AWS), after staging.
    lanes: list[list[str]] = field(default_factory=list)
    staged_first: list[str] = field(default_factory=list)
    replica_bound_seconds: int = 0

    @property
    def at_most_seconds(self) -> int:
        return max((len(lane) for lane in self.lanes), default=0) * self.replica_bound_seconds

    def lanes_dict(self) -> dict[str, Any]:
        return {
            "lanes": self.lanes,
            "mostOutOfServiceAtOnce": self.max_replicas_out_of_service,
            "stagedFirst": self.staged_first,
            "replicaBoundSeconds": self.replica_bound_seconds,
            "atMostSeconds": self.at_most_seconds,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "maxReplicasOutOfService": self.max_replicas_out_of_service,
            "nodesReplaced": self.nodes_replaced,
            "serversRestarted": self.servers_restarted,
            "replicasDrained": self.replicas_drained,
            "endpointStaysUp": self.endpoint_stays_up,
            "endpointChanges": self.endpoint_changes,
            "collisions": self.collisions,
            "steps": self.steps,
            "lanes": self.lanes_dict(),
        }


def _layout(render: Render) -> tuple[dict[str, str], dict[str, int]]:
    """The render's nodes: IP -> name, and name -> replica index (master first, consecutive
    groups of pipelineParallel nodes, as qwen_cluster/topology.py builds them)."""
    summary = render.outputs.get("summary") or {}
    nodes = summary.get("nodes") or []
    pipeline = int((summary.get("topology") or {}).get("pipelineParallel") or 1)
    ordered = sorted(nodes, key=lambda node: node.get("role") != "master")
    replica_of = {node["name"]: index // pipeline for index, node in enumerate(ordered)}
    return {node["ip"]: node["name"] for node in nodes}, replica_of


def _host_of(resource: RecordedResource, providers: Mapping[str, RecordedResource]) -> str | None:
    connection = resource.inputs.get("connection")
    if isinstance(connection, Mapping):
        connection = connection.get("value", connection)
        if isinstance(connection, Mapping) and connection.get("host"):
            return str(connection["host"])
    if resource.provider:
        provider_name = resource.provider.split("::")[-2] if "::" in resource.provider else ""
        provider = providers.get(provider_name)
        host = str((provider.inputs.get("host") if provider else "") or "")
        if host.startswith("ssh://"):
            return host.removeprefix("ssh://").split("@")[-1].split(":")[0]
    return None


def _labels(resource: RecordedResource) -> dict[str, str]:
    return {str(item.get("label")): str(item.get("value")) for item in resource.inputs.get("labels") or []}


def owners(render: Render) -> dict[str, str]:
    """Custom resource name -> the node it belongs to, where it belongs to one."""
    by_ip, _ = _layout(render)
    providers = {r.name: r for r in render.resources if r.type.startswith("pulumi:providers:")}
    owner: dict[str, str] = {}
    for resource in render.custom_resources:
        named = next(
            (resource.name.removesuffix(s) for s in ROLLOUT_STEP_SUFFIXES if resource.name.endswith(s)), ""
        )
        if resource.type == "command:remote:Command" and named in by_ip.values():
            owner[resource.name] = named
            continue
        resource_tags = resource.inputs.get("tags") or {}
        if isinstance(resource_tags, Mapping) and resource_tags.get(tags.NODE_TAG):
            owner[resource.name] = str(resource_tags[tags.NODE_TAG])
            continue
        host = _host_of(resource, providers)
        if host in by_ip and _labels(resource).get(tags.CONTAINER_ROLE_LABEL) not in _BALANCER_LABELS:
            owner[resource.name] = by_ip[host]
    # The rest by reference: a resource whose references reach nodes of one replica only
    # (a target-group attachment, a node's association) belongs to the first node referenced.
    _, replica_of = _layout(render)
    marks = references(render.custom_resources)
    for resource in render.custom_resources:
        if resource.name in owner:
            continue
        reached = [
            owner[marks[text].name]
            for text in strings(resource.inputs)
            if text in marks and marks[text].name in owner
        ]
        if reached and len({replica_of.get(node) for node in reached}) == 1:
            owner[resource.name] = reached[0]
    return owner


def _impact(resource: RecordedResource, change: Change, before: RecordedResource | None) -> str | None:
    """machine / server / drain / endpoint, or None when the change leaves serving alone."""
    action = change.action
    resource_tags = resource.inputs.get("tags") or {}
    role = resource_tags.get(tags.ROLE_TAG) if isinstance(resource_tags, Mapping) else None
    if resource.type == "aws:ec2/instance:Instance" and role == tags.GPU_NODE:
        return "machine" if action in ("replace", "delete") else None
    if resource.type in _ENDPOINT_TYPES:
        return "endpoint" if action in ("replace", "delete") else None
    if resource.type == "docker:index/container:Container":
        label = _labels(resource).get(tags.CONTAINER_ROLE_LABEL)
        if action in ("replace", "delete"):
            if label == _LOAD_BALANCER_LABEL:
                return "endpoint"
            return "server" if label in _SERVER_LABELS else None
        return None
    if resource.type == "aws:ssm/association:Association":
        parameters = resource.inputs.get("parameters") or {}
        if _SERVER_CONFIG_PARAMETER not in parameters or action not in ("replace", "update"):
            return None
        old_parameters = (before.inputs.get("parameters") or {}) if before else {}
        restarts = old_parameters.get(_SERVER_CONFIG_PARAMETER) != parameters[_SERVER_CONFIG_PARAMETER]
        return "server" if restarts or "targets" in change.keys else None
    if resource.type == "command:remote:Command" and resource.name.endswith(DRAIN_SUFFIXES):
        return "drain" if action == "update" else None
    return None


def is_health_gate(resource: RecordedResource) -> bool:
    """A resource whose change (see `_gates` for which) waits until its replica serves again:
    the day-2 chain is counted in these (`make bench`, Render.critical_path)."""
    if resource.type == "aws:ssm/association:Association":
        # Only the model server's runs wait for a replica's health; the node proxy's (no
        # ConfigHash) waits for nginx alone and gates nothing.
        serves = _SERVER_CONFIG_PARAMETER in (resource.inputs.get("parameters") or {})
        return serves and bool(resource.inputs.get("waitForSuccessTimeoutSeconds"))
    if resource.type == "docker:index/container:Container":
        return bool(resource.inputs.get("wait"))
    if resource.type == "command:remote:Command":
        return bool(HEALTH_GATE_SUFFIXES) and resource.name.endswith(HEALTH_GATE_SUFFIXES)
    return False


def waits_on_create(resource: RecordedResource) -> bool:
    """A health gate whose creation waits for a model to load, on day 0 too: an association
    (its create waits for the run, association.go) or a container with `wait`. A bare-metal
    `ready` is created waiting only for a server marked down, and on day 0 none is
    (components/baremetal/rollout.py)."""
    return is_health_gate(resource) and resource.type != "command:remote:Command"


def _gates(resource: RecordedResource, change: Change) -> bool:
    """A change that, once carried out, has waited for its replica to serve again."""
    if change.action == "same" or change.action == "delete":
        return False
    if resource.type == "aws:ssm/association:Association":
        # A staging association waits for its node's pull and fetch, not for a replica to serve
        # again (qwen_cluster/render/ssm.py stage_document): it gates nothing.
        if any(name in (resource.inputs.get("parameters") or {}) for name in ssm.STAGE_PARAMETERS):
            return False
        # Only a create (a new association or a replacement) waits: association.go.
        return is_health_gate(resource) and change.action in ("create", "replace")
    return is_health_gate(resource)


def _ancestors(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    memo: dict[str, set[str]] = {}

    def walk(name: str, stack: frozenset[str]) -> set[str]:
        if name in memo:
            return memo[name]
        found: set[str] = set()
        for parent in graph.get(name, ()):
            if parent not in stack:
                found |= {parent} | walk(parent, stack | {parent})
        memo[name] = found
        return found

    for name in graph:
        walk(name, frozenset({name}))
    return memo


def rollout(old: Render, new: Render, changes: Sequence[Change] | None = None) -> Rollout:
    """What the changes do to serving, computed from the renders: which replicas go out of
    service, and which of those the engine's dependency order (through health gates) keeps
    apart."""
    changes = list(diff(old, new) if changes is None else changes)
    new_by = {r.name: r for r in new.custom_resources}
    old_by = {r.name: r for r in old.custom_resources}
    owner = owners(new) | {k: v for k, v in owners(old).items() if k not in new_by}
    _, replica_of = _layout(new)
    replicas = len(set(replica_of.values()))

    events: dict[str, tuple[int, str]] = {}  # resource -> (replica, impact)
    gates: dict[str, int] = {}  # resource -> replica it gates
    endpoint: list[str] = []
    nodes_replaced: set[str] = set()
    servers: set[str] = set()
    drained: set[int] = set()
    for change in changes:
        resource = new_by.get(change.name) or old_by.get(change.name)
        impact = _impact(resource, change, old_by.get(change.name))
        node = owner.get(change.name)
        replica = replica_of.get(node) if node else None
        if impact == "endpoint":
            endpoint.append(f"{change.name} ({change.action})")
            continue
        if change.name in new_by and node is not None and replica is not None and _gates(resource, change):
            gates[change.name] = replica
        if impact is None or node is None or replica is None:
            continue  # a node leaving or arriving is not an outage of a serving replica
        if change.action == "create":
            continue
        events[change.name] = (replica, impact)
        if impact == "machine":
            nodes_replaced.add(node)
            servers.add(node)
        elif impact == "server":
            servers.add(node)
        elif impact == "drain":
            drained.add(replica)

    # Waves: an event waits for an earlier one when, between them in the dependency graph,
    # a health gate of the earlier event's replica has to pass.
    ancestors = _ancestors(new.dependencies())
    wave: dict[str, int] = {}

    def wave_of(name: str, seen: frozenset[str]) -> int:
        if name in wave:
            return wave[name]
        above = ancestors.get(name, set())
        best = 0
        for earlier, (replica, _) in events.items():
            if earlier in seen:
                continue
            passed = any(
                gate_replica == replica
                and gate in above
                and (gate == earlier or earlier in ancestors.get(gate, ()))
                for gate, gate_replica in gates.items()
            )
            if passed:
                best = max(best, wave_of(earlier, seen | {earlier}) + 1)
        wave[name] = best
        return best

    steps: dict[int, set[int]] = {}
    for name, (replica, _) in events.items():
        steps.setdefault(wave_of(name, frozenset({name})), set()).add(replica)
    ordered = [sorted(steps[index]) for index in sorted(steps)]
    most = max((len(step) for step in ordered), default=0)
    collisions = [f"{c.name}: create-before-delete on {c.collision}" for c in changes if c.collision]
    stays_up = not endpoint and (replicas == 0 or most < replicas)
    names_by_replica: dict[int, list[str]] = {}
    for node, index in replica_of.items():
        names_by_replica.setdefault(index, []).append(node)

    def replica_name(index: int) -> str:
        return "+".join(sorted(names_by_replica.get(index, [str(index)])))

    settings = new.outputs.get("rollout") or {}
    affected = {replica for replica, _ in events.values()} | drained
    lanes = [
        [replica_name(replica_of[head]) for head in lane if replica_of.get(head) in affected]
        for lane in settings.get("lanes") or []
    ]
    changed = {c.name for c in changes if c.action != "same"}
    staged = [str(urn).rsplit("::", 1)[-1] for urn in settings.get("staged") or []]
    return Rollout(
        lanes=[lane for lane in lanes if lane],
        staged_first=[name for name in staged if name in changed],
        replica_bound_seconds=int(settings.get("replicaBoundSeconds") or 0),
        replicas=replicas,
        max_replicas_out_of_service=most,
        nodes_replaced=sorted(nodes_replaced),
        servers_restarted=sorted(servers),
        replicas_drained=[replica_name(index) for index in sorted(drained)],
        endpoint_stays_up=stays_up,
        endpoint_changes=endpoint,
        collisions=collisions,
        steps=[[replica_name(index) for index in step] for step in ordered],
    )


def verdict(summary: Rollout) -> int:
    """The plan's exit code: 0 the endpoint stays up, 3 every replica down at once, the
    endpoint replaced, or a replacement that would collide."""
    return 0 if summary.endpoint_stays_up and not summary.collisions else 3
