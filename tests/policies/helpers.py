"""Shared helpers for policy tests: real plan resources as rules see them, and rule runners.

Usage: `res = first(plans, "aws-dev", "aws:kms/key:Key")`; `ids = violated(rule_id, [res], ctx)`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from policies.check import resources_of_plan
from policies.core import Context, Resource
from policies.registry import rule


def stack_resources(plans: dict, stack: str) -> list[Resource]:
    return resources_of_plan(copy.deepcopy(plans[stack]), stack)


def first(plans: dict, stack: str, type_token: str, where: Callable[[Resource], bool] = lambda r: True) -> Resource:
    """A deep copy of the first resource of a type in a real plan (fails loudly when absent)."""
    found = [r for r in stack_resources(plans, stack) if r.type == type_token and where(r)]
    assert found, f"{stack} plan has no {type_token} matching the test's filter"
    return found[0]


def broken(res: Resource, mutate: Callable[[dict], None]) -> Resource:
    """A copy of the resource with one field broken by `mutate(props)`."""
    props = copy.deepcopy(dict(res.props))
    mutate(props)
    return Resource(type=res.type, name=res.name, urn=res.urn, props=props, parent=res.parent, id=res.id)


def details(rule_id: str, resources: list[Resource], ctx: Context) -> list[str]:
    """The violation details one rule reports."""
    return [v.detail for v in rule(rule_id).run(resources, ctx)]


def replaced(resources: list[Resource], old: Resource, new: Resource) -> list[Resource]:
    return [new if r.urn == old.urn else r for r in resources]
