"""make demo: the lab part says why it is skipped where it cannot run."""

from __future__ import annotations

from labkit import demo
from tooling import demo as offline_demo


def test_lab_is_skipped_without_root_with_the_reason(monkeypatch):
    monkeypatch.setattr(demo.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(demo.sys, "platform", "linux")
    assert demo.lab_unavailable() == "the lab needs root (it creates network namespaces)"


def test_lab_is_skipped_off_linux(monkeypatch):
    monkeypatch.setattr(demo.sys, "platform", "darwin")
    assert demo.lab_unavailable() == "the lab needs Linux network namespaces (this is darwin)"


def test_demo_without_the_lab_previews_every_stack(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "lab_unavailable", lambda: "the lab needs root (it creates network namespaces)")
    monkeypatch.setattr(offline_demo, "OUT", tmp_path)
    assert demo.main() == 0
    out = capsys.readouterr().out
    assert "3 of 3 stacks valid and free of mandatory policy violations" in out
    assert "lab skipped: the lab needs root" in out and "make lab STACK=onprem" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dev.svg", "onprem.svg", "prod.svg"]
