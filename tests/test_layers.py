"""The layers point one way (docs/developers.md#architecture): the deployed program never imports
the tooling or the lab, the tooling never imports the lab (the lab may use the tooling), neither
imports the components (they reach the program through its render, tooling/offline.py, which runs
`__main__.py` under mocks, and through the pure core, qwen_cluster/), and no package's modules
import each other in a cycle. Every import counts, a deferred one inside a
function too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("components", "qwen_cluster", "tooling", "labkit", "policies")
# What each part of the project may not import.
FORBIDDEN = {
    "__main__.py": ("tooling", "labkit", "tests"),
    "components": ("tooling", "labkit", "tests"),
    "qwen_cluster": ("components", "tooling", "labkit", "tests"),
    "policies": ("components", "tooling", "labkit", "tests"),
    "tooling": ("components", "labkit", "tests"),
    "labkit": ("components", "tests"),
}


def sources(part: str) -> list[Path]:
    path = ROOT / part
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it, as dotted names (relative ones resolved)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            # `from pkg import module`: the module too, when it is one.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("part", FORBIDDEN)
def test_imports_point_one_way(part):
    wrong = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(part)
        for name in imported(path)
        if name.split(".")[0] in FORBIDDEN[part]
    )
    assert wrong == []


def modules(package: str) -> dict[str, Path]:
    return {module_name(path): path for path in sources(package)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    known = modules(package)
    # A module's own enclosing packages are loaded before it whatever it imports: not an edge.
    graph = {
        name: {other for other in imported(path) if other in known and not name.startswith(f"{other}.")}
        for name, path in known.items()
    }
    graph = {name: targets - {name} for name, targets in graph.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# labkit's rooms, lowest first (labkit/__init__.py): each imports only the rooms before it.
LAB_ROOMS = ["hosts", "models", "images", "engine", "cluster", "aws", "cli", "bench", "demo"]


def lab_room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_labkit_rooms_point_one_way():
    known = modules("labkit")
    assert {lab_room(name) for name in known} - {""} == set(LAB_ROOMS)
    wrong = sorted(
        f"{name} imports {other}"
        for name, path in known.items()
        for other in imported(path)
        if other in known and lab_room(other) and lab_room(name)
        and LAB_ROOMS.index(lab_room(other)) > LAB_ROOMS.index(lab_room(name))
    )
    assert wrong == []
