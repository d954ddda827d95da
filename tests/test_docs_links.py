"""The README and docs/ point only at things that exist: relative links (and their #anchors),
repository paths in backticks, and dotted module names of this project's packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Local, untracked or generated (see .gitignore): never a documented path's home.
LOCAL = {".git", ".venv", "out", ".pytest_cache", ".ruff_cache", "__pycache__"}
TOP_LEVEL = {entry.name for entry in ROOT.iterdir()} - LOCAL
PACKAGES = ("components", "qwen_cluster", "tooling", "labkit", "policies", "tests")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".sh", ".toml", ".txt")
# Files in other projects' sources that the docs cite (firewalld), not paths of this repository.
EXTERNAL = {"core/fw.py"}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.\w+)+$")


def prose(text: str) -> str:
    """The text outside fenced code blocks (their `#` lines are comments, not headings)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for line in prose(text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            base = slug(match.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_link(doc: Path, text: str, target: str) -> str | None:
    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    path = (doc.parent / file_part).resolve() if file_part else doc
    if file_part and not path.exists():
        return f"{target}: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} does not exist"
    if anchor and path.suffix == ".md" and anchor not in anchors(path.read_text() if file_part else text):
        return f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}"
    return None


def is_repo_path(token: str) -> bool:
    if any(mark in token for mark in "<>{}$|@=") or "://" in token or token.startswith(("/", "~", ".venv")):
        return False
    if token in EXTERNAL:
        return False
    first = token.split("/", 1)[0]
    return ("/" in token and first in TOP_LEVEL) or (first in TOP_LEVEL and "." in first) or (
        token.endswith(FILE_SUFFIXES) and "/" in token
    )


def missing_path(token: str) -> str | None:
    token = token.rstrip(".,;:)")
    if not is_repo_path(token):
        return None
    if "*" in token or "?" in token:
        return None if list(ROOT.glob(token)) else f"{token}: matches nothing"
    return None if (ROOT / token).exists() else f"{token}: does not exist"


def defined_names(module: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def missing_module(token: str) -> str | None:
    """`pkg.module[.name...]`: the longest prefix that is a module or package must exist, and the
    next part, if any, must be a submodule or a name defined at its top level."""
    parts = token.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            if rest and rest[0] not in defined_names(module):
                return f"{token}: {module.relative_to(ROOT)} defines no {rest[0]}"
            return None
    return f"{token}: no module {parts[0]}"


def problems(doc: Path, text: str) -> list[str]:
    # A link is never inside inline code (a regex such as `[a-z]([a-z-]*)` is not one).
    found = [broken_link(doc, text, target) for target in LINK.findall(CODE.sub("", prose(text)))]
    for span in CODE.findall(prose(text)):
        for token in span.split():
            found.append(missing_module(token) if DOTTED.match(token) else missing_path(token))
    return [f"{doc.relative_to(ROOT)}: {problem}" for problem in found if problem]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_in_the_docs_exists(doc):
    assert problems(doc, doc.read_text()) == []


def test_the_checker_finds_broken_links_stale_paths_and_missing_names():
    text = (
        "# Title\n[gone](missing.md) [anchor](#nowhere) [fine](#title) [readme](../README.md#docs)\n"
        "`components/config.py` `scripts/plan.py dev` `tooling.offline.no_such_name` `10.0.0.0/8`\n"
        "`tooling.offline.render` `vllm/vllm-openai:v0.33.0` `tests/test_lab_*.py` `docs/none_*.md`\n"
        "```bash\n# not a heading\n`components/ignored.py` [x](ignored.md)\n```\n"
    )
    assert problems(ROOT / "docs" / "probe.md", text) == [
        "docs/probe.md: missing.md: docs/missing.md does not exist",
        "docs/probe.md: #nowhere: no heading #nowhere in docs/probe.md",
        "docs/probe.md: components/config.py: does not exist",
        "docs/probe.md: tooling.offline.no_such_name: tooling/offline.py defines no no_such_name",
        "docs/probe.md: docs/none_*.md: matches nothing",
    ]


def test_the_readme_stays_a_quick_start():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
