"""The endpoint's secrets in the stack config: required unless the endpoint is open, validated
without being shown, never in the validated config, never committed; a key rotation on bare
metal rewrites the load balancer's files and replaces no container."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from qwen_cluster import config
from qwen_cluster.config import NAMESPACE, REDACTED, ConfigError
from tests.helpers import certificates
from tests.helpers.aws_stacks import render
from tests.helpers.configs import BASE_BARE_METAL, TEST_API_KEY
from tooling import changes, offline, stackfile

KEY = "rotation-key-" + "1" * 40
NEXT_KEY = "rotation-key-" + "2" * 40


def with_access(**access) -> dict:
    raw = copy.deepcopy(BASE_BARE_METAL)
    raw["access"] = {key: value for key, value in {**raw["access"], **access}.items() if value is not None}
    return raw


def errors(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        config.validate(raw)
    return caught.value.errors


def test_a_stack_without_keys_is_refused_naming_the_command_to_set_one():
    (error,) = errors(with_access(apiKeys=None))
    assert error.startswith("access.apiKeys is empty")
    assert "pulumi config set --secret --path 'qwen-cluster:access.apiKeys[0]'" in error


def test_an_explicitly_open_endpoint_needs_no_key():
    assert config.validate(with_access(apiKeys=None, openEndpoint=True)).access.open_endpoint


def test_keys_and_an_open_endpoint_together_are_refused():
    (error,) = errors(with_access(openEndpoint=True))
    assert error.startswith("access.openEndpoint is true but access.apiKeys holds 1 keys")


def test_a_malformed_key_is_refused_without_being_shown():
    (error,) = errors(with_access(apiKeys=[TEST_API_KEY, "short-secret"]))
    assert error.startswith("access.apiKeys[1] is not valid") and "short-secret" not in error


def test_the_validated_config_holds_only_the_redacted_mark():
    cluster = config.validate(with_access(apiKeys=[TEST_API_KEY, KEY]))
    assert cluster.access.api_keys == [REDACTED, REDACTED]
    assert TEST_API_KEY not in cluster.model_dump_json()


def test_the_committed_stacks_hold_no_key():
    for stack in stackfile.STACKS:
        raw = yaml.safe_load(stackfile.stack_path(stack).read_text())["config"]
        assert "apiKeys" not in raw[f"{NAMESPACE}:access"], stack


def test_the_offline_tools_give_a_keyless_stack_a_throwaway_secret_key():
    values, secret_keys = stackfile.as_pulumi_config(stackfile.read("onprem"))
    assert f"{NAMESPACE}:access" in secret_keys
    assert stackfile.OFFLINE_API_KEY in values[f"{NAMESPACE}:access"]


def test_a_key_written_in_plain_text_in_the_stack_file_stops_the_program_without_showing_it():
    stack_config = stackfile.read("onprem")
    stack_config[f"{NAMESPACE}:access"] = {**stack_config[f"{NAMESPACE}:access"], "apiKeys": [KEY]}
    result = offline.render(stack_config, "onprem")
    assert result.error and "access.apiKeys is in plain text in the stack file" in result.error
    assert KEY not in result.error and not result.resources


def _onprem(*keys: str) -> dict:
    stack_config = stackfile.read("onprem")
    access = {**stack_config[f"{NAMESPACE}:access"], "apiKeys": [{"secure": key} for key in keys]}
    return {**stack_config, f"{NAMESPACE}:access": access}


def test_on_bare_metal_a_key_rotation_updates_the_nginx_files_and_restarts_nothing():
    old, new = render(_onprem(KEY), "onprem"), render(_onprem(KEY, NEXT_KEY), "onprem")
    found = changes.diff(old, new)
    assert {(c.name, c.action, tuple(c.keys)) for c in found if c.action != "same"} == {
        ("load-balancer-config", "update", ("stdin",))
    }
    summary = changes.rollout(old, new, found)
    assert summary.servers_restarted == [] and summary.max_replicas_out_of_service == 0


def test_the_stack_with_tls_that_endpoint_md_shows_renders_and_the_pack_has_nothing_to_say():
    """docs/endpoint.md's example to copy: prod with its `access` and `loadBalancer` replaced by
    the documented block (its ciphertext becomes the offline placeholders, as any stack file's)."""
    from tooling import policy_harness

    text = (stackfile.PROJECT_ROOT / "docs" / "endpoint.md").read_text()
    block = text[text.index("<!-- stack-with-tls -->") :]
    block = block[block.index("```yaml") + len("```yaml") : block.index("```", block.index("```yaml") + 7)]
    documented = yaml.safe_load(block)["config"]
    stack_config = {**stackfile.read("prod"), **documented}
    cluster = stackfile.validate(stack_config)
    assert cluster.load_balancer.tls is not None and cluster.access.api_keys
    violations = policy_harness.check_config(stack_config, "prod")
    assert [v.policy for v in violations] == []


MONITORING_PASSWORD = "monitoring-password-in-a-test-0123"


def test_a_monitoring_password_in_plain_text_stops_the_program_without_showing_it():
    # Without the offline placeholders: a `secure:` value beside it would mark the whole object.
    stack_config = stackfile.read("onprem", offline_keys=False)
    key = f"{NAMESPACE}:monitoring"
    stack_config[key] = {**stack_config[key], "password": MONITORING_PASSWORD}
    result = offline.render(stack_config, "onprem")
    assert result.error and "monitoring.password is in plain text in the stack file" in result.error
    assert MONITORING_PASSWORD not in result.error and not result.resources


def _monitoring_tls(ip: str = "10.42.1.100") -> dict:
    from tests.helpers.monitoring_tls import issue

    pki = issue(ip)
    return {
        "certificate": pki.certificate,
        "privateKey": pki.private_key,
        "caCertificate": pki.ca_certificate,
    }


def test_a_monitoring_password_with_tls_is_accepted_on_aws_too():
    raw = stackfile.cluster_keys(stackfile.read("dev"))
    raw["monitoring"] = {
        **raw.get("monitoring", {}),
        "password": MONITORING_PASSWORD,
        "tls": _monitoring_tls(),
    }
    validated = config.validate(raw).monitoring
    assert validated.password is not None  # kept, shown redacted
    assert (validated.tls.certificate, validated.tls.private_key) == (REDACTED, REDACTED)
    assert validated.tls.ca_certificate == _monitoring_tls()["caCertificate"]  # public: kept as text


def test_a_monitoring_password_without_tls_is_refused_naming_monitoring_tls():
    raw = stackfile.cluster_keys(stackfile.read("dev", offline_keys=False))
    raw["monitoring"] = {**raw.get("monitoring", {}), "password": MONITORING_PASSWORD}
    with pytest.raises(
        config.ConfigError, match=r"monitoring.password is set without monitoring.tls.*in clear"
    ):
        config.validate(raw)


def test_a_monitoring_key_in_plain_text_stops_the_program_without_showing_it():
    stack_config = stackfile.read("onprem", offline_keys=False)
    key = f"{NAMESPACE}:monitoring"
    tls = _monitoring_tls("192.168.1.100")
    stack_config[key] = {**stack_config[key], "tls": tls}
    result = offline.render(stack_config, "onprem")
    assert result.error and "monitoring.tls.privateKey is in plain text in the stack file" in result.error
    assert tls["privateKey"].splitlines()[1] not in result.error and not result.resources


def test_a_monitoring_ca_that_is_not_pem_is_refused_naming_the_key():
    raw = stackfile.cluster_keys(stackfile.read("dev"))
    raw["monitoring"] = {"tls": {**_monitoring_tls(), "caCertificate": "not a certificate"}}
    with pytest.raises(config.ConfigError, match=r"monitoring.tls.caCertificate.*is not a PEM certificate"):
        config.validate(raw)


def _onprem_with_tls(certificate: str, private_key: str) -> dict:
    stack_config = stackfile.read("onprem")
    key = f"{NAMESPACE}:loadBalancer"
    tls = {"certificate": {"secure": certificate}, "privateKey": {"secure": private_key}}
    return {**stack_config, key: {**stack_config[key], "tls": tls}}


def _refused_at_preview(certificate: str, private_key: str) -> str:
    result = offline.render(_onprem_with_tls(certificate, private_key), "onprem")
    assert result.error and not result.resources
    assert private_key not in result.error
    return result.error


def test_a_tls_key_that_is_not_the_certificates_is_refused_at_preview_naming_the_key():
    _, intermediate, leaf = certificates.chain()
    error = _refused_at_preview(leaf.pem + intermediate.pem, certificates.issue("other").key_pem)
    assert "loadBalancer.tls privateKey does not match the server certificate" in error


def test_an_expired_tls_certificate_is_refused_at_preview_naming_the_key():
    now = datetime.now(UTC)
    leaf = certificates.issue("old", not_before=now - timedelta(days=90), not_after=now - timedelta(days=1))
    error = _refused_at_preview(leaf.pem, leaf.key_pem)
    assert "loadBalancer.tls certificate: certificate 1 (CN=old) expired on" in error


def test_a_reversed_tls_chain_is_refused_at_preview_naming_the_key():
    root, intermediate, leaf = certificates.chain()
    error = _refused_at_preview(root.pem + intermediate.pem + leaf.pem, leaf.key_pem)
    assert "loadBalancer.tls " in error and "certificate is in reverse order" in error


def test_a_good_tls_pair_renders_and_the_committed_stacks_ciphertext_is_left_unjudged():
    _, intermediate, leaf = certificates.chain()
    assert offline.render(_onprem_with_tls(leaf.pem + intermediate.pem, leaf.key_pem), "onprem").error is None
    raw = stackfile.cluster_keys(_onprem_with_tls("v1:ciphertext", "v1:ciphertext"))
    assert config.validate(raw).load_balancer.tls.warnings == ()


def _dev_with_monitoring_tls(tls: dict) -> dict:
    raw = stackfile.cluster_keys(stackfile.read("dev"))
    raw["monitoring"] = {**raw["monitoring"], "password": MONITORING_PASSWORD, "tls": tls}
    return raw


def test_a_monitoring_certificate_that_does_not_name_the_monitoring_node_is_refused():
    """Prometheus, doctor and operators connect to monitoring.node's address: a certificate for
    another one would be refused by every client."""
    with pytest.raises(config.ConfigError) as caught:
        config.validate(_dev_with_monitoring_tls(_monitoring_tls("10.42.1.101")))
    (error,) = caught.value.errors
    assert error.startswith(
        "monitoring.tls.certificate does not name 10.42.1.100, the address of monitoring.node"
    )
    assert "holds 10.42.1.101" in error


def test_a_monitoring_chain_another_ca_issued_is_refused_naming_ca_certificate():
    from tests.helpers.monitoring_tls import issue

    tls = {**_monitoring_tls(), "caCertificate": issue("10.42.1.100", serial=7).ca_certificate}
    with pytest.raises(
        config.ConfigError, match=r"monitoring.tls caCertificate \(CN=qwen-cluster test CA 7\) did not"
    ):
        config.validate(_dev_with_monitoring_tls(tls))


def test_an_expired_monitoring_certificate_is_refused_naming_the_key():
    from tests.helpers.monitoring_tls import issue

    pki = issue("10.42.1.100", serial=3, days=-1)
    tls = {"certificate": pki.certificate, "privateKey": pki.private_key, "caCertificate": pki.ca_certificate}
    with pytest.raises(config.ConfigError, match=r"monitoring.tls certificate: certificate 1 .* expired on"):
        config.validate(_dev_with_monitoring_tls(tls))
