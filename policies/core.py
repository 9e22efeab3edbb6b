"""The rule model shared by the CrossGuard pack and the offline checker.

Usage:
    from policies.core import Context, Resource, Rule
    res = Resource(type="aws:kms/key:Key", name="keys", urn="urn:...", props={"enableKeyRotation": True})
    violations = list(rule.run([res], Context(stack="aws-dev")))

A rule is one plain function plus metadata (id, level, remediation). Resource-scoped functions take
`(res, ctx)` and yield a detail string per problem; stack-scoped functions take `(resources, ctx)` and
yield `(resource or None, detail)`. The same function runs inside `pulumi preview --policy-pack`
(see `policies/crossguard.py`) and over the JSON plans that `python -m infra.plan` writes (see
`policies/check.py`), so the two can never disagree.

Props are the engine's camelCase names. Under CrossGuard they are read-only mapping/sequence
proxies, so helpers here test for `Mapping`/`Sequence`, never `dict`/`list`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpu_train.spec import naming, placement

Level = Literal["mandatory", "advisory"]
Scope = Literal["resource", "stack"]
LEVELS: tuple[str, ...] = ("mandatory", "advisory", "disabled")

# Regions the platform is allowed to run in unless the policy config says otherwise; the plan's settings checks
# hold a stack's region to the same list (gpu_train/spec/placement.py).
DEFAULT_ALLOWED_REGIONS: tuple[str, ...] = placement.ALLOWED_REGIONS
DEFAULT_MAX_GPUS = 64
ENVIRONMENTS = ("dev", "staging", "prod")

# JSON schema of every policy-config property; each rule lists the ones it reads.
CONFIG_SCHEMA: dict[str, dict[str, Any]] = {
    "allowedRegions": {
        "type": "array", "items": {"type": "string"}, "default": list(DEFAULT_ALLOWED_REGIONS),
        "description": "Cloud regions resources may live in (zones of these regions are allowed too).",
    },
    "maxGpus": {
        "type": "integer", "minimum": 0, "default": DEFAULT_MAX_GPUS,
        "description": "Cap on the GPUs all pools of one stack can scale to (max nodes x GPUs per node).",
    },
    "maxGpusByStack": {
        "type": "object", "additionalProperties": {"type": "integer", "minimum": 0}, "default": {},
        "description": "Per-stack override of maxGpus, keyed by stack name.",
    },
    "requiredTags": {
        "type": "array", "items": {"type": "string"}, "default": list(naming.REQUIRED_TAGS),
        "description": "Tag (AWS) / label (GCP) keys every taggable resource must carry.",
    },
    "environment": {
        "type": "string", "enum": list(ENVIRONMENTS),
        "description": "The stack's environment; by default the stack name's suffix (aws-dev -> dev).",
    },
}


class PolicyConfigError(ValueError):
    """A policy-config value has the wrong type; the message names the key."""


@dataclass(frozen=True, kw_only=True)
class Context:
    """What a rule may know about the stack besides its resources."""

    stack: str = ""  # Pulumi stack name, e.g. "aws-dev"
    environment: str = ""  # dev | staging | prod; "" when it cannot be told (treated as non-prod)
    allowed_regions: tuple[str, ...] = DEFAULT_ALLOWED_REGIONS  # allowed regions (zones follow)
    max_gpus: int = DEFAULT_MAX_GPUS  # cap on the stack's total schedulable GPUs
    required_tags: tuple[str, ...] = naming.REQUIRED_TAGS  # keys every taggable resource carries

    @property
    def is_prod(self) -> bool:
        return self.environment == "prod"

    @staticmethod
    def environment_of(stack: str) -> str:
        """The environment a stack name names: its last dash-separated word that is one
        (`gcp-prod` -> `prod`, `gcp-prod-a3ultra` -> `prod`), or "" if none."""
        for word in reversed(stack.lower().split("-") if stack else []):
            word = "prod" if word == "production" else word
            if word in ENVIRONMENTS:
                return word
        return ""

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None, stack: str) -> Context:
        """Build the context from one policy's config (camelCase keys, as in CONFIG_SCHEMA)."""
        config = dict(config or {})
        env = config.get("environment") or cls.environment_of(stack)
        if env not in (*ENVIRONMENTS, ""):
            raise PolicyConfigError(f"policy config environment must be one of {ENVIRONMENTS} (got {env!r})")
        regions = _str_list(config, "allowedRegions", DEFAULT_ALLOWED_REGIONS)
        tags = _str_list(config, "requiredTags", naming.REQUIRED_TAGS)
        max_gpus = _int(config.get("maxGpus", DEFAULT_MAX_GPUS), "maxGpus")
        by_stack = config.get("maxGpusByStack") or {}
        if not isinstance(by_stack, Mapping):
            raise PolicyConfigError(f"policy config maxGpusByStack must be a mapping (got {by_stack!r})")
        if stack in by_stack:
            max_gpus = _int(by_stack[stack], f"maxGpusByStack.{stack}")
        return cls(stack=stack, environment=env, allowed_regions=tuple(r.lower() for r in regions),
                   max_gpus=max_gpus, required_tags=tags)


def _str_list(config: Mapping[str, Any], key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = config.get(key)
    if value is None:
        return tuple(default)
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise PolicyConfigError(f"policy config {key} must be a list of strings (got {value!r})")
    return tuple(value)


def _int(value: Any, key: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON numbers arrive as floats through the engine
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PolicyConfigError(f"policy config {key} must be a whole number >= 0 (got {value!r})")
    return value


@dataclass(frozen=True, kw_only=True)
class Resource:
    """One resource as a rule sees it: type token, logical name, URN and camelCase props."""

    type: str
    name: str
    urn: str
    props: Mapping[str, Any] = field(default_factory=dict)
    parent: str | None = None  # parent URN
    id: str = ""  # provider id when known (the offline plan reproduces the mocks' id)

    def get(self, *path: str | int, default: Any = None) -> Any:
        return dig(self.props, *path, default=default)

    def identifiers(self) -> set[str]:
        """Every string another resource's input may use to refer to this one."""
        ids = {self.name, self.urn}
        if self.id:
            ids.add(self.id)
        for key in ("id", "arn", "name", "bucket", "url", "selfLink"):
            value = self.props.get(key)
            if isinstance(value, str) and value:
                ids.add(value)
        return ids

    def referred_by(self, value: Any) -> bool:
        """Whether an input value (a name, id, ARN or self link) points at this resource."""
        if not isinstance(value, str) or not value:
            return False
        ids = self.identifiers()
        if value in ids:
            return True
        if value.startswith(("arn:", "https://", "projects/")):
            value = re.split(r"[:/]", value)[-1]
            if value in ids:
                return True
        # Pulumi auto-names a physical resource "<logical name>-<7 hex>" when no name is given.
        return re.fullmatch(re.escape(self.name) + r"-[0-9a-f]{7}", value) is not None


ResourceCheck = Callable[[Resource, Context], Iterable[str]]
StackCheck = Callable[[Sequence[Resource], Context], Iterable[tuple[Resource | None, str]]]


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A policy: metadata plus the one function that implements it."""

    id: str  # kebab-case policy name, unique in the pack
    level: Level  # default enforcement level
    description: str  # what the rule requires (one sentence)
    remediation: str  # how to fix a violation
    scope: Scope  # "resource": check(res, ctx); "stack": check(resources, ctx)
    check: ResourceCheck | StackCheck
    config_keys: tuple[str, ...] = ()  # CONFIG_SCHEMA properties the rule reads
    # Items of established rule sets the rule corresponds to ("CIS EKS 1.7.0 5.4.1", "PSS restricted:
    # Seccomp", "checkov CKV_AWS_38"); () for the platform's own rules (cost, tags, placement).
    benchmarks: tuple[str, ...] = ()
    exemptions: str = "none"  # what the rule exempts, and where the exemption is defined

    def run(self, resources: Sequence[Resource], ctx: Context) -> Iterator[Violation]:
        """Every violation of this rule over a set of resources."""
        if self.scope == "resource":
            for res in resources:
                for detail in self.check(res, ctx):  # type: ignore[call-arg]
                    yield Violation(rule=self, resource=res, detail=detail, stack=ctx.stack)
        else:
            for res, detail in self.check(resources, ctx):  # type: ignore[call-arg]
                yield Violation(rule=self, resource=res, detail=detail, stack=ctx.stack)


@dataclass(frozen=True, kw_only=True)
class Violation:
    rule: Rule
    resource: Resource | None  # None: the stack as a whole
    detail: str
    stack: str = ""

    @property
    def subject(self) -> str:
        if self.resource is None:
            return f"stack {self.stack or '(unknown)'}"
        return f"{self.resource.type} '{self.resource.name}' ({self.resource.urn})"

    def message(self) -> str:
        """The one-line message both CrossGuard and the offline checker print."""
        return f"[{self.rule.id}] {self.subject}: {self.detail} Remediation: {self.rule.remediation}"


# --------------------------------------------------------------------------------------------
# Helpers for reading props (plain dicts offline, read-only proxies under CrossGuard)
# --------------------------------------------------------------------------------------------


def dig(value: Any, *path: str | int, default: Any = None) -> Any:
    """Follow keys / indexes through nested props; `default` when any step is missing."""
    for step in path:
        if isinstance(step, int):
            if not is_list(value) or not -len(value) <= step < len(value):
                return default
            value = value[step]
        else:
            if not isinstance(value, Mapping) or step not in value:
                return default
            value = value[step]
        if value is None:
            return default
    return value


def is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def items(value: Any) -> list[Any]:
    """A list of the elements of a sequence prop (a missing prop is an empty list)."""
    return list(value) if is_list(value) else []


def truthy(value: Any) -> bool:
    """Booleans as providers accept them: True or the strings "true" (launch templates use strings)."""
    return value is True or (isinstance(value, str) and value.lower() == "true")


def falsy(value: Any) -> bool:
    """Explicitly false (missing is neither truthy nor falsy)."""
    return value is False or (isinstance(value, str) and value.lower() == "false")


def json_value(value: Any) -> Any:
    """A prop that may hold a JSON document as a string (IAM policies, event patterns)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return None
    return value


def as_int(value: Any) -> int | None:
    """A whole number from an int, a whole float or a numeric string; None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None
