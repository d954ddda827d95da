"""The offline preview: report, JSON, diagram and exit codes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from qwen_cluster import config
from tooling import policy_harness, preview, stackfile

WORKFLOWS = stackfile.PROJECT_ROOT / ".github" / "workflows"


@pytest.mark.parametrize("stack", stackfile.STACKS)
def test_every_stack_previews_clean(stack):
    report = preview.plan(stack)
    assert report["valid"] and report["mandatory"] == 0, report.get("violations") or report.get("errors")
    assert report["total"] == sum(report["counts"].values()) > 0
    assert {rule["name"] for rule in report["exposure"]} >= {"cluster-all", "model-service", "listener"}


def test_resources_are_grouped_under_their_components():
    report = preview.plan("prod")
    components = {row["component"] for row in report["resources"]}
    assert any(c.startswith("qwen-cluster:aws:") for c in components)
    listener = next(row for row in report["resources"] if row["type"] == "aws:lb/listener:Listener")
    assert listener["properties"]["tcpIdleTimeoutSeconds"] == "3600"


def test_an_invalid_config_exits_two_naming_the_problem():
    stack_config = stackfile.read("dev")
    stack_config["qwen-cluster:nodes"] = [{"name": "solo", "ip": "10.42.1.100", "role": "master"}]
    report = preview.plan("dev", stack_config)
    assert report == {
        "stack": "dev",
        "valid": False,
        "errors": ["nodes has 1 entries; the cluster needs at least 2 (4 or more recommended)"],
    }
    assert preview.exit_code([report]) == 2


def test_a_mandatory_violation_exits_one_and_an_advisory_does_not():
    assert preview.exit_code([{"valid": True, "mandatory": 1, "advisory": 0}]) == 1
    assert preview.exit_code([{"valid": True, "mandatory": 0, "advisory": 3}]) == 0


def test_cli_json_is_the_same_report(capsys):
    assert preview.main(["onprem", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["stack"] == "onprem" and report["target"] == "bare-metal"
    assert report["counts"]["command:remote:Command"] > 0


def test_cli_unknown_stack_exits_two(capsys):
    assert preview.main(["staging"]) == 2
    assert "no stack file Pulumi.staging.yaml" in capsys.readouterr().out


@pytest.mark.skipif(
    shutil.which("dot") is None, reason="graphviz's dot is not installed (make system installs it)"
)
def test_cli_draws_the_diagram(tmp_path, capsys):
    target = tmp_path / "prod.png"
    assert preview.main(["prod", "--diagram", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"diagram: {target}" in capsys.readouterr().out


def test_printed_report_shows_counts_and_the_verdict():
    import io

    from rich.console import Console

    buffer = io.StringIO()
    report = preview.plan("dev")
    preview.print_report(Console(file=buffer, width=160), report)
    text = buffer.getvalue()
    assert "aws:ec2/launchTemplate:LaunchTemplate" in text
    assert f"dev (aws): {report['total']} resources in {report['components']} components" in text
    assert f"PASS dev: {report['total']} resources, 0 mandatory" in text


def _policy_configs_ci_passes() -> set[str]:
    """Every `policyPackConfigs` the workflows hand pulumi/actions."""
    found = set()
    for workflow in WORKFLOWS.glob("*.yml"):
        for job in (yaml.safe_load(workflow.read_text()).get("jobs") or {}).values():
            for step in job.get("steps") or []:
                given = (step.get("with") or {}).get("policyPackConfigs")
                if given:
                    found.add(given)
    return found


def test_the_preview_runs_the_pack_with_the_one_policy_config_ci_passes():
    assert _policy_configs_ci_passes() == {"policies/config.json"}
    assert policy_harness.POLICY_CONFIG == stackfile.PROJECT_ROOT / "policies" / "config.json"
    assert preview.plan("dev")["policyConfig"] == "policies/config.json"


def test_the_preview_holds_the_configs_bandwidth_floor_and_advises_the_guides_recommendation():
    # CI's policy config keeps the config's floor (the guide's 10 Gbit/s): a stack the config
    # accepts passes the mandatory policy, and below the guide's 25 Gbit/s it gets advice.
    assert "bandwidth-class" not in policy_harness.read_policy_config()
    stack_config = stackfile.read("onprem")
    stack_config["qwen-cluster:bareMetal"] = {**stack_config["qwen-cluster:bareMetal"], "nicSpeedGbps": 10}
    report = preview.plan("onprem", stack_config)
    assert report["valid"] and preview.exit_code([report]) == 0
    advice = {v["message"] for v in report["violations"] if v["policy"] == "bandwidth-recommended"}
    assert advice == {
        f"host {node} NIC 10 Gbit/s is below the recommended {config.RECOMMENDED_BANDWIDTH_GBPS:g} Gbit/s"
        for node in ("master", "worker-1", "worker-2", "worker-3")
    }


def test_the_preview_validates_the_zone_against_the_stack_s_region_as_the_program_does():
    stack_config = stackfile.read("dev")
    stack_config["aws:region"] = "us-east-1"
    report = preview.plan("dev", stack_config)
    assert report == {
        "stack": "dev",
        "valid": False,
        "errors": ["aws.availabilityZone us-west-2a is not in aws:region us-east-1"],
    }


def test_the_plan_says_when_monitoring_hosts_are_clients_too(capsys):
    """The committed stacks' monitoringCidrs (10.20.0.0/16) lie inside clientCidrs (10.0.0.0/8):
    maybe intended, so an advisory (policies/endpoint.py) naming both keys, in the report and in
    what scripts/plan.py prints."""
    from tooling import preview

    for stack in stackfile.STACKS:
        report = preview.plan(stack)
        (advisory,) = [v for v in report["violations"] if v["policy"] == "monitoring-inside-clients"]
        assert advisory["enforcement"] == "advisory", stack
        assert "access.monitoringCidrs" in advisory["message"] and "access.clientCidrs" in advisory["message"]
    assert preview.main(["onprem"]) == 0
    printed = capsys.readouterr().out
    assert "monitoring-inside-clients" in printed and "access.monitoringCidrs 10.20.0.0/16" in printed


def test_the_plan_says_when_api_keys_would_travel_in_clear():
    """The committed stacks serve API keys without loadBalancer.tls: the plan carries the pack's
    advisory (policies/endpoint.py); the endpoint's doc shows the stack with TLS to copy."""
    from tooling import preview

    for stack in stackfile.STACKS:
        report = preview.plan(stack)
        advisories = [v for v in report["violations"] if v["policy"] == "keys-in-clear"]
        assert [v["enforcement"] for v in advisories] == ["advisory"], stack
        assert report["mandatory"] == 0


def test_the_plan_says_which_secrets_are_offline_placeholders(capsys):
    """The committed stacks hold no API key, no monitoring password and no monitoring TLS pair:
    offline they get throwaway ones (tooling/stackfile.py), pass, and the plan says so rather than
    hide it."""
    from tooling import preview

    for stack in stackfile.STACKS:
        report = preview.plan(stack)
        assert report["placeholders"] == [
            "access.apiKeys",
            "monitoring.password",
            "monitoring.tls.certificate",
            "monitoring.tls.privateKey",
        ], stack
        assert report["mandatory"] == 0 and not any(
            v["policy"] == "monitoring-open" for v in report["violations"]
        )
    assert preview.main(["onprem"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert (
        "offline placeholders for access.apiKeys, monitoring.password, monitoring.tls.certificate, "
        "monitoring.tls.privateKey" in printed
    )


def test_a_stack_open_on_purpose_passes_with_the_monitoring_open_advisory():
    from tooling import preview

    stack_config = stackfile.read("onprem")
    key = f"{config.NAMESPACE}:monitoring"
    monitoring = {k: v for k, v in stack_config[key].items() if k not in ("password", "tls")}
    report = preview.plan("onprem", {**stack_config, key: {**monitoring, "openToMonitoringCidrs": True}})
    assert report["valid"] and report["mandatory"] == 0
    assert [v["enforcement"] for v in report["violations"] if v["policy"] == "monitoring-open"] == [
        "advisory"
    ]
    assert report["placeholders"] == ["access.apiKeys"]


def test_the_plan_says_when_a_certificate_it_is_handed_is_close_to_its_end():
    """A TLS pair handed in plain text (`--change loadBalancer.tls=...`, a lab's stack) is judged by
    the render and by the pack alike: one that expires within the advisory's days is said by the
    plan as `pulumi preview` says it, not passed over because the plan's own reading kept the
    values wrapped as the stack file holds them."""
    from datetime import UTC, datetime, timedelta

    from qwen_cluster.config import x509check
    from tests.helpers import certificates

    now = datetime.now(UTC)
    leaf = certificates.issue(
        "lb",
        not_before=now - timedelta(days=60),
        not_after=now + timedelta(days=x509check.EXPIRY_ADVISORY_DAYS - 10),
    )
    stack_config = stackfile.read("onprem")
    key = f"{config.NAMESPACE}:loadBalancer"
    tls = {"certificate": {"secure": leaf.pem}, "privateKey": {"secure": leaf.key_pem}}
    report = preview.plan("onprem", {**stack_config, key: {**stack_config[key], "tls": tls}})
    assert report["valid"] and report["mandatory"] == 0
    expiring = [v for v in report["violations"] if v["policy"] == "certificate-expiring"]
    assert [v["enforcement"] for v in expiring] == ["advisory"]
    assert expiring[0]["message"].startswith("loadBalancer.tls certificate: certificate 1 (CN=lb) expires on")
