"""Fixture stacks for the policy tests: a good AWS stack shaped like dev, a good bare-metal stack
shaped like onprem, and the mutations the tests apply to them (and to the real rendered stacks).

Resources are `RecordedResource`s as the offline render records them; references between them
use the mock id `<name>-id`, from which the harness rebuilds the engine's property dependencies.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from policies import containers
from policies import normalized as net
from qwen_cluster import kvlink
from qwen_cluster.render import firewall
from tooling import policy_harness
from tooling.offline import RecordedResource

ROLE = net.ROLE_TAG
CONTAINER = containers.CONTAINER


def res(type_: str, resource_name: str, /, **inputs: Any) -> RecordedResource:
    outputs = copy.deepcopy(inputs)
    outputs.setdefault("arn", f"arn:aws:mock:::{type_.split(':')[-1].lower()}/{resource_name}")
    return RecordedResource(type_, resource_name, inputs, outputs, True)


def ingress(name: str, group: str, description: str = "a rule", **fields: Any) -> RecordedResource:
    return res(net.INGRESS_RULE, name, securityGroupId=f"{group}-id", description=description, **fields)


def egress(name: str, group: str, description: str = "a rule", **fields: Any) -> RecordedResource:
    return res(net.EGRESS_RULE, name, securityGroupId=f"{group}-id", description=description, **fields)


def instance(name: str, kind: str = "g6e.12xlarge", **overrides: Any) -> RecordedResource:
    inputs: dict[str, Any] = {
        "instanceType": kind,
        "launchTemplate": {"id": "dev-node-template-id", "version": "$Latest"},
        "subnetId": "dev-subnet-id",
        "availabilityZone": "us-west-2a",
        "placementGroup": "dev-placement",
        "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 2},
        "rootBlockDevice": {"encrypted": True, "volumeSize": 500, "volumeType": "gp3"},
        "associatePublicIpAddress": False,
        "tags": {ROLE: net.GPU_NODE, "Name": name},
    }
    inputs.update(overrides)
    return res(net.INSTANCE, name, **inputs)


def container(name: str, **overrides: Any) -> RecordedResource:
    """A bare-metal container as the program registers it: host network, nothing published."""
    inputs: dict[str, Any] = {"name": name, "image": "nginx:1.27.3", "networkMode": "host"}
    inputs.update(overrides)
    return res(CONTAINER, name, **inputs)


def aws_stack() -> list[RecordedResource]:
    """What the AWS target builds for dev: 2 x g6e.12xlarge with EFA behind an internal NLB."""
    return [
        res("aws:ec2/vpc:Vpc", "dev-vpc", cidrBlock="10.42.0.0/16"),
        res(
            "aws:ec2/subnet:Subnet",
            "dev-subnet",
            vpcId="dev-vpc-id",
            cidrBlock="10.42.1.0/24",
            availabilityZone="us-west-2a",
        ),
        res(net.PLACEMENT_GROUP, "dev-placement", name="dev-placement", strategy="cluster"),
        res(
            net.SECURITY_GROUP,
            "dev-node-sg",
            vpcId="dev-vpc-id",
            description="GPU nodes",
            tags={ROLE: "node-sg"},
        ),
        res(net.SECURITY_GROUP, "dev-lb-sg", vpcId="dev-vpc-id", description="the NLB", tags={ROLE: "lb-sg"}),
        ingress("dev-cluster-in", "dev-node-sg", referencedSecurityGroupId="dev-node-sg-id", ipProtocol="-1"),
        egress("dev-cluster-out", "dev-node-sg", referencedSecurityGroupId="dev-node-sg-id", ipProtocol="-1"),
        ingress(
            "dev-model-in",
            "dev-node-sg",
            referencedSecurityGroupId="dev-lb-sg-id",
            ipProtocol="tcp",
            fromPort=5000,
            toPort=5000,
        ),
        ingress(
            "dev-monitoring-in",
            "dev-node-sg",
            cidrIpv4="10.20.0.0/16",
            ipProtocol="tcp",
            fromPort=8000,
            toPort=8000,
        ),
        ingress(
            "dev-listener-in", "dev-lb-sg", cidrIpv4="10.0.0.0/8", ipProtocol="tcp", fromPort=80, toPort=80
        ),
        egress(
            "dev-lb-to-model",
            "dev-lb-sg",
            referencedSecurityGroupId="dev-node-sg-id",
            ipProtocol="tcp",
            fromPort=5000,
            toPort=5000,
        ),
        res(
            net.LAUNCH_TEMPLATE,
            "dev-node-template",
            instanceType="g6e.12xlarge",
            metadataOptions={"httpTokens": "required", "httpPutResponseHopLimit": 2},
            blockDeviceMappings=[
                {"deviceName": "/dev/sda1", "ebs": {"encrypted": "true", "volumeSize": 500}}
            ],
            networkInterfaces=[
                {
                    "deviceIndex": 0,
                    "networkCardIndex": 0,
                    "interfaceType": "efa",
                    "subnetId": "dev-subnet-id",
                    "securityGroups": ["dev-node-sg-id"],
                    "associatePublicIpAddress": "false",
                }
            ],
            placement={"groupName": "dev-placement", "availabilityZone": "us-west-2a"},
            tags={ROLE: net.GPU_NODE},
        ),
        instance("dev-master", privateIp="10.42.1.100"),
        instance("dev-worker-1", privateIp="10.42.1.101"),
        res(
            net.LOAD_BALANCER,
            "dev-nlb",
            loadBalancerType="network",
            internal=True,
            subnets=["dev-subnet-id"],
            securityGroups=["dev-lb-sg-id"],
        ),
        res(
            net.TARGET_GROUP,
            "dev-model",
            port=5000,
            protocol="TCP",
            targetType="instance",
            vpcId="dev-vpc-id",
            healthCheck={"enabled": True, "protocol": "HTTP", "path": "/health", "port": "traffic-port"},
        ),
        res(
            net.TARGET_GROUP_ATTACHMENT,
            "dev-model-master",
            targetGroupArn="arn:aws:mock:::targetgroup/dev-model",
            targetId="dev-master-id",
            port=5000,
        ),
        res(
            net.TARGET_GROUP_ATTACHMENT,
            "dev-model-worker-1",
            targetGroupArn="arn:aws:mock:::targetgroup/dev-model",
            targetId="dev-worker-1-id",
            port=5000,
        ),
        res(
            net.LISTENER,
            "dev-listener",
            loadBalancerArn="arn:aws:mock:::loadbalancer/dev-nlb",
            port=80,
            protocol="TCP",
            tcpIdleTimeoutSeconds=3600,
            defaultActions=[{"type": "forward", "targetGroupArn": "arn:aws:mock:::targetgroup/dev-model"}],
        ),
    ]


ONPREM_HOSTS = {
    "master": "192.168.1.100",
    "worker-1": "192.168.1.101",
    "worker-2": "192.168.1.102",
    "worker-3": "192.168.1.103",
}


def firewall_document(host: str, address: str, *, load_balancer: bool = False) -> dict[str, Any]:
    members = [f"{ip}/32" for ip in ONPREM_HOSTS.values()]
    rules = [
        {
            "action": "allow",
            "protocol": "all",
            "ports": None,
            "sources": members,
            "description": "all traffic between cluster nodes (NCCL/EFA use unpinnable ports)",
        },
        {
            "action": "allow",
            "protocol": "tcp",
            "ports": "5000",
            "sources": ["192.168.1.100/32"],
            "description": "model-service 5000/tcp from the load balancer only",
        },
        {
            "action": "allow",
            "protocol": "tcp",
            "ports": 8000,
            "sources": ["10.20.0.0/16"],
            "description": "monitoring 8000/tcp from monitoringCidrs",
        },
        {
            "action": "allow",
            "protocol": "tcp",
            "ports": "22",
            "sources": ["203.0.113.10/32"],
            "description": "SSH 22/tcp from adminCidrs",
        },
    ]
    if load_balancer:
        rules.append(
            {
                "action": "allow",
                "protocol": "tcp",
                "ports": "80",
                "sources": ["10.0.0.0/8"],
                "description": "load balancer listener 80/tcp from clientCidrs",
            }
        )
    return {
        "schema": net.FIREWALL_SCHEMA,
        "host": host,
        "address": address,
        "role": net.GPU_NODE,
        "nicSpeedGbps": 25,
        "loadBalancer": load_balancer,
        "listenerPort": 80 if load_balancer else None,
        "rules": rules,
    }


def firewall_command(host: str, address: str, *, load_balancer: bool = False, as_text: bool = True, **extra):
    document = firewall_document(host, address, load_balancer=load_balancer)
    trigger = json.dumps(document) if as_text else document
    return res(
        net.REMOTE_COMMAND,
        f"onprem-{host}-firewall",
        connection={"host": address, "user": "ubuntu"},
        create="set -eu\nufw --force reset\nufw default deny incoming\nufw --force enable\n",
        triggers=[trigger],
        **extra,
    )


def bare_metal_stack() -> list[RecordedResource]:
    """What the bare-metal target builds for onprem: one firewall command and one model-server
    container (host network) per host."""
    containers = [container(f"onprem-{host}-vllm", image="vllm/vllm-openai:v0.33.0") for host in ONPREM_HOSTS]
    commands = [
        firewall_command(host, address, load_balancer=(host == "master"), as_text=(host != "worker-3"))
        for host, address in ONPREM_HOSTS.items()
    ]
    commands.append(
        res(
            net.REMOTE_COMMAND,
            "onprem-master-sysctl",
            connection={"host": "192.168.1.100"},
            create="sudo tee /etc/sysctl.d/90-qwen-cluster.conf >/dev/null && sudo sysctl --system",
        )
    )
    return commands + containers


# --- mutations ------------------------------------------------------------------------------------


def _set(resource: RecordedResource, path: tuple[str, ...], value: Any) -> None:
    for props in (resource.inputs, resource.outputs):
        target = props
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value


def _documents(resource: RecordedResource) -> list[tuple[int | None, dict[str, Any], bool]]:
    """(index in triggers, or None inside the `create` script; document; given as text)."""
    found: list[tuple[int | None, dict[str, Any], bool]] = []
    for index, trigger in enumerate(resource.inputs.get("triggers") or []):
        text = isinstance(trigger, str)
        try:
            document = json.loads(trigger) if text else trigger
        except json.JSONDecodeError:
            continue  # another trigger (a script's hash), as the policy pack skips it too
        if isinstance(document, dict) and document.get("schema") == net.FIREWALL_SCHEMA:
            found.append((index, document, text))
    # The bare-metal target's own form: the document inside the firewall script.
    for embedded in firewall.embedded_documents(resource.inputs.get("create")):
        found.append((None, json.loads(embedded), True))
    return found


def _rewrite_documents(resources: list[RecordedResource], change) -> None:
    for resource in resources:
        for index, document, text in _documents(resource):
            original = json.dumps(document, sort_keys=True, separators=(",", ":"))
            document = copy.deepcopy(document)
            change(document)
            for props in (resource.inputs, resource.outputs):
                if index is None:
                    compact = json.dumps(document, sort_keys=True, separators=(",", ":"))
                    props["create"] = props["create"].replace(original, compact)
                else:
                    props["triggers"] = list(props["triggers"])
                    props["triggers"][index] = json.dumps(document) if text else document


def _node_groups(resources: list[RecordedResource]) -> list[RecordedResource]:
    return [r for r in resources if r.type == net.SECURITY_GROUP and net.role_of(r.inputs) == net.NODE_SG]


def _gpu_nodes(resources: list[RecordedResource]) -> list[RecordedResource]:
    return [r for r in resources if net.is_gpu_node(r.type, r.inputs)]


def opened_by_hand(
    resources: list[RecordedResource], ports: str, source: str, protocol: str = "tcp"
) -> list[RecordedResource]:
    """A hand-added rule admitting `source` to `ports` on every node: its security group's
    ingress and every host's firewall document."""
    resources = copy.deepcopy(resources)
    low, _, high = ports.partition("-")
    for group in _node_groups(resources):
        resources.append(
            ingress(
                f"hand-added-{ports}",
                group.name,
                description="opened by hand",
                cidrIpv4=source,
                ipProtocol=protocol,
                fromPort=int(low),
                toPort=int(high or low),
            )
        )
    _rewrite_documents(
        resources,
        lambda doc: doc["rules"].append(
            {
                "action": "allow",
                "protocol": protocol,
                "ports": ports,
                "sources": [source],
                "description": "opened by hand",
            }
        ),
    )
    return resources


def open_to_world(
    resources: list[RecordedResource], ports: str, protocol: str = "tcp"
) -> list[RecordedResource]:
    """A hand-added rule opening `ports` to 0.0.0.0/0 on the nodes."""
    return opened_by_hand(resources, ports, "0.0.0.0/0", protocol)


def monitoring_port_on_every_node(
    resources: list[RecordedResource], port: int = 9090
) -> list[RecordedResource]:
    """Prometheus's port opened to monitoringCidrs (10.20.0.0/16) on every node (the node security
    group, every host's firewall), not only on `monitoring.node` where it runs."""
    return opened_by_hand(resources, str(port), "10.20.0.0/16")


def instance_type(resources: list[RecordedResource], kind: str) -> list[RecordedResource]:
    """Every GPU node launches `kind` (bare metal: a 1 Gbit/s NIC, the on-premises equivalent)."""
    resources = copy.deepcopy(resources)
    for node in _gpu_nodes(resources):
        if "instanceType" in node.inputs:
            _set(node, ("instanceType",), kind)
    _rewrite_documents(resources, lambda doc: doc.update(nicSpeedGbps=1))
    return resources


def placement_strategy(resources: list[RecordedResource], strategy: str) -> list[RecordedResource]:
    resources = copy.deepcopy(resources)
    for group in resources:
        if group.type == net.PLACEMENT_GROUP:
            _set(group, ("strategy",), strategy)
    return resources


def one_node(resources: list[RecordedResource]) -> list[RecordedResource]:
    """Keep only the first GPU instance (or host); drop the others and what points at them."""
    resources = copy.deepcopy(resources)
    instances = [r for r in _gpu_nodes(resources) if r.type == net.INSTANCE]
    hosts = [r for r in resources if _documents(r)]
    dropped = {r.name for r in instances[1:]} | {r.name for r in hosts[1:]}
    kept = []
    for resource in resources:
        if resource.name in dropped:
            continue
        if any(isinstance(v, str) and v.removesuffix("-id") in dropped for v in resource.inputs.values()):
            continue
        if resource.type == net.AUTOSCALING_GROUP:
            for key in ("desiredCapacity", "minSize", "maxSize"):
                if key in resource.inputs:
                    _set(resource, (key,), 1)
        kept.append(resource)
    return kept


def imdsv1(resources: list[RecordedResource]) -> list[RecordedResource]:
    resources = copy.deepcopy(resources)
    for node in _gpu_nodes(resources):
        if node.type in (net.INSTANCE, net.LAUNCH_TEMPLATE):
            _set(node, ("metadataOptions", "httpTokens"), "optional")
    return resources


def _resolver(resource: RecordedResource):
    """A referenced resource's name: from the recorded property dependencies (a preview's ids are
    unknown), else from the mock id `<name>-id`."""
    recorded = resource.property_dependencies or {}

    def resolve(prop: str, value: Any) -> str:
        names = recorded.get(prop.split(".", 1)[0], [])
        return names[0] if len(names) == 1 else str(value).removesuffix("-id")

    return resolve


def without_egress_self_rule(resources: list[RecordedResource]) -> list[RecordedResource]:
    """Drop the node security group's all-traffic egress rule to itself (standalone or inline)."""
    resources = copy.deepcopy(resources)
    groups = {g.name for g in _node_groups(resources)}
    kept = []
    for resource in resources:
        rules = net.rules_of(resource.type, resource.name, resource.inputs, _resolver(resource))
        if resource.type in (net.EGRESS_RULE, net.SECURITY_GROUP_RULE) and any(
            r.direction == "egress"
            and r.group in groups
            and r.all_traffic
            and any(p.kind == "self" for p in r.peers)
            for r in rules
        ):
            continue
        if resource.type == net.SECURITY_GROUP and resource.name in groups:
            entries = [
                e
                for e in resource.inputs.get("egress", [])
                if not (net.protocol_name(e.get("protocol")) == "all" and e.get("self"))
            ]
            _set(resource, ("egress",), entries)
        kept.append(resource)
    return kept


def publishing_container(resources: list[RecordedResource]) -> list[RecordedResource]:
    """The model server containers publish their port (`docker run -p 5000:5000`) on a bridge."""
    resources = copy.deepcopy(resources)
    for resource in resources:
        if resource.type == CONTAINER and resource.name.endswith("-vllm"):
            _set(resource, ("networkMode",), "bridge")
            published = {"internal": 5000, "external": 5000, "ip": "0.0.0.0", "protocol": "tcp"}
            _set(resource, ("ports",), [published])
    return resources


def split_world(resources: list[RecordedResource], ports: str) -> list[RecordedResource]:
    """`ports` opened to the world in two halves, 0.0.0.0/1 and 128.0.0.0/1, by two hand-added
    rules on the nodes (two standalone rules; on bare metal two entries of each host's firewall)."""
    resources = copy.deepcopy(resources)
    low, _, high = ports.partition("-")
    for group in _node_groups(resources):
        for half, cidr in (("low", "0.0.0.0/1"), ("high", "128.0.0.0/1")):
            resources.append(
                ingress(
                    f"hand-added-{ports}-{half}",
                    group.name,
                    description="opened by hand",
                    cidrIpv4=cidr,
                    ipProtocol="tcp",
                    fromPort=int(low),
                    toPort=int(high or low),
                )
            )

    def halves(doc: dict[str, Any]) -> None:
        for cidr in ("0.0.0.0/1", "128.0.0.0/1"):
            entry = {"action": "allow", "protocol": "tcp", "ports": ports, "sources": [cidr]}
            doc["rules"].append({**entry, "description": "opened by hand"})

    _rewrite_documents(resources, halves)
    return resources


MUTATIONS = {
    "SSH from the world in two halves": (lambda rs: split_world(rs, "22"), "port-exposure"),
    "6000-6100 open to the world": (lambda rs: open_to_world(rs, "6000-6100"), "port-exposure"),
    "5000 open to the world": (lambda rs: open_to_world(rs, "5000"), "port-exposure"),
    "SSH from the world": (lambda rs: open_to_world(rs, "22"), "port-exposure"),
    "t3.large nodes": (lambda rs: instance_type(rs, "t3.large"), "bandwidth-class"),
    "one node": (one_node, "node-count"),
}
AWS_MUTATIONS = {
    "spread placement group": (lambda rs: placement_strategy(rs, "spread"), "efa-placement"),
    "IMDSv1": (imdsv1, "baseline-imdsv2"),
    "egress self-rule missing": (without_egress_self_rule, "required-paths"),
}


BARE_METAL_MUTATIONS = {
    "a container publishing a port": (publishing_container, "container-host-network"),
}


def mutation_cases(stacks):
    """(stack, label, mutate, policy) for every mutation that applies to each stack."""
    for stack in stacks:
        mutations = dict(MUTATIONS)
        mutations.update(AWS_MUTATIONS if stack != "onprem" else BARE_METAL_MUTATIONS)
        for label, (mutate, policy) in mutations.items():
            yield stack, label, mutate, policy


_RENDERS: dict[str, Any] = {}


def rendered(stack: str):
    """(Render, violations) of a real stack under mocks, once per test session."""
    if stack not in _RENDERS:
        _RENDERS[stack] = policy_harness.check_stack(stack)
    return _RENDERS[stack]


_PREVIEWS: dict[str, Any] = {}


def previewed(stack: str):
    """A real stack rendered as `pulumi preview` of a new stack sees it, once per test session."""
    from tooling import offline

    if stack not in _PREVIEWS:
        _PREVIEWS[stack] = offline.render_stack(stack, preview=True)
    return _PREVIEWS[stack]


# --- disaggregated serving -------------------------------------------------------------------------

# The split the docs use on the four-node stacks: two prefill nodes hand their KV to two decode nodes.
PD_POOLS = (
    "serving.mode=disaggregated",
    'serving.prefill={"nodes":["master","worker-1"]}',
    'serving.decode={"nodes":["worker-2","worker-3"]}',
)
# The variants of docs/disaggregation.md, as `scripts/plan.py STACK --change ...` takes them:
# name -> (stack, changes).
PD_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    # p5.48xlarge, EFA, NIXL's LIBFABRIC backend (the default on aws): passes.
    "prod": ("prod", PD_POOLS),
    # The same over UCX: refused (NIXL's UCX backend does not connect across nodes on EFA).
    "prod-ucx": ("prod", (*PD_POOLS, "serving.kvTransfer.backend=ucx")),
    # The committed onprem (25 Gbit/s NICs) with H100s: refused by kv-link-floor.
    "onprem": ("onprem", (*PD_POOLS, "bareMetal.gpuModel=H100")),
    # onprem on 8 x 400 Gbit/s RoCE with UCX: passes.
    "onprem-roce": (
        "onprem",
        (
            *PD_POOLS,
            "bareMetal.gpuModel=H100",
            "bareMetal.nicSpeedGbps=3200",
            "serving.kvTransfer.backend=ucx",
        ),
    ),
}


def pd_config(variant: str) -> dict[str, Any]:
    """The stack config of a PD_VARIANTS entry (a stack file's `config:` map with its changes)."""
    from tooling import changes, stackfile

    stack, texts = PD_VARIANTS[variant]
    return changes.apply_changes(stackfile.read(stack), texts)


def pd_command(variant: str) -> str:
    """The variant as a user types it (docs/disaggregation.md shows exactly this, one line)."""
    stack, texts = PD_VARIANTS[variant]
    quoted = " ".join(
        f"--change '{text}'" if any(c in text for c in '{}" ') else f"--change {text}" for text in texts
    )
    return f".venv/bin/python scripts/plan.py {stack} {quoted}"


_PD_RENDERS: dict[tuple[str, bool], Any] = {}


def pd_rendered(variant: str, *, preview: bool = False):
    """A PD_VARIANTS entry rendered under mocks (as `pulumi preview` of a new stack with
    `preview`), once per test session."""
    from tooling import offline

    key = (variant, preview)
    if key not in _PD_RENDERS:
        stack, _ = PD_VARIANTS[variant]
        _PD_RENDERS[key] = offline.render(pd_config(variant), stack, preview=preview)
    return _PD_RENDERS[key]


def kv_link_document(**fields: Any) -> dict[str, Any]:
    """A `qwen-cluster/kv-link@1` declaration shaped like the committed onprem made disaggregated
    (25 Gbit/s, H100, tensor parallel 4: refused); `fields` replace its top-level keys, and
    `prefill_*` keys its prefill pool's."""
    document: dict[str, Any] = {
        "schema": kvlink.SCHEMA,
        "target": "bare-metal",
        "model": "Qwen/Qwen3-32B",
        "kvCacheDtype": "auto",
        "gpuModel": "H100",
        "backend": "ucx",
        "prefill": {"nodes": ["master", "worker-1"], "tensorParallel": 4},
        "decode": {"nodes": ["worker-2", "worker-3"], "tensorParallel": 4},
        "linkGbps": 25,
        "linkSource": "bareMetal.nicSpeedGbps",
    }
    for key, value in fields.items():
        if key.startswith("prefill_"):
            document["prefill"][key.removeprefix("prefill_")] = value
        else:
            document[key] = value
    return document


def kv_link(resource_name: str = "kv-link", **fields: Any) -> RecordedResource:
    """The component that carries the declaration (components/kvlink.py): its inputs and outputs."""
    document = kv_link_document(**fields)
    return RecordedResource(kvlink.DECLARATION_TYPE, resource_name, document, copy.deepcopy(document), False)


def with_kv_link(resources: list[RecordedResource], change) -> list[RecordedResource]:
    """A copy of `resources` whose KvLink declaration `change(document)` edited."""
    result = []
    for resource in resources:
        if resource.type == kvlink.DECLARATION_TYPE:
            inputs, outputs = copy.deepcopy(resource.inputs), copy.deepcopy(resource.outputs)
            change(inputs)
            change(outputs)
            resource = dataclasses.replace(resource, inputs=inputs, outputs=outputs)
        result.append(resource)
    return result


def without_efa(resources: list[RecordedResource]) -> list[RecordedResource]:
    """A copy of `resources` whose GPU launch templates carry plain interfaces, no EFA device:
    the nodes would reach each other over TCP only."""
    result = []
    for resource in resources:
        if resource.type == net.LAUNCH_TEMPLATE:
            inputs, outputs = copy.deepcopy(resource.inputs), copy.deepcopy(resource.outputs)
            for props in (inputs, outputs):
                first = props.get("networkInterfaces", [])[:1]
                props["networkInterfaces"] = [{**entry, "interfaceType": "interface"} for entry in first]
            resource = dataclasses.replace(resource, inputs=inputs, outputs=outputs)
        result.append(resource)
    return result
