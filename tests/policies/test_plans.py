"""Every stack's real offline plan passes every mandatory rule (the same check `make test` runs).

Usage: `.venv/bin/pytest tests/policies/test_plans.py -q` (plans every stack once per session).
"""

from __future__ import annotations

import pytest

from policies.check import check_plan, format_finding, load_config, main
from policies.registry import RULES
from tests.conftest import STACKS


@pytest.mark.parametrize("stack", STACKS)
def test_no_mandatory_violation_in_real_plan(plans, stack):
    findings = check_plan(plans[stack], load_config(None), stack)
    errors = [format_finding(f) for f in findings if f.level == "mandatory"]
    assert not errors, "\n".join(errors)


def test_checker_cli_passes_over_every_plan(plan_dir, capsys):
    code = main([str(plan_dir / f"{s}.json") for s in STACKS])
    out = capsys.readouterr().out
    assert code == 0, out
    for stack in STACKS:
        assert f"{stack}: " in out and f"{len(RULES)} rules" in out
