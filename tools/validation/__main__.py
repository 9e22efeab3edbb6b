"""Check plans against the charts and CRDs at the pinned versions, offline.

Usage:
    python -m tools.validation build/plan/*.json        # after `make plans`
    python -m tools.validation build/plan/aws-dev.json --verbose

Prints every problem (Helm values against the chart snapshot, custom resources against their CRD
snapshot, pods their namespace's Pod Security level or the team namespaces' admission policies refuse:
tools/validation/admission.py), then what was not checked offline (unverified chart repositories, CEL rules that need
Kubernetes' own CEL libraries or an old object), and exits 1 when there is any problem.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from policies.plan import read_plan_document
from tools.validation import admission, crd, helm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.validation", description=__doc__.split("\n\n")[0])
    parser.add_argument("plans", type=Path, nargs="+", help="plan JSON files written by python -m infra.plan")
    parser.add_argument("--verbose", action="store_true", help="list every CEL rule not evaluated")
    args = parser.parse_args(argv)
    problems = 0
    for path in args.plans:
        plan = read_plan_document(path)
        if plan is None:
            return 2
        stack = plan.get("stack", path.stem)
        releases = helm.check_plan(plan)
        objects = crd.check_plan(plan)
        admitted = admission.check_plan(plan)
        found = [p for r in releases for p in r.problems] + [
            f"{r.kind}/{r.name}: {p}" for r in objects for p in r.problems] + admitted.problems
        problems += len(found)
        for p in found:
            print(f"{stack}: {p}")
        for r in releases:
            for u in r.unverified:
                print(f"{stack}: not checked: {u}")
        for r in objects:
            for note in r.stand_ins:
                print(f"{stack}: not checked: {r.kind}/{r.name}: {note}")
        for note in admitted.notes:
            print(f"{stack}: note: {note}")
        skipped = Counter(u.category for r in objects for u in r.unevaluated)
        print(f"{stack}: {len(releases)} Helm releases, {len(objects)} custom resources, "
              f"{len(admitted.workloads)} workloads, {len(found)} problems; "
              f"CEL rules not evaluated: {dict(skipped) or 0}")
        if args.verbose:
            for r in objects:
                for u in r.unevaluated:
                    print(f"{stack}:   {r.kind}/{r.name} {u}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
