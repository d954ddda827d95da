"""The config reference (docs/config.md) is rendered from the schema and cannot go stale."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from qwen_cluster import config
from qwen_cluster.config.values import Section, computed_default
from tooling import config_reference


class Probe(Section):
    count: int = Field(default=3, ge=1, le=9, description="a bounded number")
    flavour: Literal["plain", "salted"] = Field(default="plain", description="a choice")
    names: list[Annotated[str, Field(pattern=r"^[a-z]+$")]] = Field(min_length=1, description="a list")
    owner: str | None = Field(default=None, json_schema_extra=computed_default("the master"), description="x")


def field(name: str):
    return Probe.model_fields[name]


def test_committed_reference_is_what_the_schema_renders():
    committed = config_reference.OUTPUT.read_text()
    assert committed == config_reference.render(), "docs/config.md is stale: run `make docs`"


def test_every_key_of_every_section_has_a_description():
    assert config_reference.undocumented() == []


def test_a_key_without_a_description_is_reported_by_its_path():
    class Inner(Section):
        documented: int = Field(default=1, description="has one")
        forgotten: int = 2

    class Root(BaseModel):
        inner: Inner = Field(default=Inner(), description="a section")
        rows: list[Inner] = Field(default=[], description="rows of it")

    assert config_reference.undocumented(Root, secrets={}) == ["inner.forgotten", "rows[].forgotten"]


def test_every_known_key_has_a_row():
    rendered = config_reference.render()
    for key in config.KNOWN_KEYS:
        assert f"| `{config.NAMESPACE}:{key}` |" in rendered, key
    for path, model in config_reference.sections():
        for name, section_field in model.model_fields.items():
            assert f"| `{config.NAMESPACE}:{path}.{section_field.alias or name}` |" in rendered


def test_constraints_are_read_from_the_schema():
    assert config_reference.constraints(field("count")) == ["1-9"]
    assert config_reference.constraints(field("flavour")) == ["one of `plain`, `salted`"]
    assert config_reference.constraints(field("names")) == ["at least 1 entry", "items: pattern `^[a-z]+$`"]


def test_defaults_are_the_models_own_and_computed_ones_are_described():
    assert config_reference.default(field("count")) == "`3`"
    assert config_reference.default(field("names")) == "required"
    assert config_reference.default(field("owner")) == "the master"
    sysctl = config_reference.default(config.Tuning.model_fields["sysctl"])
    assert (
        sysctl == "`{" + ", ".join(f"{key}: {value}" for key, value in config.DEFAULT_SYSCTL.items()) + "}`"
    )


def test_a_limit_enforced_between_sections_is_rendered_from_its_constant():
    row = next(
        line
        for line in config_reference.render().splitlines()
        if line.startswith(f"| `{config.NAMESPACE}:loadBalancer.idleTimeoutSeconds`")
    )
    low, high = config.NLB_IDLE_TIMEOUT_SECONDS
    assert f"AWS NLB: {low}-{high}" in row


def test_check_passes_on_a_fresh_file_and_names_the_difference_on_a_stale_one(tmp_path, capsys):
    output = tmp_path / "config.md"
    assert config_reference.main(["--output", str(output)]) == 0
    assert config_reference.main(["--check", "--output", str(output)]) == 0

    fresh = output.read_text()
    output.write_text(fresh.replace("| `qwen-cluster:rollout.drainTimeoutSeconds` |", "| `drain` |"))
    capsys.readouterr()
    assert config_reference.main(["--check", "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert "-| `drain` |" in err
    assert "+| `qwen-cluster:rollout.drainTimeoutSeconds` |" in err
    assert "is stale: run `make docs`" in err
