"""Build structural snapshots of Helm charts, CRDs and chart repository indexes.

Usage:
    python -m tools.validation.snapshot chart DIR --out tests/schemas/charts [--source-repo R --source-ref T --source-path P]
    python -m tools.validation.snapshot crd FILE.yaml [FILE.yaml ...] --out tests/schemas/crds [--source-...]
    python -m tools.validation.snapshot index INDEX.yaml --repo URL --chart NAME [...] --out tests/schemas/charts/index.json

`chart` reads an unpacked chart (what `helm pull --untar` writes): its values.yaml, values.schema.json
and templates, and writes `<name>-<version>.json`; each dependency found under the chart's `charts/`
(directory or .tgz) gets a snapshot of its own. `crd` writes one `<group>_<plural>.json` per
CustomResourceDefinition in the files. `index` merges the versions a repository index lists for the
named charts into the index snapshot.

A snapshot holds structure only: key paths, types, enums, required fields, free-form markers, the
chart versions a repository lists, and where it came from. Descriptions, titles, examples and the
defaults' values are dropped; CRD schemas keep `default` (the API server applies it before
validating) and CEL rules without their messages.

Over 400 lines because it reads three kinds of upstream sources (charts with their dependencies, CRD files,
repository indexes) into the one snapshot format the checks read; it is developer tooling, run by `make schemas`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tarfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from tools.validation.gotemplate import ELEMENT, TemplateSyntaxError, scan_templates

GENERATOR = "tools.validation.snapshot/1"

# JSON-schema keywords whose value maps names to schemas (their keys are names, not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
# Keywords that only carry prose.
_PROSE = ("description", "title", "examples", "$comment", "markdownDescription")


class SnapshotError(ValueError):
    """A source the generator cannot read (names the file)."""


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML 1.1's `=` (the "value" tag) is an ordinary string in Kubernetes YAML (an enum member of
    the Prometheus operator's CRDs); PyYAML has no constructor for it."""


_Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def load_yaml_all(text: str) -> list[Any]:
    return list(yaml.load_all(text, Loader=_Loader))  # noqa: S506 - a safe loader


# --------------------------------------------------------------------------------------- value trees


# bool before int: True is an int in Python.
_YAML_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def yaml_type(value: Any) -> str:
    # Dates and other YAML scalars reach templates as strings.
    return next((name for kind, name in _YAML_TYPES if isinstance(value, kind)), "string")


def tree_from_defaults(value: Any) -> dict[str, Any]:
    """The structure of values.yaml: every key with the type of its default. An empty map is
    free-form (the chart leaves its keys to the user: nodeSelector, annotations, ...)."""
    node: dict[str, Any] = {"type": yaml_type(value), "default": True}
    if isinstance(value, dict):
        if not value:
            node["free"] = "empty map default"
        else:
            node["keys"] = {str(k): tree_from_defaults(v) for k, v in value.items()}
    elif isinstance(value, list) and value:
        items: dict[str, Any] = {}
        for v in value:
            merge_tree(items, tree_from_defaults(v))
        node["items"] = items
    return node


def merge_tree(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Merge two value trees; differing types widen to "any" (no type recorded)."""
    if not into:
        into.update(copy.deepcopy(other))
        return into
    if "type" in other:
        if "type" not in into:
            into["type"] = other["type"]
        elif into["type"] != other["type"]:
            numeric = {into["type"], other["type"]} <= {"integer", "number"}
            if numeric:
                into["type"] = "number"
            elif into["type"] == "null":
                into["type"] = other["type"]
            elif other["type"] != "null":
                into.pop("type")
    for flag in ("free", "iterated", "read", "default"):
        if flag in other and flag not in into:
            into[flag] = other[flag]
    for name, child in (other.get("keys") or {}).items():
        merge_tree(into.setdefault("keys", {}).setdefault(name, {}), child)
    if "items" in other:
        merge_tree(into.setdefault("items", {}), other["items"])
    return into


def node_at(tree: dict[str, Any], path: tuple[str, ...], create: bool = False) -> dict[str, Any] | None:
    node = tree
    for seg in path:
        if seg == ELEMENT:
            nxt = node.get("items")
            if nxt is None and create:
                nxt = node["items"] = {}
        else:
            nxt = (node.get("keys") or {}).get(seg)
            if nxt is None and create:
                nxt = node.setdefault("keys", {})[seg] = {}
        if nxt is None:
            return None
        node = nxt
    return node


def add_template_usage(tree: dict[str, Any], reads: set[tuple[str, ...]], whole: set[tuple[str, ...]],
                       iterated: set[tuple[str, ...]]) -> None:
    for path in sorted(reads):
        node = node_at(tree, path, create=True)
        assert node is not None
        node["read"] = True
    for path in sorted(iterated):
        node = node_at(tree, path, create=True)
        assert node is not None
        node["iterated"] = True
    for path in sorted(whole):
        if not path:
            continue  # the whole tree rendered (a checksum, a debug dump): not a free-form licence
        node = node_at(tree, path, create=True)
        assert node is not None
        node.setdefault("free", "rendered whole by a template")


def add_schema_structure(tree: dict[str, Any], schema: Any, root: Any | None = None) -> None:
    """Known keys and free-form maps from values.schema.json (after local $refs)."""
    root = schema if root is None else root
    schema = _deref(schema, root)
    if not isinstance(schema, dict):
        return
    for sub in schema.get("allOf") or []:
        add_schema_structure(tree, sub, root)
    props = schema.get("properties") or {}
    for name, sub in props.items():
        add_schema_structure(tree.setdefault("keys", {}).setdefault(name, {}), sub, root)
    extra = schema.get("additionalProperties")
    types = schema.get("type")
    types = [types] if isinstance(types, str) else (types or [])
    if isinstance(extra, dict) and extra:
        add_schema_structure(tree.setdefault("items", {}), extra, root)
        tree.setdefault("iterated", True)
        tree.setdefault("free", "schema: any key")
    elif (extra is True or (extra is None and not props and not schema.get("patternProperties"))) \
            and ("object" in types or (not types and not props and extra is True)):
        tree.setdefault("free", "schema: open map")
    if schema.get("patternProperties"):
        tree.setdefault("free", "schema: pattern keys")
    items = schema.get("items")
    if isinstance(items, dict):
        add_schema_structure(tree.setdefault("items", {}), items, root)


def _deref(schema: Any, root: Any) -> Any:
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and seen < 32:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return {}
        target: Any = root
        for part in ref[2:].split("/"):
            target = (target or {}).get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        schema = target or {}
        seen += 1
    return schema


def strip_schema(schema: Any, *, keep_default: bool) -> Any:
    """Drop prose keywords (and, unless kept, defaults) from a JSON schema, keeping property names."""
    if isinstance(schema, list):
        return [strip_schema(s, keep_default=keep_default) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _PROSE or (key == "default" and not keep_default):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strip_schema(sub, keep_default=keep_default) for name, sub in value.items()}
        elif key == "x-kubernetes-validations" and isinstance(value, list):
            out[key] = [{k: v for k, v in rule.items() if k not in ("message", "messageExpression")}
                        for rule in value]
        elif key in ("enum", "const", "required", "default", "example"):
            out[key] = value
        else:
            out[key] = strip_schema(value, keep_default=keep_default)
    return out


def relax_required(schema: Any, defaults: Any, root: Any | None = None) -> Any:
    """Helm validates the user's values merged over values.yaml, so a key values.yaml provides is
    always present: drop it from `required` so the user's values alone can be checked."""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(defaults, dict):
        if isinstance(out.get("required"), list):
            out["required"] = [r for r in out["required"] if r not in defaults]
            if not out["required"]:
                out.pop("required")
        if isinstance(out.get("properties"), dict):
            out["properties"] = {k: relax_required(v, defaults.get(k), root) for k, v in out["properties"].items()}
        if isinstance(out.get("allOf"), list):
            out["allOf"] = [relax_required(s, defaults, root) for s in out["allOf"]]
    return out


# --------------------------------------------------------------------------------------------- charts


def _read_chart_files(chart_dir: Path) -> dict[str, str]:
    files = {}
    tdir = chart_dir / "templates"
    if tdir.is_dir():
        for path in sorted(tdir.rglob("*")):
            if path.is_file() and path.suffix in (".yaml", ".yml", ".tpl", ".txt", ".json"):
                files[str(path.relative_to(chart_dir))] = path.read_text(errors="replace")
    return files


def chart_snapshot(chart_dir: Path, source: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Snapshot of one unpacked chart (not its dependencies)."""
    meta_path = chart_dir / "Chart.yaml"
    if not meta_path.is_file():
        raise SnapshotError(f"{chart_dir}: no Chart.yaml (is this an unpacked chart?)")
    try:
        meta = yaml.safe_load(meta_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SnapshotError(f"{meta_path}: not valid YAML: {yaml_error(exc)}") from None
    values_path = chart_dir / "values.yaml"
    try:
        defaults = yaml.safe_load(values_path.read_text()) if values_path.is_file() else {}
    except yaml.YAMLError as exc:
        raise SnapshotError(f"{values_path}: not valid YAML: {yaml_error(exc)}") from None
    defaults = defaults or {}
    if not isinstance(defaults, dict):
        raise SnapshotError(f"{values_path}: the top level must be a mapping")
    tree = tree_from_defaults(defaults)
    tree.pop("free", None)  # an empty values.yaml does not make the chart free-form

    schema = None
    schema_path = chart_dir / "values.schema.json"
    if schema_path.is_file():
        try:
            raw_schema = json.loads(schema_path.read_text())
        except json.JSONDecodeError as exc:
            raise SnapshotError(f"{schema_path}: not valid JSON: {exc}") from None
        add_schema_structure(tree, raw_schema)
        schema = relax_required(strip_schema(raw_schema, keep_default=False), defaults)

    files = _read_chart_files(chart_dir)
    try:
        scan = scan_templates(files)
    except TemplateSyntaxError as exc:
        raise SnapshotError(f"{chart_dir}: {exc}") from None
    add_template_usage(tree, scan.reads, scan.whole, scan.iterated)

    deps = []
    for dep in meta.get("dependencies") or []:
        entry = {k: dep[k] for k in ("name", "alias", "version", "repository", "condition", "tags") if dep.get(k)}
        deps.append(entry)
        # Helm reads a dependency's condition itself, so its path is defined.
        for cond in str(dep.get("condition") or "").split(","):
            if cond.strip():
                node = node_at(tree, tuple(cond.strip().split(".")), create=True)
                assert node is not None
                node.setdefault("type", "boolean")
                node["read"] = True

    gaps = {(g["file"], g["path"], g["why"]) for g in scan.gaps}
    if () in scan.whole:
        gaps.add(("", "", "a template renders the whole values tree (a checksum or a dump); that is not "
                          "taken as licence for any key"))
    gaps = sorted(gaps)
    return {
        "generator": GENERATOR,
        "kind": "chart",
        "chart": meta.get("name"),
        "version": str(meta.get("version")),
        "appVersion": str(meta.get("appVersion")) if meta.get("appVersion") is not None else None,
        "source": dict(source or {}),
        "dependencies": deps,
        "values": tree,
        "schema": schema,
        "templatesScanned": sorted(files),
        "gaps": [{"file": f, "path": p, "why": w} for f, p, w in gaps],
    }


def dependency_dirs(chart_dir: Path, work: Path) -> list[tuple[Path, str]]:
    """Unpacked dependencies under charts/ (directories, or .tgz archives unpacked into work), each
    with the name of its entry under charts/."""
    out: list[tuple[Path, str]] = []
    sub = chart_dir / "charts"
    if not sub.is_dir():
        return out
    for entry in sorted(sub.iterdir()):
        if entry.is_dir() and (entry / "Chart.yaml").is_file():
            out.append((entry, entry.name))
        elif entry.suffix == ".tgz" or entry.name.endswith(".tar.gz"):
            dest = work / entry.name.removesuffix(".tgz").removesuffix(".tar.gz")
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(entry) as tar:
                members = [m for m in tar.getmembers() if m.isfile() and _safe(m.name)]
                tar.extractall(dest, members=members, filter="data")
            out.extend((d, entry.name) for d in dest.iterdir() if (d / "Chart.yaml").is_file())
    return out


def _safe(name: str) -> bool:
    p = PurePosixPath(name)
    return not p.is_absolute() and ".." not in p.parts


def snapshot_name(chart: str, version: str) -> str:
    return f"{chart}-{version}.json"


def write_json(doc: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def write_chart_snapshots(chart_dir: Path, out: Path, source: Mapping[str, Any] | None = None,
                          work: Path | None = None) -> list[Path]:
    """Snapshot a chart and, recursively, every dependency packaged with it."""
    import tempfile

    written = []
    snap = chart_snapshot(chart_dir, source)
    written.append(write_json(snap, out / snapshot_name(snap["chart"], snap["version"])))
    with tempfile.TemporaryDirectory() as tmp:
        for dep, entry in dependency_dirs(chart_dir, work or Path(tmp)):
            dep_source = dict(source or {})
            dep_source["path"] = f"{dep_source.get('path', chart_dir.name)}/charts/{entry}"
            written.extend(write_chart_snapshots(dep, out, dep_source, work or Path(tmp)))
    return written


# ----------------------------------------------------------------------------------------------- CRDs


def crd_snapshots(text: str, source: Mapping[str, Any] | None = None, origin: str = "") -> list[dict[str, Any]]:
    """One snapshot per CustomResourceDefinition in a (multi-document) YAML text. Lines of a Helm
    template wrapper (`{{- if ... }}`) around the documents are skipped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("{{")]
    try:
        docs = load_yaml_all("\n".join(lines))
    except yaml.YAMLError as exc:
        raise SnapshotError(f"{origin or 'CRD file'}: not valid YAML: {yaml_error(exc)}") from None
    out = []
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc.get("spec") or {}
        names = spec.get("names") or {}
        versions = {}
        for v in spec.get("versions") or []:
            schema = ((v.get("schema") or {}).get("openAPIV3Schema"))
            if schema is None:
                raise SnapshotError(f"{origin}: {names.get('kind')} {v.get('name')} has no openAPIV3Schema")
            versions[v["name"]] = {
                "served": bool(v.get("served")),
                "storage": bool(v.get("storage")),
                "schema": strip_schema(schema, keep_default=True),
            }
        if not versions:
            raise SnapshotError(f"{origin}: {names.get('kind')} lists no versions")
        out.append({
            "generator": GENERATOR,
            "kind": "crd",
            "group": spec.get("group"),
            "names": {"kind": names.get("kind"), "plural": names.get("plural")},
            "scope": spec.get("scope"),
            "source": dict(source or {}),
            "versions": versions,
        })
    return out


def crd_snapshot_name(snap: Mapping[str, Any]) -> str:
    return f"{snap['group']}_{snap['names']['plural']}.json"


# ---------------------------------------------------------------------------------------- indexes


def index_versions(index_text: str, charts: list[str], origin: str = "") -> dict[str, list[str]]:
    """The versions a Helm repository index.yaml lists for the named charts, newest first."""
    try:
        doc = yaml.load(index_text, Loader=_Loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as exc:
        raise SnapshotError(f"{origin or 'index.yaml'}: not valid YAML: {yaml_error(exc)}") from None
    entries = (doc or {}).get("entries") or {}
    out = {}
    for chart in charts:
        if chart not in entries:
            raise SnapshotError(f"{origin or 'index.yaml'}: lists no chart {chart!r}")
        out[chart] = [str(e["version"]) for e in entries[chart]]
    return out


def merge_index(existing: Mapping[str, Any] | None, repo: str, versions: Mapping[str, list[str]],
                source: Mapping[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(dict(existing or {}))
    doc["generator"] = GENERATOR
    doc["kind"] = "chart-index"
    repos = doc.setdefault("repositories", {})
    entry = repos.setdefault(repo, {"charts": {}, "sources": {}})
    entry.pop("unverified", None)  # the index was read now
    for chart, vs in versions.items():
        entry["charts"][chart] = list(vs)
        entry["sources"][chart] = dict(source)
    return doc


# ------------------------------------------------------------------------------------------------ CLI


def _source(args: argparse.Namespace) -> dict[str, str]:
    return {k: v for k, v in (("repo", args.source_repo), ("ref", args.source_ref), ("path", args.source_path))
            if v}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validation.snapshot", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("chart", "crd", "index"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--source-repo")
        p.add_argument("--source-ref")
        p.add_argument("--source-path")
        if name == "chart":
            p.add_argument("dir", type=Path)
        elif name == "crd":
            p.add_argument("files", type=Path, nargs="+")
        else:
            p.add_argument("index", type=Path)
            p.add_argument("--repo", required=True, help="repository URL the index belongs to")
            p.add_argument("--chart", action="append", required=True)
    args = parser.parse_args(argv)
    try:
        if args.what == "chart":
            for path in write_chart_snapshots(args.dir, args.out, _source(args)):
                print(path)
        elif args.what == "crd":
            for file in args.files:
                for snap in crd_snapshots(file.read_text(), _source(args), str(file)):
                    print(write_json(snap, args.out / crd_snapshot_name(snap)))
        else:
            existing = json.loads(args.out.read_text()) if args.out.is_file() else None
            versions = index_versions(args.index.read_text(), args.chart, str(args.index))
            print(write_json(merge_index(existing, args.repo, versions, _source(args)), args.out))
    except (SnapshotError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

