"""Every stack's real offline plan, and every fabric variant, passes every mandatory rule (the same
check `make test` runs).

Usage: `.venv/bin/pytest tests/policies/test_plans.py -q` (plans every stack and variant once per session).
"""

from __future__ import annotations

import pytest

from policies.check import check_plan, format_finding, load_config, main
from policies.core import Context
from policies.registry import RULES
from tests.conftest import STACKS, VARIANTS


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


@pytest.mark.parametrize("stack", sorted(VARIANTS))
def test_no_mandatory_violation_in_fabric_variants(all_plans, stack):
    """The prod stacks on every other fabric machine type (TCPX, RDMA, EFA generations) pass too; the
    variant's name still names its environment, so prod-only allowances apply as for the base stack."""
    assert Context.environment_of(stack) == "prod"
    findings = check_plan(all_plans[stack], load_config(None), stack)
    errors = [format_finding(f) for f in findings if f.level == "mandatory"]
    assert not errors, "\n".join(errors)
