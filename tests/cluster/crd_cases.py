"""The custom resources of a plan and, for each, variants that each break one rule of its CRD's structural schema,
derived from the schema node by node (tests/cluster/test_crd_differential.py holds them to the real API server).

Usage:
    for case in cases("aws-dev", crd.custom_resources(plan), seen=set()): case.id, case.obj, case.mutation

For every value present in an object, with the schema node that describes it:
- a value of another type; an enum's value outside the enum; one past each bound (minimum, maximum, minLength,
  maxLength, minItems, maxItems, minProperties, maxProperties); a string a `pattern` does not match; a string no
  `format` accepts; each `required` property dropped (apiVersion and kind of an embedded resource too); a field the
  schema does not declare; a repeated item of an `x-kubernetes-list-type: set|map` list;
- for each `x-kubernetes-validations` rule, the first of a fixed list of edits of the value (drop a property that
  is not required, add an absent one the rule names, set a string or a map key to a string the rule names or to
  "", lengthen a string past a number the rule names, flip a boolean, zero a number, empty or repeat a list) after
  which cel-python finds the rule false and nothing else wrong; where none does, or the rule uses Kubernetes' own
  CEL functions, the edit of RULE_EDITS; transition rules (oldSelf) run on update
  only and have no variant on create.
Variants that repeat one already made for the same kind at the same place (list indices aside) are left out.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tools.validation import crd

Path = tuple[str | int, ...]
DROP = object()  # the value that removes a property
ROOT_OWN = ("apiVersion", "kind", "metadata")  # the API server's own fields of every object, not the CRD's
MAX_BOUND = 4096  # bounds above this are not exceeded (a list or string that long says nothing more)
# Strings no pattern of the snapshots accepts in full, tried in order.
NOT_MATCHING = ("", "-", "%", "a b", "UPPER_case.", "0")


@dataclass(frozen=True)
class Case:
    id: str  # "<stack> <Kind>/<name>" and, for a variant, ": <path>: <mutation>"
    obj: dict[str, Any]
    mutation: str  # "" for the plan's own object


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<object>"


def edited(obj: Any, path: Path, value: Any) -> Any:
    """A copy of `obj` with the value at `path` replaced (removed when `value` is DROP)."""
    if not path:
        return copy.deepcopy(value)
    out = copy.deepcopy(obj)
    parent: Any = out
    for part in path[:-1]:
        parent = parent[part]
    if value is DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(value)
    return out


def walk(value: Any, schema: Mapping[str, Any], path: Path = (),
         skip: tuple[str, ...] = ROOT_OWN) -> Iterator[tuple[Any, Mapping[str, Any], Path]]:
    """Every (value, schema node, path) of a value, parents first; the root's `skip` fields left out."""
    yield value, schema, path
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for name, sub in value.items():
            if not path and name in skip:
                continue
            child = props.get(name) or (extra if isinstance(extra, dict) else None)
            if child is not None:
                yield from walk(sub, child, (*path, name), skip)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from walk(item, schema["items"], (*path, i), skip)


# ------------------------------------------------------------------------------------ schema keywords


def _other_type(schema: Mapping[str, Any]) -> Any:
    """A value of a type the node does not allow, or DROP where the node allows any."""
    if schema.get("x-kubernetes-int-or-string"):
        return True
    return {"string": 12345, "integer": "1", "number": "1.5", "boolean": "true", "object": "x",
            "array": "x"}.get(schema.get("type", ""), DROP)


def _outside(enum: list[Any]) -> Any:
    numbers = [v for v in enum if isinstance(v, int | float) and not isinstance(v, bool)]
    return max(numbers) + 1 if numbers and len(numbers) == len(enum) else "not-in-the-enum"


def _not_matching(pattern: str) -> str | None:
    try:
        return next((s for s in NOT_MATCHING if re.search(pattern, s) is None), None)
    except re.error:  # a pattern only Go's RE2 reads
        return None


def _past_bounds(value: Any, s: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    step = 1 if s.get("type") == "integer" else 0.5
    if "minimum" in s:
        yield f"below minimum {s['minimum']}", s["minimum"] if s.get("exclusiveMinimum") else s["minimum"] - step
    if "maximum" in s:
        yield f"above maximum {s['maximum']}", s["maximum"] if s.get("exclusiveMaximum") else s["maximum"] + step
    if isinstance(value, str):
        if s.get("minLength", 0) > 0:
            yield f"shorter than minLength {s['minLength']}", "a" * (s["minLength"] - 1)
        if s.get("maxLength", MAX_BOUND) < MAX_BOUND:
            yield f"longer than maxLength {s['maxLength']}", "a" * (s["maxLength"] + 1)
    if isinstance(value, list) and value:
        if s.get("minItems", 0) > 0:
            yield f"fewer than minItems {s['minItems']}", value[:s["minItems"] - 1]
        if s.get("maxItems", MAX_BOUND) < MAX_BOUND:
            yield f"more than maxItems {s['maxItems']}", value + [value[-1]] * (s["maxItems"] + 1 - len(value))
    if isinstance(value, dict) and value:
        if s.get("minProperties", 0) > 0:
            yield f"fewer than minProperties {s['minProperties']}", dict(list(value.items())[:s["minProperties"] - 1])
        if s.get("maxProperties", MAX_BOUND) < MAX_BOUND:
            extra = {f"extra-{i}": next(iter(value.values())) for i in range(s["maxProperties"] + 1)}
            yield f"more than maxProperties {s['maxProperties']}", {**value, **extra}


def keyword_variants(value: Any, s: Mapping[str, Any], path: Path) -> Iterator[tuple[str, Path, Any]]:
    """(what, path, new value) for each schema keyword of one node that a value present there can break."""
    if path and (other := _other_type(s)) is not DROP:
        yield f"wrong type ({type(other).__name__} for {s.get('type', 'int-or-string')})", path, other
    if "enum" in s:
        yield "not in the enum", path, _outside(s["enum"])
    for what, new in _past_bounds(value, s):
        yield what, path, new
    if isinstance(value, str) and "pattern" in s and (bad := _not_matching(s["pattern"])) is not None:
        yield f"not matching pattern {s['pattern']!r}", path, bad
    if isinstance(value, str) and s.get("format") not in (None, "int32", "int64"):
        yield f"not a {s['format']}", path, f"%not a {s['format']}%"
    if isinstance(value, dict):
        required = [*s.get("required", []), *(("apiVersion", "kind") if s.get("x-kubernetes-embedded-resource")
                                               else ())]
        for name in required:
            if name in value and (path or name not in ROOT_OWN):
                yield f"required {name!r} dropped", (*path, name), DROP
        if s.get("properties") and not s.get("x-kubernetes-preserve-unknown-fields"):
            yield "unknown field", (*path, "unknownField"), "x"
    if isinstance(value, list) and value and s.get("x-kubernetes-list-type") in ("set", "map"):
        yield f"a repeated item of a list-type {s['x-kubernetes-list-type']}", path, [*value, value[0]]


# ------------------------------------------------------------------------------------------ CEL rules

_AMI_ALIAS = re.compile(r"x\.alias\.find\('\^\[\^@\]\+'\) == '(\w+)'\) \? \(self\.amiFamily == 'Custom' \|\| "
                        r"self\.amiFamily == '(\w+)'\)")


def _ami_alias_edit(rule: str, value: dict) -> list[tuple[Path, Any]]:
    # EC2NodeClass spec: "!has(self.amiFamily) || (self.amiSelectorTerms.exists(x, has(x.alias) &&
    # x.alias.find('^[^@]+') == '<alias>') ? (self.amiFamily == 'Custom' || self.amiFamily == '<Family>') : true)":
    # that alias selected with another family named.
    alias, family = _AMI_ALIAS.search(rule).groups()
    return [(("amiSelectorTerms",), [{"alias": f"{alias}@latest"}]),
            (("amiFamily",), "AL2" if family != "AL2" else "AL2023")]


# Edits of the value a rule sits on (paths relative to it), for rules no edit of the fixed list breaks (it makes
# one change; cel-python cannot evaluate Kubernetes' own CEL functions): each names its rule.
RULE_EDITS: dict[str, Callable[[str, Any], list[tuple[Path, Any]]]] = {
    # NodePool spec.template.spec.requirements[].key: 'self in ["karpenter.sh/capacity-type",
    # "karpenter.sh/nodepool"] || !self.find("^([^/]+)").endsWith("karpenter.sh")': another key of that domain.
    'self in ["karpenter.sh/capacity-type", "karpenter.sh/nodepool"] || !self.find("^([^/]+)")':
        lambda rule, v: [((), "x.karpenter.sh/other")],
    # The same for karpenter.k8s.aws's own keys.
    'self in ["karpenter.k8s.aws/instance-tenancy"': lambda rule, v: [((), "x.karpenter.k8s.aws/other")],
    # NodePool spec.template.metadata.labels: the same two rules over the label keys.
    'self.all(x, x in ["karpenter.sh/capacity-type", "karpenter.sh/nodepool"] || !x.find(':
        lambda rule, v: [(("x.karpenter.sh/other",), "v")],
    'self.all(x, x in ["karpenter.k8s.aws/instance-tenancy"': lambda rule, v: [(("x.karpenter.k8s.aws/other",), "v")],
    # NodeReadinessRule spec.taint: "size(self.key.split('/')) == 2": a key with two slashes.
    "size(self.key.split('/')) == 2": lambda rule, v: [(("key",), "readiness.k8s.io/a/b")],
    # "size(self.key.split('/')[1]) > 0 && size(self.key.split('/')[1]) <= 63": nothing after the slash.
    "size(self.key.split('/')[1]) > 0": lambda rule, v: [(("key",), "readiness.k8s.io/")],
    # "self.key.split('/')[1].matches('^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')": a name starting with a dash.
    "self.key.split('/')[1].matches(": lambda rule, v: [(("key",), "readiness.k8s.io/-a")],
    # EC2NodeClass spec: the six rules of an alias and its family (_ami_alias_edit).
    "!has(self.amiFamily) || (self.amiSelectorTerms.exists(x, has(x.alias) && x.alias.find(": _ami_alias_edit,
    # The rules below need two edits at once.
    # EC2NodeClass spec.amiSelectorTerms: '!(self.exists(x, has(x.alias)) && self.size() != 1)': an alias beside
    # the terms there are.
    "!(self.exists(x, has(x.alias)) && self.size() != 1)": lambda rule, v: [((), [*v, {"alias": "al2023@latest"}])],
    # EC2NodeClass spec.blockDeviceMappings: 'self.filter(x, has(x.rootVolume)?x.rootVolume==true:false).size()
    # <= 1': two root volumes.
    "self.filter(x, has(x.rootVolume)?x.rootVolume==true:false).size() <= 1": lambda rule, v: [
        ((), [{**v[0], "rootVolume": True}, {**v[0], "deviceName": "/dev/xvdz", "rootVolume": True}])],
    # EC2NodeClass spec.networkInterfaces: "self.size() == 0 || self.exists(x, x.deviceIndex == 0 &&
    # x.networkCardIndex == 0 && x.interfaceType == 'interface')": the primary interface made EFA-only.
    "self.size() == 0 || self.exists(x, x.deviceIndex == 0 && x.networkCardIndex == 0": lambda rule, v: [
        ((i, "interfaceType"), "efa-only") for i, x in enumerate(v) if x.get("interfaceType") == "interface"],
    # NodePool spec.template.spec.requirements: "self.all(x, (x.operator == 'In' && has(x.minValues)) ?
    # x.values.size() >= x.minValues : true)": an In requirement asking for more values than it lists.
    "self.all(x, (x.operator == 'In' && has(x.minValues))": lambda rule, v: [
        ((0, "operator"), "In"), ((0, "minValues"), len(v[0].get("values") or []) + 1)],
    # Cluster spec: '!(has(self.imageCatalogRef) && has(self.imageName))': both.
    "!(has(self.imageCatalogRef) && has(self.imageName))": lambda rule, v: [
        (("imageName",), "ghcr.io/cloudnative-pg/postgresql:16"),
        (("imageCatalogRef",), {"apiGroup": "postgresql.cnpg.io", "kind": "ImageCatalog", "name": "c", "major": 16})],
    # ClusterQueue spec.preemption: "!(self.reclaimWithinCohort == 'Never' && has(self.borrowWithinCohort) &&
    # self.borrowWithinCohort.policy != 'Never')": borrowing preemption without reclaiming.
    "!(self.reclaimWithinCohort == 'Never' && has(self.borrowWithinCohort)": lambda rule, v: [
        (("reclaimWithinCohort",), "Never"), (("borrowWithinCohort",), {"policy": "LowerPriority"})],
    # JobSet spec: "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' &&
    # self.replicatedJobs.exists(x, has(x.dependsOn)))": an in-order start-up with a dependency.
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder'": lambda rule, v: [
        (("startupPolicy",), {"startupPolicyOrder": "InOrder"}),
        (("replicatedJobs", 0, "dependsOn"), [{"name": "x", "status": "Ready"}])],
    # ResourceFlavor spec: '!has(self.topologyName) || self.nodeLabels.size() >= 1': a topology, no node labels.
    "!has(self.topologyName) || self.nodeLabels.size() >= 1": lambda rule, v: [
        (("topologyName",), "x"), (("nodeLabels",), {})],
}


def _literals(rule: str) -> list[str]:
    return sorted({a or b for a, b in re.findall(r"'([^'\\]*)'|\"([^\"\\]*)\"", rule)} | {""})


def _samples(s: Mapping[str, Any], rule: str) -> list[Any]:
    """Values of a schema node's type to add where a rule names an absent property: an object or list holds the
    least its schema requires, a number is 1 or one past each number the rule names."""
    if "enum" in s:
        return list(s["enum"])
    numbers = [int(n) + 1 for n in re.findall(r"\b\d+\b", rule)]
    return {"string": ["x", *_literals(rule)], "integer": [1, *numbers], "number": [1, *numbers],
            "boolean": [True, False], "array": [[]],
            "object": [{name: _samples(s["properties"][name], rule)[0] for name in s.get("required", [])}],
            }.get(s.get("type", ""), [])


def _edits(value: Any, schema: Mapping[str, Any], rule: str) -> Iterator[tuple[Path, Any]]:
    """The fixed list of edits of a value a rule sits on (paths relative to it), in order."""
    for node, s, path in walk(value, schema, skip=()):
        if isinstance(node, dict):
            for name in node:
                if name not in s.get("required", []):
                    yield (*path, name), DROP
            for name, sub in (s.get("properties") or {}).items():
                if name not in node and re.search(rf"\b{re.escape(name)}\b", rule):
                    for sample in _samples(sub, rule):
                        yield (*path, name), sample
            if isinstance(s.get("additionalProperties"), dict) and node:
                for literal in _literals(rule):
                    yield (*path, literal), next(iter(node.values()))
        elif isinstance(node, list):
            yield path, []
            if node:
                yield path, [*node, node[0]]
        elif isinstance(node, bool):
            yield path, not node
        elif isinstance(node, int | float):
            yield path, 0
        elif isinstance(node, str):
            for literal in _literals(rule):
                yield path, literal
            for n in re.findall(r"\b\d+\b", rule):
                yield path, "a" * (int(n) + 1)


def _breaks(obj: dict, rule: str, at: str) -> tuple[bool, bool]:
    """(the rule is reported at `at`, nothing else is) for an edited object."""
    problems = crd.validate(obj).problems
    mine = [p for p in problems if p.startswith(at) and f"rule {rule!r}" in p]
    return bool(mine), len(mine) == len(problems)


def rule_edit(obj: dict, value: Any, s: Mapping[str, Any], path: Path, rule: str) -> dict | None:
    """`obj` edited at `path` so that the CEL `rule` sitting there breaks, or None where no edit is derived."""
    table = next((edit for prefix, edit in RULE_EDITS.items() if rule.startswith(prefix)), None)
    if crd.compile_rule(rule)[0] is not None:
        found = None
        for rel, new in _edits(value, s, rule):
            if crd.evaluate_rule(rule, crd.apply_defaults(edited(value, rel, new), s))[0] is not False:
                continue  # the rule still holds: not a candidate
            candidate = edited(obj, (*path, *rel), new)
            broken, alone = _breaks(candidate, rule, _dotted(path))
            if broken and alone:
                return candidate
            found = found or (candidate if broken else None)
        if found is not None:
            return found
    if table is None:
        return None
    out = obj
    for rel, new in table(rule, value):
        out = edited(out, (*path, *rel), new)
    return out


# ------------------------------------------------------------------------------------------------ cases


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj['kind']}/{meta['namespace'] + '/' if meta.get('namespace') else ''}{meta.get('name')}"


def variants(obj: dict) -> Iterator[tuple[str, Callable[[], dict | None]]]:
    """(mutation, a function making the object or None) for every variant of one object (module docstring); the
    object is made only when asked for, since deriving a rule's edit evaluates it many times."""
    schema, why = crd.Snapshots().find(obj["apiVersion"], obj["kind"])
    assert schema is not None, why
    for value, s, path in walk(obj, schema):
        for what, at, new in keyword_variants(value, s, path):
            yield f"{_dotted(at)}: {what}", lambda at=at, new=new: edited(obj, at, new)
        for rule in (r["rule"] for r in s.get("x-kubernetes-validations") or []):
            if not crd.compile_rule(rule)[1].startswith("transition"):
                yield (f"{_dotted(path)}: breaks rule {rule!r}",
                       lambda v=value, s=s, path=path, rule=rule: rule_edit(obj, v, s, path, rule))


_INDEX = re.compile(r"\[\d+\]")


def key(obj: Mapping[str, Any], mutation: str) -> str:
    """What makes a variant the same as another: the kind, and the mutation with list indices left out."""
    return f"{obj['apiVersion']} {obj['kind']} {_INDEX.sub('[]', mutation)}"


def rule_keys(obj: dict) -> set[str]:
    """The key a variant breaking it would have, for every rule at a place present in `obj` that a create runs."""
    schema, _ = crd.Snapshots().find(obj["apiVersion"], obj["kind"])
    return {key(obj, f"{_dotted(path)}: breaks rule {r['rule']!r}") for _, s, path in walk(obj, schema)
            for r in s.get("x-kubernetes-validations") or []
            if not crd.compile_rule(r["rule"])[1].startswith("transition")}


def cases(stack: str, objects: list[dict], seen: set[str]) -> list[Case]:
    """The plan's own objects and their variants not already in `seen` (which this extends)."""
    out = []
    for obj in objects:
        own = json.dumps(obj, sort_keys=True)
        if own in seen:
            continue
        seen.add(own)
        out.append(Case(f"{stack} {_name(obj)}", obj, ""))
        for mutation, make in variants(obj):
            made = key(obj, mutation)
            if made not in seen and (mutated := make()) is not None:
                seen.add(made)
                out.append(Case(f"{stack} {_name(obj)}: {mutation}", mutated, mutation))
    return out
