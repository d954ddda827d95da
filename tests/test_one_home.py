"""One home per fact: the host directories, the SSM document registration, the weights cache and
the model server's container name are each written once, and both targets use them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qwen_cluster import config, hostpaths, tags
from qwen_cluster.render import ssm

ROOT = Path(__file__).resolve().parent.parent
# The deployed program: what `pulumi up` runs.
PROGRAM = [
    ROOT / "__main__.py",
    *sorted(ROOT.glob("components/**/*.py")),
    *sorted(ROOT.glob("qwen_cluster/**/*.py")),
]


def code_strings(path: Path) -> list[str]:
    """Every string constant of a module that is not a docstring (f-string parts included)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


@pytest.mark.parametrize("directory", [hostpaths.CONFIG_DIR, hostpaths.STATE_DIR, hostpaths.CACHE_DIR])
def test_each_host_directory_is_written_once(directory):
    homes = sorted(
        str(path.relative_to(ROOT)) for path in PROGRAM for text in code_strings(path) if directory in text
    )
    assert homes == ["qwen_cluster/hostpaths.py"]


def test_every_ssm_document_is_registered_by_the_one_constructor():
    callers = sorted(
        str(path.relative_to(ROOT))
        for path in PROGRAM
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("ssm.Document")
    )
    assert callers == ["components/aws/documents.py"]


def test_both_targets_keep_the_weights_in_the_same_cache_and_run_the_same_container():
    assert ssm.HF_CACHE == config.DEFAULT_WEIGHTS_CACHE == hostpaths.WEIGHTS_CACHE
    assert ssm.CONTAINER_NAME == tags.MODEL_SERVER_CONTAINER
