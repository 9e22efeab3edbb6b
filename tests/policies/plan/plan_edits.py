"""Broken copies of a planned AWS stack for the IAM and KMS checks' tests.

Usage:
    res = resource(plan, "aws:kms/key:Key", "keys-ebs")
    bad = edit_policy(plan, "aws:kms/key:Key", "keys-ebs", lambda doc: doc["Statement"].pop())  # plan untouched
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable


def resource(plan: dict, typ: str, name: str) -> dict:
    """The planned resource of this type and logical name."""
    return next(r for r in plan["resources"] if r["type"] == typ and r["name"] == name)


def edit_policy(plan: dict, typ: str, name: str, edit: Callable[[dict], None], field: str = "policy") -> dict:
    """A deep copy of the plan whose resource's JSON policy input `field` went through `edit`."""
    broken = copy.deepcopy(plan)
    res = resource(broken, typ, name)
    doc = json.loads(res["inputs"][field])
    edit(doc)
    res["inputs"][field] = json.dumps(doc)
    return broken
