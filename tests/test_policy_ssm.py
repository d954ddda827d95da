"""The pack reads what a node runs through SSM (the AWS target runs the model server there): a
script that disables SELinux or cuts nginx timeouts is refused in a document or an
association's (base64) parameters as it is in user data."""

from __future__ import annotations

import base64
import json

from policies import normalized as net
from qwen_cluster.render import ssm
from tests.helpers.aws_stacks import render_stack
from tests.helpers.policy_fixtures import res
from tooling import policy_harness


def refused(resources, policy):
    return {v.resource for v in policy_harness.analyze(resources, cluster=None) if v.policy == policy}


def document(lines):
    return json.dumps({"schemaVersion": "2.2", "mainSteps": [{"inputs": {"runCommand": lines}}]})


def test_selinux_is_refused_in_ssm_documents_and_association_parameters():
    fixtures = [
        res(net.SSM_DOCUMENT, "pass_document", content=ssm.document()),
        res(net.SSM_DOCUMENT, "fail_document", content=document(["set -e", "setenforce 0"])),
        res(
            net.SSM_ASSOCIATION,
            "fail_parameter",
            parameters={"ServerScript": base64.b64encode(b"setenforce 0; exec vllm serve").decode()},
        ),
        res(net.SSM_ASSOCIATION, "pass_parameter", parameters={"Image": "vllm/vllm-openai:v0.33.0"}),
    ]
    assert refused(fixtures, "baseline-selinux") == {"fail_document", "fail_parameter"}


def test_the_programs_own_documents_and_associations_read_clean():
    result = render_stack("prod")
    texts = [
        text
        for item in result.custom_resources
        if item.type in (net.SSM_DOCUMENT, net.SSM_ASSOCIATION)
        for _, text in net.texts_of(item.type, item.inputs)
    ]
    assert any("exec vllm serve" in text for text in texts)  # the server script is read, decoded
    assert any("docker run" in text for text in texts)  # and the document's run script
    assert not any(net.SELINUX_OFF.search(text) for text in texts)
