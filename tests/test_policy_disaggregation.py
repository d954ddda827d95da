"""The pack on disaggregated serving: kv-link-floor refuses a prefill->decode link that cannot carry
the KV cache the prefill pool makes, kv-link-share advises where it carries it slowly, kv-transport
refuses TCP-only P/D on AWS, and port-exposure keeps NIXL's rows to members; with the stack config
and without it (the pack then reads the declaration the program registers, components/kvlink.py).
The stacks of docs/disaggregation.md render, preview and get the verdicts the docs say.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies import normalized as net
from qwen_cluster import config, kvlink
from qwen_cluster.tags import NODE_TAG
from tests.helpers.policy_fixtures import (
    PD_VARIANTS,
    aws_stack,
    bare_metal_stack,
    firewall_command,
    ingress,
    instance,
    kv_link,
    pd_command,
    pd_config,
    pd_rendered,
    res,
    with_kv_link,
    without_efa,
)
from tooling import changes, policy_harness, preview, stackfile

DOCS = Path(__file__).resolve().parent.parent / "docs" / "disaggregation.md"
KV_POLICIES = {"kv-link-floor", "kv-link-share", "kv-transport"}
AWS_DECLARATION = {
    "target": "aws",
    "backend": "libfabric",
    "linkGbps": 3200,
    "linkSource": "aws.instanceType p5.48xlarge",
    "prefill_tensorParallel": 8,
}


def verdicts(resources, policy, cluster=None, **kwargs):
    return [v for v in policy_harness.analyze(resources, cluster=cluster, **kwargs) if v.policy == policy]


def refused(resources, policy, cluster=None, **kwargs):
    return {v.resource for v in verdicts(resources, policy, cluster, **kwargs)}


def kv_verdicts(resources, cluster=None):
    return [v for v in policy_harness.analyze(resources, cluster=cluster) if v.policy in KV_POLICIES]


# --- kv-link-floor --------------------------------------------------------------------------------

FLOOR_FIXTURES = [
    kv_link("pass_p5_over_efa", **AWS_DECLARATION),
    kv_link("pass_roce_3200", linkGbps=3200),
    # A measured 500 tokens/s per GPU makes 4.2 Gbit/s per prefill node.
    kv_link("pass_measured_rate", prefill_tokensPerSecondPerGpu=500),
    # FP8 KV halves the bytes: 31.6 Gbit/s per prefill node fits 40, BF16's 63.2 does not.
    kv_link("pass_fp8_kv_at_40", linkGbps=40, kvCacheDtype="fp8"),
    kv_link("fail_bf16_kv_at_40", linkGbps=40),
    kv_link("fail_25_gbit_nics"),
    # Each prefill node's own link carries it (42 %); the one decode node receives three (126 %).
    kv_link(
        "fail_one_decode_node_for_three",
        linkGbps=150,
        prefill_nodes=["master", "worker-1", "worker-2"],
        decode={"nodes": ["worker-3"], "tensorParallel": 4},
    ),
]


def test_kv_link_floor_refuses_exactly_the_fail_declarations():
    found = {f.name for f in FLOOR_FIXTURES if refused([f], "kv-link-floor")}
    assert found == {f.name for f in FLOOR_FIXTURES if f.name.startswith("fail_")}


def test_the_floor_is_mandatory_and_its_message_names_the_floor_and_the_figures():
    (violation,) = verdicts([kv_link("onprem-kv-link")], "kv-link-floor")
    assert violation.enforcement == "mandatory" and violation.resource == "onprem-kv-link"
    assert violation.message.startswith(
        "the prefill->decode path cannot carry the KV cache the prefill pool makes: 25 Gbit/s per node "
        "is below the link floor of 63.2 Gbit/s. "
    )
    for figure in (
        "Qwen/Qwen3-32B holds 262,144 B of KV per token",
        "one H100 (989 TFLOPS BF16 at 50% MFU) prefills ~7,538 tokens/s per GPU",
        "a prefill node's 4 GPUs make 63.2 Gbit/s of KV",
        "2 prefill and 2 decode nodes on 25 Gbit/s (bareMetal.nicSpeedGbps)",
        "the transfer takes 253% of the prefill time",
    ):
        assert figure in violation.message


def test_the_link_the_hosts_declare_wins_over_the_declared_one():
    """A declaration of 3200 Gbit/s over hosts whose firewall documents say 25: judged on 25."""
    (violation,) = verdicts([*bare_metal_stack(), kv_link(linkGbps=3200)], "kv-link-floor")
    assert "25 Gbit/s per node is below the link floor" in violation.message
    assert "(bareMetal.nicSpeedGbps of node master, the narrowest of the pools)" in violation.message


def test_with_the_stack_config_its_declaration_is_judged_without_the_resource():
    cluster = stackfile.validate(pd_config("onprem"))
    assert refused(bare_metal_stack(), "kv-link-floor", cluster) == {None}


def test_an_aggregated_stack_is_not_judged():
    assert kv_verdicts(bare_metal_stack(), cluster=stackfile.load("onprem")) == []
    assert kv_verdicts(bare_metal_stack(), cluster=None) == []


@pytest.mark.parametrize(
    ("fields", "why"),
    [({"prefill_tensorParallel": 2.5}, "ValueError: 2.5"), ({"decode": None}, "TypeError: ")],
    ids=["half a GPU", "no decode pool"],
)
def test_a_declaration_the_pack_cannot_read_is_refused_by_name(fields, why):
    (violation,) = kv_verdicts([kv_link(**fields)])
    assert (violation.policy, violation.enforcement) == ("kv-link-floor", "mandatory")
    assert violation.message.startswith(f"the {kvlink.SCHEMA} declaration cannot be read ({why}")


# --- kv-link-share --------------------------------------------------------------------------------

# dev's shape: g6e.12xlarge, four L40S per replica on 100 Gbit/s: 23.1 Gbit/s of KV per prefill node.
DEV_SHAPED = {
    "target": "aws",
    "backend": "libfabric",
    "gpuModel": "L40S",
    "linkGbps": 100,
    "linkSource": "aws.instanceType g6e.12xlarge",
    "prefill_nodes": ["master"],
    "decode": {"nodes": ["worker-1"], "tensorParallel": 4},
}


def test_a_link_that_carries_the_kv_above_a_tenth_of_the_prefill_gets_an_advisory():
    (advisory,) = verdicts([kv_link(**DEV_SHAPED)], "kv-link-share")
    assert advisory.enforcement == "advisory"
    assert advisory.message.startswith(
        "the KV transfer takes 23% of the prefill time, above 10%: 231 Gbit/s per node keeps it under."
    )


def test_the_share_is_the_policys_config():
    loose = {"kv-link-share": {"maxTransferShare": 0.25}}
    assert verdicts([kv_link(**DEV_SHAPED)], "kv-link-share", policy_config=loose) == []
    strict = {"kv-link-share": {"maxTransferShare": 0.2}}
    (advisory,) = verdicts([kv_link(**DEV_SHAPED)], "kv-link-share", policy_config=strict)
    assert "above 20%: 116 Gbit/s per node keeps it under" in advisory.message
    assert advisory.message.endswith("116 Gbit/s to keep it under 20%)")


def test_a_link_below_the_floor_gets_the_refusal_not_the_advisory():
    assert [v.policy for v in kv_verdicts([kv_link()])] == ["kv-link-floor"]


def test_the_committed_policy_config_keeps_the_tenth():
    assert policy_harness.read_policy_config()["kv-link-share"] == {"maxTransferShare": kvlink.TRANSFER_SHARE}


# --- kv-transport ---------------------------------------------------------------------------------


def _aws_pool_nodes():
    """dev's fixture stack with two pool nodes tagged by name: one launched from the EFA template,
    one from a template with a plain interface only."""
    plain = res(
        net.LAUNCH_TEMPLATE,
        "plain-template",
        instanceType="g6e.12xlarge",
        metadataOptions={"httpTokens": "required"},
        networkInterfaces=[{"deviceIndex": 0, "interfaceType": "interface", "subnetId": "dev-subnet-id"}],
        tags={net.ROLE_TAG: net.GPU_NODE},
    )
    efa_node = instance("pass_efa_master", tags={net.ROLE_TAG: net.GPU_NODE, NODE_TAG: "master"})
    tcp_node = instance(
        "fail_tcp_only_worker",
        launchTemplate={"id": "plain-template-id", "version": "$Latest"},
        tags={net.ROLE_TAG: net.GPU_NODE, NODE_TAG: "worker-1"},
    )
    return [*aws_stack(), plain, efa_node, tcp_node]


def test_kv_transport_refuses_exactly_the_pool_nodes_without_efa():
    resources = [*_aws_pool_nodes(), kv_link(**DEV_SHAPED)]
    assert refused(resources, "kv-transport") == {"fail_tcp_only_worker"}
    (violation,) = verdicts(resources, "kv-transport")
    assert violation.enforcement == "mandatory"
    assert violation.message.startswith(
        "fail_tcp_only_worker (node worker-1, decode pool) has no EFA interface: NIXL would move the KV "
        "cache over TCP"
    )


def test_kv_transport_refuses_ucx_on_aws():
    (violation,) = verdicts([kv_link(**{**AWS_DECLARATION, "backend": "ucx"})], "kv-transport")
    assert violation.resource == "kv-link"
    assert violation.message.startswith("serving.kvTransfer.backend ucx on aws: NIXL's UCX backend")


def test_kv_transport_leaves_ucx_on_bare_metal_alone():
    assert verdicts([*bare_metal_stack(), kv_link(linkGbps=3200)], "kv-transport") == []


# --- port-exposure of NIXL's rows -------------------------------------------------------------------


def _kv_host(name, *rules, host="worker-2"):
    """worker-2's firewall of onprem made disaggregated, with `rules` added to its own."""
    command = firewall_command(host, "192.168.1.102")
    document = json.loads(command.inputs["triggers"][0])
    document["rules"] += [{"action": "allow", "description": "d", **rule} for rule in rules]
    command.inputs["triggers"] = command.outputs["triggers"] = [json.dumps(document)]
    command.name = name
    return command


def test_port_exposure_keeps_nixls_rows_on_host_firewalls_to_members():
    cluster = stackfile.validate(pd_config("onprem-roce"))
    rows = {e.name: str(e.port) for e in cluster.ports}
    assert rows["kv-side-channel"] == "5600" and rows["kv-data"] == "5601-5680"
    fixtures = [
        _kv_host("pass_kv_from_the_prefill_pool", {"ports": "5600-5680", "sources": ["192.168.1.100/31"]}),
        _kv_host("fail_kv_side_channel_from_monitoring", {"ports": "5600", "sources": ["10.20.0.0/16"]}),
        _kv_host("fail_kv_data_from_clients", {"ports": "5601-5680", "sources": ["10.0.0.0/8"]}),
        _kv_host("fail_kv_side_channel_from_the_world", {"ports": "5600", "sources": ["0.0.0.0/0"]}),
    ]
    found = {name for name in refused(fixtures, "port-exposure", cluster) if name}
    assert found == {f.name for f in fixtures if f.name.startswith("fail_")}


DEV_POOLS = (
    "serving.mode=disaggregated",
    'serving.prefill={"nodes":["master"]}',
    'serving.decode={"nodes":["worker-1"]}',
)
SIDE_CHANNEL = {"ipProtocol": "tcp", "fromPort": 5600, "toPort": 5600}


def _side_channel_from(name, **peer):
    return ingress(name, "dev-node-sg", **peer, **SIDE_CHANNEL)


def test_port_exposure_keeps_the_side_channel_on_security_groups_to_members():
    cluster = stackfile.validate(changes.apply_changes(stackfile.read("dev"), DEV_POOLS))
    assert [e.name for e in cluster.ports if e.name.startswith("kv-")] == ["kv-side-channel"]
    fixtures = [
        _side_channel_from("pass_kv_from_members", referencedSecurityGroupId="dev-node-sg-id"),
        _side_channel_from("fail_kv_from_the_lb", referencedSecurityGroupId="dev-lb-sg-id"),
        _side_channel_from("fail_kv_from_monitoring", cidrIpv4="10.20.0.0/16"),
        _side_channel_from("fail_kv_from_clients", cidrIpv4="10.0.0.0/8"),
        _side_channel_from("fail_kv_from_the_world", cidrIpv4="0.0.0.0/0"),
    ]
    violations = verdicts([*aws_stack(), *fixtures], "port-exposure", cluster)
    assert {v.resource for v in violations} == {f.name for f in fixtures if f.name.startswith("fail_")}
    (from_monitoring,) = [v for v in violations if v.resource == "fail_kv_from_monitoring"]
    assert "to kv-side-channel 5600: cluster ports and all-traffic rules are for members only" in (
        from_monitoring.message
    )


def test_without_the_stack_config_the_side_channel_is_still_closed_to_the_world():
    world = _side_channel_from("fail_kv_from_the_world", cidrIpv4="0.0.0.0/0")
    assert refused([*aws_stack(), world], "port-exposure") == {"fail_kv_from_the_world"}


# --- the stacks of docs/disaggregation.md ---------------------------------------------------------


def test_the_docs_show_each_variant_as_the_command_a_user_runs():
    text = DOCS.read_text().replace("\\\n", " ")
    text = " ".join(text.split())
    for variant in PD_VARIANTS:
        assert pd_command(variant) in text, variant


@pytest.mark.parametrize("configured", [True, False], ids=["with the stack config", "without"])
def test_prod_disaggregated_over_efa_passes_the_pack(configured):
    render = pd_rendered("prod")
    assert render.error is None
    cluster = stackfile.validate(pd_config("prod")) if configured else None
    violations = policy_harness.analyze(render.resources, stack="prod", cluster=cluster)
    assert policy_harness.mandatory(violations) == []
    assert not {v.policy for v in violations} & KV_POLICIES


def test_prod_disaggregated_registers_its_declaration():
    (declared,) = pd_rendered("prod").of_type(kvlink.DECLARATION_TYPE)
    assert declared.inputs["backend"] == "libfabric" and declared.inputs["gpuModel"] == "H100"
    assert declared.inputs["prefill"]["nodes"] == ["master", "worker-1"]
    assert declared.outputs["linkGbps"] == 3200


def test_prod_disaggregated_previews_and_passes_the_pack():
    render = pd_rendered("prod", preview=True)
    violations = policy_harness.analyze(render.resources, stack="prod", cluster=None)
    assert render.error is None and policy_harness.mandatory(violations) == []


def test_prod_over_ucx_is_refused_by_the_config_naming_the_key():
    with pytest.raises(config.ConfigError) as refusal:
        stackfile.validate(pd_config("prod-ucx"))
    assert any(e.startswith("serving.kvTransfer.backend ucx on aws") for e in refusal.value.errors)


def test_prod_over_ucx_is_refused_by_the_pack_without_the_config():
    resources = with_kv_link(pd_rendered("prod").resources, lambda doc: doc.update(backend="ucx"))
    assert refused(resources, "kv-transport") == {"kv-link"}


@pytest.mark.parametrize("configured", [True, False], ids=["with the stack config", "without"])
def test_prod_on_nodes_without_efa_is_refused_as_tcp_only(configured):
    cluster = stackfile.validate(pd_config("prod")) if configured else None
    resources = without_efa(pd_rendered("prod").resources)
    found = refused(resources, "kv-transport", cluster)
    assert found == {"gpu-nodes-master", "gpu-nodes-worker-1", "gpu-nodes-worker-2", "gpu-nodes-worker-3"}


@pytest.mark.parametrize("with_preview", [False, True], ids=["render", "preview"])
def test_onprem_on_roce_at_3200_gbit_passes_the_pack(with_preview):
    render = pd_rendered("onprem-roce", preview=with_preview)
    cluster = stackfile.validate(pd_config("onprem-roce"))
    for judged in (cluster, None):
        violations = policy_harness.analyze(render.resources, stack="onprem", cluster=judged)
        assert policy_harness.mandatory(violations) == []


def test_the_committed_onprem_disaggregated_is_refused_naming_the_floor_and_the_figures():
    stack, texts = PD_VARIANTS["onprem"]
    report = preview.change_plan(stack, change_texts=list(texts))
    assert report["valid"] and report["exit"] == 1
    (violation,) = report["violations"]
    assert violation["policy"] == "kv-link-floor"
    assert "25 Gbit/s per node is below the link floor of 63.2 Gbit/s" in violation["message"]
    assert "one H100 (989 TFLOPS BF16 at 50% MFU) prefills ~7,538 tokens/s per GPU" in violation["message"]
