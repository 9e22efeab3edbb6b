"""Adapter from the plain rules to CrossGuard policies (no server is started here).

Usage:
    from policies.crossguard import build_policies
    policies = build_policies()          # one ResourceValidationPolicy / StackValidationPolicy per rule
    policies[0].validate(args, report)   # what `pulumi preview --policy-pack policies` calls

Each policy's validate builds `policies.core.Resource`s from the engine's args and runs the rule's one
function, so CrossGuard and `python -m policies.check` share every line of rule logic. Under
`pulumi preview` the stack name comes from the engine's PULUMI_STACK environment variable.
"""

from __future__ import annotations

import os
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from policies.core import CONFIG_SCHEMA, Context, Resource, Rule
from policies.registry import RULES

LEVELS = {"mandatory": EnforcementLevel.MANDATORY, "advisory": EnforcementLevel.ADVISORY}


def current_stack() -> str:
    """The stack under analysis: the engine sets PULUMI_STACK for policy packs."""
    stack = os.environ.get("PULUMI_STACK", "")
    if stack:
        return stack
    try:
        import pulumi

        return pulumi.get_stack()
    except Exception:  # noqa: BLE001 - outside an engine there is no stack; the context copes with ""
        return ""


def _parent(opts: Any) -> str | None:
    return getattr(opts, "parent", None) or None


def resource_validator(rule: Rule):
    """validate(args, report_violation) for a resource-scoped rule."""

    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        res = Resource(type=args.resource_type, name=args.name, urn=args.urn, props=args.props,
                       parent=_parent(args.opts))
        for violation in rule.run([res], Context.from_config(args.get_config(), current_stack())):
            report_violation(violation.message(), res.urn)

    return validate


def stack_validator(rule: Rule):
    """validate(args, report_violation) for a stack-scoped rule over every resource's outputs."""

    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        resources = [Resource(type=r.resource_type, name=r.name, urn=r.urn, props=r.props,
                              parent=r.parent.urn if r.parent is not None else _parent(r.opts))
                     for r in args.resources]
        for violation in rule.run(resources, Context.from_config(args.get_config(), current_stack())):
            report_violation(violation.message(), violation.resource.urn if violation.resource else None)

    return validate


def to_policy(rule: Rule) -> ResourceValidationPolicy | StackValidationPolicy:
    schema = (PolicyConfigSchema(properties={k: CONFIG_SCHEMA[k] for k in rule.config_keys})
              if rule.config_keys else None)
    common: dict[str, Any] = dict(name=rule.id, description=rule.description,
                                  enforcement_level=LEVELS[rule.level], config_schema=schema,
                                  remediation_steps=rule.remediation)
    if rule.scope == "resource":
        return ResourceValidationPolicy(validate=resource_validator(rule), **common)
    return StackValidationPolicy(validate=stack_validator(rule), **common)


def build_policies() -> list[ResourceValidationPolicy | StackValidationPolicy]:
    return [to_policy(rule) for rule in RULES]
