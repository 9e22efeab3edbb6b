"""The GitHub workflows parse and run what docs/ci.md says: make test, policy-enforced previews and
gated deploys with OIDC credentials.

Usage: `.venv/bin/pytest tests/policies/test_workflows.py -q`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.conftest import ROOT, STACKS

WORKFLOWS = ROOT / ".github" / "workflows"


def _load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the bare key `on` as True
    return doc


def _runs(job: dict) -> list[str]:
    return [s["run"] for s in job["steps"] if "run" in s]


def _uses(job: dict) -> list[str]:
    return [s["uses"] for s in job["steps"] if "uses" in s]


def _stacks(job: dict) -> list[str]:
    return [i["stack"] for i in job["strategy"]["matrix"]["include"]]


def _common_checks(doc: dict) -> None:
    assert doc["permissions"] == {"contents": "read", "id-token": "write"}
    for job in doc["jobs"].values():
        for use in _uses(job):
            assert "@" in use and not use.endswith(("@main", "@master")), f"{use} is not pinned"


def _cloud_steps_use_oidc(job: dict) -> None:
    by_use = {s["uses"].split("@")[0]: s for s in job["steps"] if "uses" in s}
    assert "role-to-assume" in by_use["aws-actions/configure-aws-credentials"]["with"]
    assert "workload_identity_provider" in by_use["google-github-actions/auth"]["with"]
    assert "pulumi/actions" in by_use
    step = next(s for s in job["steps"] if "pulumi " in s.get("run", ""))
    assert step["env"]["PULUMI_ACCESS_TOKEN"] == "${{ secrets.PULUMI_ACCESS_TOKEN }}"


def test_ci_runs_make_test_then_policy_previews_of_every_stack():
    doc = _load("ci.yml")
    _common_checks(doc)
    assert "pull_request" in doc["on"]
    assert any(r.strip() == "make test" for r in _runs(doc["jobs"]["test"]))
    preview = doc["jobs"]["preview"]
    assert preview["needs"] == "test"
    assert sorted(_stacks(preview)) == sorted(STACKS)
    cmd = next(r for r in _runs(preview) if r.startswith("pulumi preview"))
    assert "--stack ${{ matrix.stack }}" in cmd and "--policy-pack policies" in cmd
    assert "--policy-pack-config policies/policy-config.json" in cmd
    assert (ROOT / "policies" / "PulumiPolicy.yaml").exists() and (ROOT / "policies" / "policy-config.json").exists()
    _cloud_steps_use_oidc(preview)


def test_deploy_updates_dev_then_prod_behind_an_approval_environment():
    doc = _load("deploy.yml")
    _common_checks(doc)
    assert doc["on"]["push"]["branches"] == ["main"]
    dev, prod = doc["jobs"]["dev"], doc["jobs"]["prod"]
    assert sorted(_stacks(dev)) == sorted(s for s in STACKS if s.endswith("-dev"))
    assert sorted(_stacks(prod)) == sorted(s for s in STACKS if s.endswith("-prod"))
    assert prod["needs"] == "dev" and prod["environment"] == "production"
    for job in (dev, prod):
        cmd = next(r for r in _runs(job) if r.startswith("pulumi up"))
        assert "--yes" in cmd and "--stack ${{ matrix.stack }}" in cmd and "--policy-pack policies" in cmd
        _cloud_steps_use_oidc(job)
    assert not doc["concurrency"]["cancel-in-progress"]


def test_docs_describe_the_workflows():
    text = Path(ROOT / "docs" / "ci.md").read_text()
    assert "production" in text and "--policy-pack policies" in text and "make test" in text
