"""Checks over the whole graph of an offline plan, and the command line they share.

Usage:
    python -m policies.plan.aws_iam_lint build/plan/aws-dev.json   # parliament over every IAM document
    python -m policies.plan.aws_kms build/plan/aws-dev.json        # every consumer of every KMS key may use it
    plan = read_plan_document(Path("build/plan/gcp-prod.json"))    # None (after one line on stderr) if unreadable

Each module reads a plan document as `python -m infra.plan` writes it (resources, registrations,
invokes) and imports neither the Pulumi program nor Pulumi:
- `graph`: the resource graph (who waits for whom, what a reference names);
- `aws_iam_lint`: parliament over every IAM document; `aws_kms`: every KMS key's consumers may use it;
- `gcp_kms`: every CMEK field's service agent holds the key; `gcp_gpu`: GPU machines and their fabric
  networks as Google documents them; `gcp_services`: every resource's API is enabled before it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_plan_document(path: Path) -> dict[str, Any] | None:
    """A plan document written by `python -m infra.plan`, or None after one line on stderr naming the
    file that is not one."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {path}: not a plan document ({exc})", file=sys.stderr)
        return None


def check_plans_main(argv: list[str] | None, *, prog: str, description: str,
                     check: Callable[[dict[str, Any]], list[str]],
                     summarize: Callable[[dict[str, Any], list[str]], str]) -> int:
    """The command line of a check over plan documents (`python -m policies.plan.aws_iam_lint
    build/plan/*.json`): one summary line per plan, then one indented line per finding. Exit 0 when
    nothing is found, 1 when something is, 2 when a file is not a plan document (named, no traceback)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("plans", nargs="+", type=Path, help="plan documents written by python -m infra.plan")
    args = parser.parse_args(argv)
    found = 0
    for path in args.plans:
        plan = read_plan_document(path)
        if plan is None:
            return 2
        lines = check(plan)
        found += len(lines)
        print(f"{path}: {summarize(plan, lines)}")
        for line in lines:
            print(f"  {line}")
    return 1 if found else 0
