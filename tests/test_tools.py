"""A test whose tool is missing skips and says which (tests/helpers/tools.py)."""

from __future__ import annotations

import pytest

from tests.helpers import baremetal, tools


def test_a_missing_tool_skips_the_test_naming_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(tools, "_SEARCH", "/nonexistent")
    with pytest.raises(pytest.skip.Exception, match=r"^shellcheck, promtool not installed \(make system"):
        tools.require("shellcheck", "promtool")


def test_shellcheck_missing_is_a_skip_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(tools, "_SEARCH", "/nonexistent")
    with pytest.raises(pytest.skip.Exception, match="shellcheck not installed"):
        baremetal.shellcheck("#!/bin/bash\ntrue\n", tmp_path)


def test_an_installed_tool_runs():
    assert tools.missing("sh") == []
    tools.require("sh")
