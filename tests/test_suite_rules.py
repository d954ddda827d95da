"""The test suite keeps its own rules (docs/developers.md#adding-a-test): no sleep as
synchronisation and one waiting helper. A test waits through tests/helpers/wait.py; a sleep is
allowed only as the behaviour of a stand-in a test defines (a method of a class: a slow HTTP
handler, a stream paced chunk by chunk), never in a test or helper function."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WAITING_HELPER = TESTS / "helpers" / "wait.py"


def sleeps_outside_stand_ins(path: Path) -> list[int]:
    """Lines of `time.sleep(...)` / `sleep(...)` calls that are not inside a class's method."""
    found: list[int] = []

    def visit(node: ast.AST, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, True)
                continue
            sleeps = isinstance(child, ast.Call) and ast.unparse(child.func) in ("time.sleep", "sleep")
            if sleeps and not in_class:
                found.append(child.lineno)
            visit(child, in_class)

    visit(ast.parse(path.read_text()), False)
    return found


def test_no_test_or_helper_sleeps_to_synchronise():
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != WAITING_HELPER
        for line in sleeps_outside_stand_ins(path)
    ]
    assert offenders == [], "wait for the condition with tests/helpers/wait.py instead"


def test_the_rule_finds_a_sleep_in_a_function_and_allows_a_stand_ins(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(
        "import time\n"
        "def test_x():\n    time.sleep(1)\n"
        "class Slow:\n    def do_GET(self):\n        time.sleep(3)\n"
        "def helper():\n    while True:\n        time.sleep(0.1)\n"
    )
    assert sleeps_outside_stand_ins(module) == [3, 9]


def _uses(path: Path, patterns: tuple[str, ...]) -> bool:
    text = path.read_text()
    return any(pattern in text for pattern in patterns)


def test_every_module_that_runs_the_real_vllm_is_in_its_group():
    """Two real vLLM servers at once on two cores starve each other: tests/conftest.py runs
    these modules, on loopback or in a lab, one after another on one worker. A new module
    outside the group would race."""
    from tests.conftest import serial_group

    modules = [path for path in TESTS.glob("test_*.py") if path != Path(__file__)]
    real = sorted(path.stem for path in modules if _uses(path, ("realvllm",)))
    assert {"test_real_vllm", "test_lab_real_vllm"} <= set(real), "the scan's pattern is stale"
    assert [stem for stem in real if serial_group(stem) != "real-vllm"] == []


def test_a_module_and_a_group_are_each_one_unit_of_work():
    from tests.conftest import schedule_scope

    assert schedule_scope("tests/test_lab_ssh.py::test_a[x::y]") == "tests/test_lab_ssh.py"
    assert schedule_scope("tests/test_real_vllm.py::test_b") == "real-vllm"
    assert schedule_scope("tests/test_real_vllm_multinode.py::test_c") == "real-vllm"
    assert schedule_scope("tests/test_lab_real_vllm.py::test_d") == "real-vllm"


def test_make_tests_workers_each_run_whole_modules():
    """As `make test` runs them (two workers, --dist loadgroup): each module's tests all land on
    one worker (a lab module's fixture is one lab up, not one per worker). Two quick modules
    stand in for the labs."""
    import re
    import subprocess
    import sys

    modules = ("test_render_sysctl.py", "test_staging.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
         *(str(TESTS / module) for module in modules)],
        capture_output=True, text=True, cwd=TESTS.parent, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ran = re.findall(r"^\[(gw\d)\] .*PASSED (tests/\S+?)::", result.stdout, re.MULTILINE)
    assert {module for _, module in ran} == {f"tests/{module}" for module in modules}, result.stdout[-2000:]
    workers = {module: {worker for worker, name in ran if name == module} for _, module in ran}
    assert all(len(used) == 1 for used in workers.values()), workers
