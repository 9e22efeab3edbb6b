"""The security review as a table: broken copies of the real plans, each caught by `python -m policies.check`.

Usage: `.venv/bin/pytest tests/policies/test_mutations.py -q`. Every entry of
`tests/policies/mutations.py` breaks a deep copy of one real plan; the copies and the unbroken plans
are written as JSON and checked in one run of `python -m policies.check`, exactly as a user runs it.
Each copy must print a line at the rule's level (ERROR for mandatory, WARNING for advisory) that
names the rule and the broken resource, and the same line must be absent from the unbroken plan.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from policies.registry import RULES, rule
from tests.conftest import ROOT
from tests.policies.mutations import MUTATIONS

SUMMARY = re.compile(r"^\S+: \d+ resources, \d+ rules, \d+ mandatory and \d+ advisory violation\(s\) \((?P<path>.+)\)$")
# The classes of the security review (tests/policies/mutations.py `klass`) that the table must cover.
REVIEW_CLASSES = {"public exposure", "the whole internet written another way", "wildcard privilege",
                  "weaker encryption or transport", "lost history and audit", "node credentials within reach",
                  "cluster escalation"}


@pytest.fixture(scope="module")
def checked(plans, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("broken-plans")
    files, expect, errors = [], {}, {}
    for stack in sorted({m.stack for m in MUTATIONS}):
        path = out / f"baseline--{stack}.json"
        path.write_text(json.dumps(plans[stack]))
        files.append(path)
    for m in MUTATIONS:
        plan = copy.deepcopy(plans[m.stack])
        try:
            expect[m.id] = m.mutate(plan)
        except (AssertionError, KeyError, StopIteration, IndexError) as exc:  # the plan lacks what the entry breaks
            errors[m.id] = f"{type(exc).__name__}: {exc}"
            continue
        path = out / f"{m.id}.json"
        path.write_text(json.dumps(plan))
        files.append(path)
    proc = subprocess.run([sys.executable, "-m", "policies.check", *map(str, files)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    blocks: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in proc.stdout.splitlines():
        match = SUMMARY.match(line)
        if match:
            blocks[Path(match["path"]).stem] = lines
            lines = []
        else:
            lines.append(line)
    return {"rc": proc.returncode, "stderr": proc.stderr, "blocks": blocks, "expect": expect, "errors": errors}


@pytest.mark.parametrize("m", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_broken_copy_is_caught_by_the_named_rule(checked, m):
    assert m.id not in checked["errors"], checked["errors"].get(m.id)
    assert m.id in checked["blocks"], checked["stderr"]
    tag = "ERROR" if rule(m.rule).level == "mandatory" else "WARNING"

    def hits(lines):
        return [x for x in lines if x.startswith(tag) and f"[{m.rule}]" in x and checked["expect"][m.id] in x]
    assert hits(checked["blocks"][m.id]), "\n".join(checked["blocks"][m.id]) or "(no findings)"
    assert not hits(checked["blocks"][f"baseline--{m.stack}"]), "the unbroken plan already has this finding"


def test_the_checker_fails_the_run(checked):
    assert checked["rc"] == 1, checked["stderr"]


def test_the_table_covers_every_rule_and_every_class_of_the_review():
    assert len(MUTATIONS) >= 40
    assert len({m.id for m in MUTATIONS}) == len(MUTATIONS)
    assert {m.rule for m in MUTATIONS} == {r.id for r in RULES}
    assert {m.klass for m in MUTATIONS} >= REVIEW_CLASSES
    assert {m.stack for m in MUTATIONS} == {"aws-dev", "aws-prod", "gcp-dev", "gcp-prod"}
