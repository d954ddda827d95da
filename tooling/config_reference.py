"""Render the config reference (docs/config.md) from the stack config's pydantic schema, as
terraform-docs renders a module's inputs: every key with its type, default, constraints and
description, one table per section, so the reference cannot drift from the code.

    python -m tooling.config_reference           write docs/config.md (`make docs`)
    python -m tooling.config_reference --check   exit 1, showing the difference, when it is stale
"""

from __future__ import annotations

import argparse
import difflib
import enum
import ipaddress
import json
import sys
import textwrap
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo

from qwen_cluster import catalog, config
from qwen_cluster import ports as port_table
from qwen_cluster.config.values import COMPUTED_DEFAULT

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "docs" / "config.md"
COLUMNS = ("key", "type", "default", "constraints", "description")

_SCALARS = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
    ipaddress.IPv4Address: "IPv4 address",
    ipaddress.IPv4Network: "IPv4 CIDR",
    ipaddress.IPv6Network: "IPv6 CIDR",
    port_table.PortRange: 'port or "low-high"',
}


# --- reading the schema ---------------------------------------------------------------------


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """`Annotated[T, ...]` -> (T, its metadata), flattening FieldInfo metadata."""
    metadata: list[Any] = []
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        for item in extra:
            metadata += item.metadata if isinstance(item, FieldInfo) else [item]
    return annotation, metadata


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model behind a field (`Bastion | None`, `list[Node]`), if any."""
    annotation = _without_none(_unwrap(annotation)[0])
    if get_origin(annotation) is list:
        annotation = _unwrap(get_args(annotation)[0])[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _choices(annotation: Any) -> list[str] | None:
    if get_origin(annotation) is Literal:
        return [str(arg) for arg in get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    return None


def type_name(annotation: Any) -> str:
    # `Secret | None`: the optional's own Annotated type unwrapped too.
    annotation = _unwrap(_without_none(_unwrap(annotation)[0]))[0]
    origin = get_origin(annotation)
    if _choices(annotation) is not None:
        return "string"
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0])}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {type_name(key)} to {type_name(value)}"
    if origin in (Union, types.UnionType):
        names = [type_name(arg) for arg in get_args(annotation)]
        if names == ["IPv4 CIDR", "IPv6 CIDR"]:
            return "CIDR (IPv4 or IPv6)"
        return ", ".join(names[:-1]) + f" or {names[-1]}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return _SCALARS[annotation]


def _count(number: int, unit: str) -> str:
    return f"{number} {unit if number != 1 else unit.removesuffix('s').replace('entrie', 'entry')}"


def _bounds(metadata: Sequence[Any], unit: str) -> list[str]:
    """Pydantic's constraint metadata (annotated_types Ge, Le, MinLen, ... and the pattern),
    read by attribute: each item carries the one it stands for."""
    found: dict[str, Any] = {}
    for item in metadata:
        for name in ("ge", "le", "gt", "lt", "min_length", "max_length", "pattern"):
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    parts = []
    if "ge" in found and "le" in found:
        parts.append(f"{found['ge']}-{found['le']}")
    else:
        parts += [f"at least {found['ge']}"] if "ge" in found else []
        parts += [f"at most {found['le']}"] if "le" in found else []
    parts += [f"above {found['gt']}"] if "gt" in found else []
    parts += [f"below {found['lt']}"] if "lt" in found else []
    parts += [f"at least {_count(found['min_length'], unit)}"] if "min_length" in found else []
    parts += [f"at most {_count(found['max_length'], unit)}"] if "max_length" in found else []
    parts += [f"pattern `{found['pattern']}`"] if "pattern" in found else []
    return parts


def constraints(field: FieldInfo) -> list[str]:
    """What the schema itself enforces: bounds, lengths, patterns, choices (also of list items
    and map values)."""
    annotation, metadata = _unwrap(field.annotation)
    annotation = _without_none(annotation)
    unit = "entries" if get_origin(annotation) in (list, dict) else "characters"
    parts = _bounds([*field.metadata, *metadata], unit)
    if (choices := _choices(annotation)) is not None:
        parts.append("one of " + ", ".join(f"`{choice}`" for choice in choices))
    if get_origin(annotation) in (list, dict):
        inner, inner_metadata = _unwrap(get_args(annotation)[-1])
        what = "items" if get_origin(annotation) is list else "values"
        inner_parts = _bounds(inner_metadata, "characters")
        if (choices := _choices(inner)) is not None:
            inner_parts.append("one of " + ", ".join(f"`{choice}`" for choice in choices))
        parts += [f"{what}: {part}" for part in inner_parts]
    return parts


def _flow(value: Any) -> str:
    """A JSON value as the stack file would spell it (YAML flow style)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if isinstance(value, str):
        return json.dumps(value) if _needs_quotes(value) else value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value)


def _needs_quotes(text: str) -> bool:
    """Whether YAML (flow style) would misread the string unquoted."""
    if not text or text.strip() != text or text[0] in "-?:#&*!|>'\"%@`":
        return True
    if ": " in text or " #" in text or any(c in text for c in ",[]{}"):
        return True
    return _looks_like_yaml_scalar(text)


def _looks_like_yaml_scalar(text: str) -> bool:
    """A string YAML would read as a number, boolean or null, so it needs quotes."""
    if text.lower() in ("true", "false", "null", "yes", "no", "on", "off", "~"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if COMPUTED_DEFAULT in extra:
        return str(extra[COMPUTED_DEFAULT])
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "every key's default"
    if _model_of(field.annotation) is not None:
        return "the table below"
    plain = TypeAdapter(field.annotation).dump_python(value, mode="json", by_alias=True)
    return f"`{_flow(plain)}`"


def _key(field: FieldInfo, name: str) -> str:
    return field.alias or name


def sections(root: type[BaseModel] = config.ClusterConfig) -> Iterator[tuple[str, type[BaseModel]]]:
    """(key path, model) of every section under `root`, nested ones after their parent, in
    stack-file order; a list of rows is `key[]`."""

    def walk(prefix: str, model: type[BaseModel]) -> Iterator[tuple[str, type[BaseModel]]]:
        for name, field in model.model_fields.items():
            if (inner := _model_of(field.annotation)) is not None:
                many = get_origin(_without_none(_unwrap(field.annotation)[0])) is list
                path = f"{prefix}{_key(field, name)}{'[]' if many else ''}"
                yield path, inner
                yield from walk(f"{path}.", inner)

    yield from walk("", root)


def undocumented(
    root: type[BaseModel] = config.ClusterConfig, secrets: Mapping[str, str] = config.SECRET_KEYS
) -> list[str]:
    """Keys whose field has no description: the reference would have a hole there."""
    missing = [_key(field, name) for name, field in root.model_fields.items() if not field.description]
    missing += [key for key, text in secrets.items() if not text]
    for path, model in sections(root):
        missing += [
            f"{path}.{_key(field, name)}"
            for name, field in model.model_fields.items()
            if not field.description
        ]
    return missing


# --- rendering ------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, ...]], columns: Sequence[str] = COLUMNS) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def _row(key: str, field: FieldInfo) -> tuple[str, ...]:
    kind = type_name(field.annotation)
    return (f"`{key}`", kind, default(field), "; ".join(constraints(field)), field.description or "")


def _anchor(path: str) -> str:
    """GitHub's anchor for the heading `qwen-cluster:<path>`: lower case, punctuation dropped."""
    heading = f"{config.NAMESPACE}:{path}".lower()
    return "".join(c for c in heading if c.isalnum() or c in "-_")


def _header() -> list[str]:
    """The prose above the tables; its figures come from the catalog, like the rules they explain."""
    weights = catalog.MODELS[config.DEFAULT_MODEL]
    need = catalog.replica_memory_needed_gb(weights.weights_gb)
    usable = catalog.GPU_MEMORY_UTILIZATION * catalog.WEIGHTS_SHARE
    h100, l40s = catalog.instance_type("p5.48xlarge"), catalog.instance_type("g6e.12xlarge")
    burst = catalog.instance_type("g5.xlarge")
    one_h100 = "is refused" if h100.gpu_memory_gb < need else "is enough"
    four_l40s = "pass" if 4 * l40s.gpu_memory_gb >= need else "are refused"
    burst_verdict = "refused" if burst.baseline_gbps < config.MIN_BANDWIDTH_GBPS else "accepted"
    paragraphs = [
        f"The stack config is the `config:` block of `Pulumi.<stack>.yaml`. Keys live under the "
        f"project's namespace `{config.NAMESPACE}:` and are camelCase; a key's full path "
        f"(`{config.NAMESPACE}:network.cidr`) is what `pulumi config set --path` takes. Unknown keys "
        "are errors; every problem in a config is reported at once, each naming its key and value, "
        "and a bad config stops the program before any resource is registered. Types, defaults and "
        "constraints below are read from the schema (`qwen_cluster/config/`); a rule between keys is "
        "stated in the key's description.",
        f"**The memory rule.** vLLM takes {catalog.GPU_MEMORY_UTILIZATION:.0%} of every GPU "
        f"(`gpu_memory_utilization`); of that the weights may fill at most {catalog.WEIGHTS_SHARE:.0%}, "
        "the rest is KV cache for long, thinking-mode contexts. So a replica (tensorParallel x "
        f"pipelineParallel GPUs) needs weights / {usable:.2f} of GPU memory: {need:g} GB for "
        f"{weights.name} in bf16 ({weights.weights_gb:g} GB of weights). One {h100.gpu_model} "
        f"({h100.gpu_memory_gb:g} GB) {one_h100}; four {l40s.gpu_model} (4 x {l40s.gpu_memory_gb:g} GB) "
        f"{four_l40s}. AWS lists GPU memory in GiB; the catalog converts.",
        '**Bandwidth class.** "Up to N Gigabit" instance types burst for minutes only; a cluster that '
        "moves activations between nodes continuously gets the baseline, so the baseline is what "
        f"counts ({burst.name}: {burst.baseline_gbps:g} Gbit/s, {burst_verdict}).",
    ]
    lines = [
        "<!-- Generated from qwen_cluster/config by `python -m tooling.config_reference` (`make docs`).",
        "Do not edit: change the field's description in the schema and regenerate. -->",
        "",
        "# Config reference",
    ]
    for paragraph in paragraphs:
        lines += ["", textwrap.fill(paragraph, width=100, break_on_hyphens=False, break_long_words=False)]
    return lines


def render() -> str:
    missing = undocumented()
    if missing:
        raise ValueError(f"keys without a description: {', '.join(missing)}")
    top = config.ClusterConfig.model_fields
    nested: dict[str, str] = {}
    for path, _ in sections():
        nested.setdefault(path.split(".")[0].removesuffix("[]"), path)
    rows = []
    for key, (attr, _, _) in config.SECTIONS.items():
        *cells, description = _row(f"{config.NAMESPACE}:{key}", top[attr])
        if key in nested:
            description += f" Keys: [`{nested[key]}`](#{_anchor(nested[key])})."
        rows.append((*cells, description))
    rows += [
        (f"`{config.NAMESPACE}:{key}`", "secret string", "none", "", text)
        for key, text in config.SECRET_KEYS.items()
    ]
    lines = [*_header(), "", "## Top-level keys", "", *_table(rows)]
    for path, model in sections():
        lines += ["", f"## {config.NAMESPACE}:{path}", ""]
        if model.__doc__:
            lines += [" ".join(model.__doc__.split()), ""]
        lines += _table(
            [_row(f"{config.NAMESPACE}:{path}.{field.alias}", field) for field in model.model_fields.values()]
        )
        if path == "ports[]":
            lines += ["", "The default table, when `ports` is not given:", ""]
            dumped = [entry.model_dump(mode="json", by_alias=True) for entry in port_table.DEFAULT_PORTS]
            columns = tuple(dumped[0])
            lines += _table(
                [tuple(f"`{_flow(entry[name])}`" for name in columns) for entry in dumped], columns
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the schema")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(REPO)}")
    args = parser.parse_args(argv)
    rendered = render()
    if not args.check:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(rendered)
        print(f"wrote {args.output}")
        return 0
    committed = args.output.read_text() if args.output.exists() else ""
    if committed == rendered:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(keepends=True),
        rendered.splitlines(keepends=True),
        fromfile=f"{args.output} (committed)",
        tofile=f"{args.output} (rendered from the schema)",
    )
    sys.stderr.write("".join(diff))
    sys.stderr.write(f"{args.output} is stale: run `make docs` (python -m tooling.config_reference)\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
