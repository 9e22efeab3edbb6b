"""Shared fixtures: every stack in stacks/ planned once per test session through the plan tool.

Usage: a test takes `plans` (dict stack -> plan document) or `plan_dir` (where JSON + k8s YAML are).
Each stack is planned in its own process (`python -m infra.plan`), exactly as a user runs it, so
Pulumi runtime state never leaks between stacks or into other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STACKS = sorted(p.name[len("Pulumi."):-len(".yaml")] for p in (ROOT / "stacks").glob("Pulumi.*.yaml"))


def _plan(stack: str, out: Path) -> tuple[str, subprocess.CompletedProcess]:
    proc = subprocess.run(
        [sys.executable, "-m", "infra.plan", "--stack", stack, "--out", str(out), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    return stack, proc


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _plan(s, out), STACKS))
    failures = [f"{s}:\n{p.stdout}\n{p.stderr}" for s, p in results if p.returncode != 0]
    assert not failures, "planning failed:\n" + "\n".join(failures)
    return out


@pytest.fixture(scope="session")
def plans(plan_dir) -> dict[str, dict]:
    return {s: json.loads((plan_dir / f"{s}.json").read_text()) for s in STACKS}


@pytest.fixture(autouse=True)
def _fresh_pulumi_root():
    """Each test that sets Pulumi mocks must get a new root stack resource; one left behind by an
    earlier test belongs to that test's (closed) event loop."""
    if "pulumi" in sys.modules:
        from pulumi.runtime import settings

        settings.ROOT.set(None)
    yield


def resources_of(plan: dict, type_token: str) -> list[dict]:
    """All resources of one Pulumi type token in a plan."""
    return [r for r in plan["resources"] if r["type"] == type_token]
