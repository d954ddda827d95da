"""The pull-request and deploy workflows: valid for GitHub (actionlint), clean for zizmor, pinned,
and wired as promised (pull-request code never holds what can deploy or decrypt the SSH key)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tooling import stackfile

WORKFLOWS = stackfile.PROJECT_ROOT / ".github" / "workflows"


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps_using(job: dict, action: str) -> list[dict]:
    return [step for step in job["steps"] if step.get("uses", "").startswith(action + "@")]


def venv_tool(name: str) -> str:
    tool = shutil.which(name, path=str(Path(sys.executable).parent))
    assert tool, f"{name} is installed from requirements.txt"
    return tool


def every_workflow() -> list[str]:
    return sorted(map(str, WORKFLOWS.glob("*.yml")))


def test_actionlint_passes_on_every_workflow():
    result = subprocess.run([venv_tool("actionlint"), *every_workflow()], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_finds_nothing_at_the_default_persona():
    # --offline: no GitHub API (CI has none); the online-only audits are skipped, the rest run.
    result = subprocess.run(
        [venv_tool("zizmor"), "--offline", "--no-progress", "--format", "plain", *every_workflow()],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings to report" in result.stdout, result.stdout


USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(?P<ref>\S+)(?P<comment>.*)$")


def test_every_action_is_pinned_to_a_commit_sha_with_its_version_in_a_comment():
    refs = []
    for path in WORKFLOWS.glob("*.yml"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if match := USES.match(line):
                where = f"{path.name}:{number}"
                action, _, ref = match["ref"].partition("@")
                assert re.fullmatch(r"[0-9a-f]{40}", ref), f"{where}: {action}@{ref} is not a commit SHA"
                assert re.fullmatch(r"\s+# v\d+\.\d+\.\d+", match["comment"]), (
                    f"{where}: {action}@{ref} says not which release it is: {match['comment']!r}"
                )
                refs.append((action, ref, match["comment"].strip()))
    assert len(refs) >= 10
    # One release per action everywhere: a bump is one edit per action, not a mix of versions.
    by_action: dict[str, set] = {}
    for action, ref, version in refs:
        by_action.setdefault(action, set()).add((ref, version))
    assert all(len(pins) == 1 for pins in by_action.values()), by_action


def test_checkouts_keep_no_credentials():
    for name in ("preview.yml", "up.yml"):
        for job_name, job in load(name)["jobs"].items():
            for step in steps_using(job, "actions/checkout"):
                assert step.get("with", {}).get("persist-credentials") is False, f"{name} {job_name}"


def test_preview_runs_the_tests_then_every_stack_with_the_policy_pack():
    workflow = load("preview.yml")
    assert "pull_request" in workflow[True]  # YAML 1.1 reads the key `on` as True
    jobs = workflow["jobs"]
    assert "make test" in jobs["test"]["steps"][-1]["run"]
    preview = jobs["preview"]
    assert preview["needs"] == "test"
    stacks = {entry["stack"] for entry in preview["strategy"]["matrix"]["include"]}
    # The stacks a pull request may preview with the real CLI: the AWS ones, whose config secrets
    # are API keys and TLS (behind the `preview` environment's approval). onprem's sshPrivateKey
    # stays out of reach; its preview is the offline one.
    assert stacks == {stack for stack in stackfile.STACKS if stackfile.load(stack).target == "aws"}
    assert stacks == {"dev", "prod"}
    (pulumi,) = steps_using(preview, "pulumi/actions")
    assert pulumi["with"]["command"] == "preview"
    assert pulumi["with"]["policyPacks"] == "policies"
    assert pulumi["with"]["comment-on-pr"] is True
    assert "vars.PULUMI_BACKEND_URL" in pulumi["with"]["cloud-url"]
    assert preview["permissions"]["id-token"] == "write"
    (aws,) = steps_using(preview, "aws-actions/configure-aws-credentials")
    assert "role-to-assume" in aws["with"] and "aws-access-key-id" not in aws["with"]


def test_the_preview_runs_pull_request_code_without_the_deploying_role_or_production_secrets():
    preview = load("preview.yml")["jobs"]["preview"]
    up = load("up.yml")["jobs"]["up"]
    # Separate environments: each job sees its own environment's secrets, and the OIDC subject
    # (repo:<owner>/<repo>:environment:<name>) is what the roles' trust policies match.
    assert preview["environment"] == "preview"
    assert up["environment"] == "production"
    (preview_role,) = steps_using(preview, "aws-actions/configure-aws-credentials")
    (deploy_role,) = steps_using(up, "aws-actions/configure-aws-credentials")
    assert preview_role["with"]["role-to-assume"] == "${{ vars.AWS_PREVIEW_ROLE_ARN }}"
    assert deploy_role["with"]["role-to-assume"] == "${{ vars.AWS_DEPLOY_ROLE_ARN }}"
    assert "AWS_DEPLOY_ROLE_ARN" not in (WORKFLOWS / "preview.yml").read_text()
    # Nothing in the pull-request workflow can write to the repository or deploy.
    test_job = load("preview.yml")["jobs"]["test"]
    assert "environment" not in test_job and "env" not in test_job
    assert load("preview.yml")["permissions"] == {"contents": "read"}


def test_up_deploys_prod_from_main_behind_a_protected_environment():
    workflow = load("up.yml")
    assert workflow[True]["push"]["branches"] == ["main"]
    up = workflow["jobs"]["up"]
    assert up["environment"] == "production"
    assert up["needs"] == "test"
    assert workflow["concurrency"]["cancel-in-progress"] is False
    (pulumi,) = steps_using(up, "pulumi/actions")
    assert pulumi["with"]["command"] == "up"
    assert "'prod'" in pulumi["with"]["stack-name"]
    assert pulumi["with"]["policyPacks"] == "policies"


def test_the_up_jobs_timeout_and_credential_duration_can_be_sized_for_a_large_cluster():
    up = load("up.yml")["jobs"]["up"]
    assert up["timeout-minutes"] == "${{ fromJSON(vars.UP_TIMEOUT_MINUTES || '90') }}"
    (deploy_role,) = steps_using(up, "aws-actions/configure-aws-credentials")
    assert deploy_role["with"]["role-duration-seconds"] == "${{ vars.AWS_ROLE_DURATION_SECONDS || 3600 }}"


def test_before_pulumi_runs_each_job_checks_its_stack_file_holds_the_encrypted_secrets():
    """CI gets the stacks' secrets from their stack files, encrypted by each stack's secrets
    provider (docs/ci.md): each job says what is missing before the CLI starts."""
    for name, job, stack in (("up.yml", "up", "prod"), ("preview.yml", "preview", '"$STACK"')):
        steps = load(name)["jobs"][job]["steps"]
        check = next(i for i, step in enumerate(steps) if "--check-secrets" in step.get("run", ""))
        pulumi = next(i for i, step in enumerate(steps) if step.get("uses", "").startswith("pulumi/actions@"))
        assert check < pulumi, name
        assert steps[check]["run"].endswith(f"-m tooling.stackfile --check-secrets {stack}")


def test_the_committed_stacks_say_which_secret_ci_lacks(tmp_path, capsys):
    assert stackfile.main(["--check-secrets", "prod"]) == 1
    out = capsys.readouterr().out
    assert "missing secret qwen-cluster:access.apiKeys: pulumi config set --stack prod --secret --path" in out
    assert (
        "missing secret qwen-cluster:monitoring.password: pulumi config set --stack prod --secret --path "
        "'qwen-cluster:monitoring.password'" in out
    )


def test_a_stack_whose_monitoring_is_open_on_purpose_needs_no_monitoring_password(tmp_path):
    document = yaml.safe_load(stackfile.stack_path("prod").read_text())
    document["config"]["qwen-cluster:monitoring"] = {"openToMonitoringCidrs": True}
    (tmp_path / "Pulumi.prod.yaml").write_text(yaml.safe_dump(document))
    assert [line.split(":")[1] for line in stackfile.missing_secrets("prod", tmp_path)] == ["access.apiKeys"]


def test_a_stack_file_with_its_secrets_encrypted_or_from_esc_passes(tmp_path):
    document = yaml.safe_load(stackfile.stack_path("prod").read_text())
    access = document["config"]["qwen-cluster:access"]
    access["apiKeys"] = [{"secure": "v1:abc"}]
    document["config"]["qwen-cluster:monitoring"] = {
        "password": {"secure": "v1:p"},
        "tls": {
            "certificate": {"secure": "v1:mc"},
            "privateKey": {"secure": "v1:mk"},
            "caCertificate": "PEM",
        },
    }
    document["config"]["qwen-cluster:loadBalancer"]["tls"] = {"certificate": {"secure": "v1:c"}}
    (tmp_path / "Pulumi.prod.yaml").write_text(yaml.safe_dump(document))
    assert stackfile.missing_secrets("prod", tmp_path) == [
        "qwen-cluster:loadBalancer.tls.privateKey: pulumi config set --stack prod --secret --path "
        "'qwen-cluster:loadBalancer.tls.privateKey' < key.pem"
    ]
    access["apiKeys"] = ["in-plain-text"]
    document["config"]["qwen-cluster:loadBalancer"]["tls"]["privateKey"] = {"secure": "v1:k"}
    (tmp_path / "Pulumi.prod.yaml").write_text(yaml.safe_dump(document))
    assert [line.split(":")[1] for line in stackfile.missing_secrets("prod", tmp_path)] == ["access.apiKeys"]
    document["environment"] = ["qwen-cluster/prod"]
    (tmp_path / "Pulumi.prod.yaml").write_text(yaml.safe_dump(document))
    assert stackfile.missing_secrets("prod", tmp_path) == []
