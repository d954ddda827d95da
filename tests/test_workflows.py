"""The pull-request and deploy workflows: valid for GitHub (actionlint) and wired as promised."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from components import stackfile

WORKFLOWS = stackfile.PROJECT_ROOT / ".github" / "workflows"


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps_using(job: dict, action: str) -> list[dict]:
    return [step for step in job["steps"] if step.get("uses", "").startswith(action + "@")]


def test_actionlint_passes_on_every_workflow():
    actionlint = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert actionlint, "actionlint is installed from requirements.txt"
    result = subprocess.run(
        [actionlint, *sorted(map(str, WORKFLOWS.glob("*.yml")))], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_preview_runs_the_tests_then_every_stack_with_the_policy_pack():
    workflow = load("preview.yml")
    assert "pull_request" in workflow[True]  # YAML 1.1 reads the key `on` as True
    jobs = workflow["jobs"]
    assert "make test" in jobs["test"]["steps"][-1]["run"]
    preview = jobs["preview"]
    assert preview["needs"] == "test"
    stacks = {entry["stack"] for entry in preview["strategy"]["matrix"]["include"]}
    assert stacks == set(stackfile.STACKS)
    (pulumi,) = steps_using(preview, "pulumi/actions")
    assert pulumi["with"]["command"] == "preview"
    assert pulumi["with"]["policyPacks"] == "policies"
    assert pulumi["with"]["comment-on-pr"] is True
    assert "vars.PULUMI_BACKEND_URL" in pulumi["with"]["cloud-url"]
    assert preview["permissions"]["id-token"] == "write"
    (aws,) = steps_using(preview, "aws-actions/configure-aws-credentials")
    assert "role-to-assume" in aws["with"] and "aws-access-key-id" not in aws["with"]


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
