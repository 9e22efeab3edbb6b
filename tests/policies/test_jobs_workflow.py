"""The jobs workflow (.github/workflows/jobs.yml) passes actionlint, lints on pull requests that touch jobs/ and
applies per team with the team's own OIDC identity on merges; tools/jobs_matrix.py gives it its matrix.

Usage: `.venv/bin/pytest tests/policies/test_jobs_workflow.py -q`.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT
from tools import jobs_matrix

WORKFLOW = ROOT / ".github" / "workflows" / "jobs.yml"


def actionlint(path) -> subprocess.CompletedProcess:
    exe = shutil.which("actionlint") or str(ROOT / ".venv" / "bin" / "actionlint")
    return subprocess.run([exe, "-no-color", str(path)], capture_output=True, text=True, timeout=120)


def test_the_jobs_workflow_passes_actionlint(tmp_path):
    proc = actionlint(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Control: the same file with a reference to a job output that does not exist fails.
    broken = tmp_path / "jobs.yml"
    broken.write_text(WORKFLOW.read_text().replace("needs.teams.outputs.region", "needs.teams.outputs.zone"))
    proc = actionlint(broken)
    assert proc.returncode != 0 and "zone" in proc.stdout


def _load() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True)  # YAML 1.1 reads the bare key `on` as True
    return doc


def test_lint_on_pull_requests_apply_per_team_on_merge():
    doc = _load()
    assert doc["on"]["pull_request"]["paths"][0] == "jobs/**" and doc["on"]["push"]["branches"] == ["main"]
    assert doc["permissions"] == {"contents": "read"}  # the lint job gets no cloud identity at all
    lint, apply = doc["jobs"]["lint"], doc["jobs"]["apply"]
    assert lint["if"] == "github.event_name == 'pull_request'"
    assert any(s.get("run") == "gpu-train lint jobs --platform platform.json" for s in lint["steps"])
    assert apply["environment"] == "jobs-${{ matrix.team }}"  # each team's identity lives in its environment
    assert apply["permissions"] == {"contents": "read", "id-token": "write"}
    assert apply["strategy"]["matrix"]["team"] == "${{ fromJSON(needs.teams.outputs.teams) }}"
    run = next(s["run"] for s in apply["steps"] if "gpu-train apply" in s.get("run", ""))
    assert '--team "${{ matrix.team }}" --prune' in run and '--commit "${{ github.sha }}"' in run
    uses = {s["uses"].split("@")[0]: s for s in apply["steps"] if "uses" in s}
    assert "role-to-assume" in uses["aws-actions/configure-aws-credentials"]["with"]
    assert "workload_identity_provider" in uses["google-github-actions/auth"]["with"]
    for job in doc["jobs"].values():
        for step in job["steps"]:
            if "uses" in step:
                assert "@v" in step["uses"], step["uses"]  # pinned by version


def test_jobs_matrix_lists_team_folders_and_the_stacks_cloud(tmp_path):
    jobs = tmp_path / "jobs"
    (jobs / "research").mkdir(parents=True)
    (jobs / "platform").mkdir()
    assert jobs_matrix.jobs_matrix(jobs, "gcp-dev", ROOT / "stacks") == {
        "teams": ["platform", "research"], "cloud": "gcp", "region": "us-central1"}
    with pytest.raises(jobs_matrix.JobsMatrixError, match="Pulumi.nope.yaml: no such stack file"):
        jobs_matrix.jobs_matrix(jobs, "nope", ROOT / "stacks")
    with pytest.raises(jobs_matrix.JobsMatrixError, match="GPU_TRAIN_JOBS_STACK"):
        jobs_matrix.jobs_matrix(jobs, "", ROOT / "stacks")
