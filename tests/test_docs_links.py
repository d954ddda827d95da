"""The README and docs/ point only at things that exist: relative links (and their #anchors),
repository paths in backticks, dotted module names of this project's packages, config keys
(`qwen-cluster:section.key`, or `section.key` for a section of the schema), `make` targets and
their variables, and the options of the scripts (`scripts/plan.py ... --change`)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from qwen_cluster import tags

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


# --- config keys ---------------------------------------------------------------------------------


@functools.cache
def config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Every key of the config schema, as the generated reference names them (`nodes[].name`,
    `access.apiKeys`), without `[]`; and the keys that are maps (whose own keys are the user's)."""
    from tooling import config_reference

    keys, maps = set(), set()
    for line in config_reference.render().splitlines():
        row = re.match(r"^\| `qwen-cluster:([^`]+)` \| ([^|]+) \|", line)
        if row:
            key = row.group(1).replace("[]", "")
            keys.add(key)
            if row.group(2).startswith("map of"):
                maps.add(key)
    return frozenset(keys), frozenset(maps)


# The tags' keys share the config's namespace (qwen_cluster/tags.py).
TAG_KEYS = {value for name, value in vars(tags).items() if name.endswith("_TAG")}


def config_sections() -> set[str]:
    return {key.split(".")[0] for key in config_keys()[0]}


def config_key_of(token: str) -> str | None:
    """The config key a token names, or None: `qwen-cluster:KEY`, or `section.key...` for a
    section of the schema (camelCase parts, list indexes allowed, `=VALUE` after it)."""
    token = token.rstrip(".,;:)").split("=", 1)[0]
    if token.startswith("qwen-cluster:"):
        # Not a key: a type token (`qwen-cluster:aws:Network`), a pattern, the tags' keys.
        key = token.removeprefix("qwen-cluster:")
        return None if ":" in key or "*" in key or token in TAG_KEYS else key
    if token.endswith(FILE_SUFFIXES) or "/" in token:
        return None
    part = r"[a-z][A-Za-z0-9]*(?:\[\d*\])?"
    dotted = re.fullmatch(rf"{part}(?:\.{part})+", token)
    return token if dotted and token.split(".")[0].split("[")[0] in config_sections() else None


def missing_config_key(key: str) -> str | None:
    keys, maps = config_keys()
    plain = re.sub(r"\[\d*\]", "", key)
    if plain in keys or any(plain.startswith(f"{m}.") for m in maps):
        return None
    return f"{key}: no such config key (docs/config.md)"


# --- make targets -----------------------------------------------------------------------------

MAKE = re.compile(r"\bmake ((?:[A-Za-z_][\w-]*(?:=\S*)?[ \t]*)+)")  # one line: a command ends there


@functools.cache
def makefile() -> tuple[frozenset[str], frozenset[str]]:
    """The Makefile's targets and variables."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[:?]?=", text, re.M))
    return frozenset(targets), frozenset(variables)


def missing_make(words: str) -> list[str]:
    targets, variables = makefile()
    found = []
    for word in words.split():
        name, is_variable, _ = word.partition("=")
        if is_variable and name not in variables:
            found.append(f"make {word}: the Makefile has no variable {name}")
        elif not is_variable and name not in targets:
            found.append(f"make {word}: the Makefile has no target {name}")
    return found


# --- script options ---------------------------------------------------------------------------

LIBRARIES = ("tooling", "labkit")  # where the scripts' parsers live
SCRIPT_CALL = re.compile(r"scripts/(\w+)\.py\b([^`|#;&\n]*)")


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def script_options(script: str) -> frozenset[str] | None:
    """The options and subcommands the argument parser behind scripts/<script>.py accepts, read
    from the source: every `add_argument` of the module whose `main` the script runs, and of the
    `add_arguments(parser)` functions of the tooling and lab modules it imports (labkit/bench.py
    takes tooling/bench.py's), or of all of them when that `main` wraps another. None when the
    script does not exist."""
    path = ROOT / "scripts" / f"{script}.py"
    if not path.is_file():
        return None
    runs = next(
        node.module
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and any(alias.name == "main" for alias in node.names)
    )
    main_module = ast.parse(_module_file(runs).read_text())
    # A `main` that builds no parser hands the arguments to the one it wraps (labkit/cluster/doctor.py).
    wraps = not any(getattr(node, "attr", "") == "add_argument" for node in ast.walk(main_module))
    sources: list[ast.AST] = [main_module]
    for node in ast.walk(main_module):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            for name in [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]:
                if (found := _module_file(name)) is not None:
                    imported = ast.parse(found.read_text())
                    sources += [imported] if wraps else [
                        function
                        for function in imported.body
                        if isinstance(function, ast.FunctionDef) and function.name == "add_arguments"
                    ]
    accepted: set[str] = set()
    for source in sources:
        for node in ast.walk(source):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                accepted.update(a.value for a in node.args if isinstance(a, ast.Constant))
                for keyword in node.keywords:
                    if keyword.arg == "choices" and isinstance(keyword.value, ast.Tuple | ast.List):
                        accepted.update(e.value for e in keyword.value.elts if isinstance(e, ast.Constant))
    return frozenset(accepted)


def missing_options(script: str, arguments: str) -> list[str]:
    accepted = script_options(script)
    if accepted is None:
        return []  # the path check says the script is missing
    return [
        f"scripts/{script}.py {option}: the script has no option {option}"
        for option in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", arguments)
        if option not in accepted
    ]


def problems(doc: Path, text: str) -> list[str]:
    # A link is never inside inline code (a regex such as `[a-z]([a-z-]*)` is not one).
    found = [broken_link(doc, text, target) for target in LINK.findall(CODE.sub("", prose(text)))]
    for span in CODE.findall(prose(text)):
        for token in span.split():
            if DOTTED.match(token):
                found.append(missing_module(token))
            elif (key := config_key_of(token)) is not None:
                found.append(missing_config_key(key))
            else:
                found.append(missing_path(token))
    # Commands, in code spans and in fenced blocks alike.
    commands = [*CODE.findall(prose(text)), *(block.group(0) for block in FENCE.finditer(text))]
    for command in commands:
        for match in MAKE.finditer(command):
            found.extend(missing_make(match.group(1)))
        for match in SCRIPT_CALL.finditer(command):
            found.extend(missing_options(match.group(1), match.group(2)))
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


def test_the_checker_finds_config_keys_make_targets_and_script_options_that_do_not_exist():
    text = (
        "`bareMetal.sshUser` `access.apiKeys[0]` `tuning.sysctl.net.core.rmem_max` `model.image=x:1`\n"
        "`bareMetal.rootOnly` `qwen-cluster:model.nosuch` `qwen-cluster:role` `qwen-cluster:aws:Network`\n"
        "`make lab STACK=onprem` `make deploy` `make plan FOO=1` `scripts/bench.py --no-lab --lab-nodes 4`\n"
        "```bash\nmake test\n.venv/bin/python scripts/plan.py dev --change a=b --dry-run  # --not-an-option\n"
        "sudo .venv/bin/python scripts/lab.py upgrade onprem --change x=y --nodes 8 --fast\n```\n"
    )
    assert problems(ROOT / "docs" / "probe.md", text) == [
        "docs/probe.md: bareMetal.rootOnly: no such config key (docs/config.md)",
        "docs/probe.md: model.nosuch: no such config key (docs/config.md)",
        "docs/probe.md: make deploy: the Makefile has no target deploy",
        "docs/probe.md: make FOO=1: the Makefile has no variable FOO",
        "docs/probe.md: scripts/plan.py --dry-run: the script has no option --dry-run",
        "docs/probe.md: scripts/lab.py --fast: the script has no option --fast",
    ]


def test_the_readme_stays_a_quick_start():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
