"""The stack settings reference, generated from the settings models: docs/configuration.md's tables and the JSON
Schema of a stack file's `gpu-train:` block.

Usage:
    python -m tools.settings_reference --write docs/configuration.md   # refresh the generated tables in place
    python -m tools.settings_reference --check docs/configuration.md   # exit 1 when they are out of date
    python -m tools.settings_reference --schema > stack-settings.schema.json

The models (gpu_train/spec/settings.py, gpu_train/spec/job.py, gpu_train/spec/serving.py) are the one source: each field's key, type,
default, range (a number's own bounds, shown with its type) and description. In the document, each table sits between `<!-- settings: <key> -->` and
`<!-- /settings -->`; the prose around the tables is written by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from gpu_train.spec.errors import model_in
from gpu_train.spec.job import JobSpec, NodeRange
from gpu_train.spec.serving import ModelRef
from gpu_train.spec.settings import StackSettings

BLOCK = re.compile(r"(<!-- settings: (?P<key>[^ ]+) -->\n)(?P<body>.*?)(<!-- /settings -->)", re.S)


def range_text(metadata: Sequence[Any]) -> str:
    """A number's own bounds as the table shows them: `>= 1`, `1 to 100`, `> 0, < 100`; "" for none."""
    found: dict[str, Any] = {}
    for m in metadata:
        for bound in m.metadata if isinstance(m, FieldInfo) else [m]:
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if isinstance(bound, annotated_types.BaseMetadata) and hasattr(bound, attr):
                    found[op] = getattr(bound, attr)
    if ">=" in found and "<=" in found and len(found) == 2:
        return f"{found['>=']} to {found['<=']}"
    return ", ".join(f"{op} {value}" for op, value in found.items())


def type_name(tp: Any, metadata: Sequence[Any] = ()) -> str:
    """The type column: the type, with a number's own bounds (`int >= 1`, `a list of int 1 to 999`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0], [*metadata, *args[1:]])
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a, metadata) for a in args if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or absent" if type(None) in args else text
    if tp in (int, float) and range_text(metadata):
        return f"{type_name(tp)} {range_text(metadata)}"
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if tp is NodeRange:
        return "MIN:MAX"
    if tp is ModelRef:
        return "NAME:VERSION, NAME@ALIAS or NAME"
    if isinstance(tp, type) and issubclass(tp, BaseModel) or origin in (dict, typing.Mapping) or tp is dict:
        return "a mapping"
    if origin in (tuple, list):
        item = type_name(args[0]) if args else ""
        return f"a list of {item}" if item.startswith(("int ", "number ")) else "a list"
    return {int: "int", str: "str", bool: "bool", float: "number"}.get(tp, getattr(tp, "__name__", str(tp)))


def default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "see below"
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, NodeRange):
        return f"`'{value}'`"
    return f"`{list(value)!r}`" if isinstance(value, tuple) else f"`{value!r}`"


def table(model: type[BaseModel]) -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        meaning = (field.description or "").replace("|", "\\|")
        kind = type_name(field.annotation, field.metadata)
        rows.append(f"| `{field.alias or name}` | {kind} | {default_text(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def models() -> dict[str, type[BaseModel]]:
    """Every settings model by the key it sits under: `gpu-train:<key>`, `gpu-train:gpuPools[i]`, ..."""
    out: dict[str, type[BaseModel]] = {"gpu-train:<key>": StackSettings, "gpu-train:job": JobSpec}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = model_in(field.annotation)
            if sub is None or sub in (NodeRange, ModelRef):
                continue
            many = typing.get_origin(field.annotation) in (tuple, list)
            index = "ijk"[prefix.count("[")] if many else ""
            base = f"gpu-train:{field.alias or name}" if prefix == "gpu-train" else f"{prefix}.{field.alias or name}"
            key = f"{base}[{index}]" if index else base
            out.setdefault(key, sub)
            walk(sub, key)

    walk(StackSettings, "gpu-train")
    return out


def render(text: str) -> str:
    """The document with every generated table brought up to date; a block naming an unknown key is an error."""
    known = models()

    def fill(m: re.Match) -> str:
        key = m.group("key")
        if key not in known:
            raise KeyError(f"<!-- settings: {key} --> names no settings model (known: {', '.join(sorted(known))})")
        return m.group(1) + table(known[key]) + m.group(4)

    return BLOCK.sub(fill, text)


def missing_blocks(text: str) -> list[str]:
    """Settings models the document has no table for."""
    present = {m.group("key") for m in BLOCK.finditer(text)}
    return sorted(set(models()) - present)


def schema() -> dict[str, Any]:
    return StackSettings.model_json_schema(by_alias=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.settings_reference", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, metavar="DOC", help="refresh the generated tables of DOC in place")
    action.add_argument("--check", type=Path, metavar="DOC", help="exit 1 when DOC's tables are out of date")
    action.add_argument("--schema", action="store_true", help="print the JSON Schema of the gpu-train: block")
    args = parser.parse_args(argv)
    if args.schema:
        print(json.dumps(schema(), indent=2, sort_keys=True))
        return 0
    path = args.write or args.check
    text = path.read_text()
    fresh = render(text)
    missing = missing_blocks(fresh)
    if missing:
        print(f"{path}: no table for {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.write:
        path.write_text(fresh)
        return 0
    if fresh != text:
        print(f"{path}: the settings tables are out of date: python -m tools.settings_reference --write {path}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
