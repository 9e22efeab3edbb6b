"""Offline policy check: run every rule over plans written by `python -m infra.plan`.

Usage:
    python -m infra.plan --stack aws-dev --out build/plan --quiet
    python -m policies.check build/plan/aws-dev.json [more.json ...] [--config FILE] [--quiet]

Prints each violation as `ERROR` (mandatory) or `WARNING` (advisory) with the rule id, the resource's
type, name and URN, what is wrong and how to fix it. Exits 1 when any mandatory rule is violated,
2 on unreadable input (a plan or config file that is missing or malformed), 0 otherwise.

`--config` takes the same JSON as `pulumi preview --policy-pack-config`: keys are policy names (or
"all"), values are an enforcement level or an object with `enforcementLevel` and the policy's
properties. Without it, `policies/policy-config.json` is used, the file CI passes to Pulumi.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.core import CONFIG_SCHEMA, LEVELS, Context, PolicyConfigError, Resource, Rule, Violation
from policies.registry import RULES, rule

DEFAULT_CONFIG = Path(__file__).resolve().parent / "policy-config.json"


class PlanError(ValueError):
    """A plan or config file that cannot be checked; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    """Per-policy enforcement levels and properties, as Pulumi's policy-pack config holds them."""

    levels: dict[str, str]  # rule id -> mandatory | advisory | disabled
    properties: dict[str, dict[str, Any]]  # rule id -> config properties

    def level(self, r: Rule) -> str:
        return self.levels.get(r.id, r.level)

    def context(self, r: Rule, stack: str) -> Context:
        return Context.from_config(self.properties.get(r.id), stack)


def parse_config(doc: Any, source: str = "policy config") -> PackConfig:
    """Validate a policy-pack config document; every problem names its key."""
    if not isinstance(doc, dict):
        raise PlanError(f"{source}: must be a JSON object keyed by policy name")
    levels: dict[str, str] = {}
    properties: dict[str, dict[str, Any]] = {}
    all_level = doc.get("all")
    if isinstance(all_level, dict):
        all_level = all_level.get("enforcementLevel")
    if all_level is not None:
        if all_level not in LEVELS:
            raise PlanError(f"{source}: all must be one of {LEVELS} (got {all_level!r})")
        levels = {r.id: all_level for r in RULES}
    for key, value in doc.items():
        if key == "all":
            continue
        try:
            r = rule(key)
        except KeyError as exc:
            raise PlanError(f"{source}: {exc.args[0]}") from None
        if isinstance(value, str):
            value = {"enforcementLevel": value}
        if not isinstance(value, dict):
            raise PlanError(f"{source}: {key} must be a level or an object (got {value!r})")
        level = value.get("enforcementLevel")
        if level is not None:
            if level not in LEVELS:
                raise PlanError(f"{source}: {key}.enforcementLevel must be one of {LEVELS} (got {level!r})")
            levels[key] = level
        props = {k: v for k, v in value.items() if k != "enforcementLevel"}
        unknown = sorted(set(props) - set(r.config_keys))
        if unknown:
            raise PlanError(f"{source}: {key}.{unknown[0]} is not a property of {key} "
                            f"(it takes: {', '.join(r.config_keys) or 'none'}; all: {', '.join(CONFIG_SCHEMA)})")
        try:
            Context.from_config(props, "")
        except PolicyConfigError as exc:
            raise PlanError(f"{source}: {key}: {exc}") from None
        properties[key] = props
    return PackConfig(levels=levels, properties=properties)


def _read_json(path: Path, what: str) -> Any:
    """The JSON document in `path`; PlanError naming the file when it is missing or not JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path}: no such {what} file") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not valid JSON: {exc}") from None


def load_config(path: Path | None) -> PackConfig:
    if path is None:
        if not DEFAULT_CONFIG.exists():
            return PackConfig(levels={}, properties={})
        path = DEFAULT_CONFIG
    return parse_config(_read_json(path, "policy config"), str(path))


def resources_of_plan(plan: Any, source: str = "plan") -> list[Resource]:
    """The plan's resources as rules see them (inputs as props)."""
    if not isinstance(plan, dict) or not isinstance(plan.get("resources"), list):
        raise PlanError(f"{source}: not a plan from `python -m infra.plan` (no 'resources' list)")
    out = []
    for i, raw in enumerate(plan["resources"]):
        missing = [k for k in ("urn", "type", "name") if not isinstance(raw, dict) or not raw.get(k)]
        if missing:
            raise PlanError(f"{source}: resources[{i}] lacks {', '.join(missing)}")
        out.append(Resource(type=raw["type"], name=raw["name"], urn=raw["urn"], props=raw.get("inputs") or {},
                            parent=raw.get("parent"),
                            # infra.mocks.PlanMocks gives every resource the id "<name>-id"; inputs that
                            # take another resource's id (a bucket policy's bucket) carry that value.
                            id=f"{raw['name']}-id"))
    return out


@dataclass(frozen=True, kw_only=True)
class Finding:
    level: str  # mandatory | advisory (effective, after the config)
    violation: Violation


def check_resources(resources: list[Resource], stack: str, config: PackConfig) -> list[Finding]:
    """Every violation of every enabled rule."""
    findings = []
    for r in RULES:
        level = config.level(r)
        if level == "disabled":
            continue
        findings += [Finding(level=level, violation=v) for v in r.run(resources, config.context(r, stack))]
    return findings


def check_plan(plan: dict[str, Any], config: PackConfig, source: str = "plan") -> list[Finding]:
    stack = plan.get("stack")
    if not isinstance(stack, str) or not stack:
        raise PlanError(f"{source}: the plan has no 'stack' name")
    return check_resources(resources_of_plan(plan, source), stack, config)


def format_finding(f: Finding) -> str:
    tag = "ERROR  " if f.level == "mandatory" else "WARNING"
    return f"{tag} {f.violation.message()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policies.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", nargs="+", type=Path, help="plan JSON files from python -m infra.plan")
    parser.add_argument("--config", type=Path, help="policy-pack config JSON (default: policies/policy-config.json)")
    parser.add_argument("--quiet", action="store_true", help="print violations only, no per-plan summary")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        mandatory = 0
        for path in args.plans:
            plan = _read_json(path, "plan")
            findings = check_plan(plan, config, str(path))
            for f in findings:
                print(format_finding(f))
            errors = sum(f.level == "mandatory" for f in findings)
            mandatory += errors
            if not args.quiet:
                print(f"{plan['stack']}: {len(plan['resources'])} resources, {len(RULES)} rules, "
                      f"{errors} mandatory and {len(findings) - errors} advisory violation(s) ({path})")
    except (PlanError, PolicyConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if mandatory else 0


if __name__ == "__main__":
    sys.exit(main())
