"""The GitHub workflows parse and run what docs/ci.md says: make test, policy-enforced previews and
gated deploys with OIDC credentials.

Usage: `.venv/bin/pytest tests/policies/test_workflows.py -q`.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _matrix_source(job: dict) -> str:
    """The expression a job's matrix is built from (the stacks job's output, never a fixed list)."""
    return job["strategy"]["matrix"]["include"]


def _runs_where_the_api_server_is_reachable(job: dict) -> None:
    # AWS: the stack's own CodeBuild-hosted runner in its VPC, whose label is
    # codebuild-<project>-<run id>-<run attempt> with project <naming.prefix>-deploy (infra/aws/deploy_runner.py);
    # GCP: a GitHub-hosted runner, through GKE's DNS-based endpoint.
    from gpu_train.spec import naming
    from infra.aws.deploy_runner import runner_label

    project = f"{naming.prefix('STACK')}-deploy"
    expected = runner_label(project).replace("STACK", "{0}").replace("${{ github.run_id }}", "{1}") \
        .replace("${{ github.run_attempt }}", "{2}")
    assert job["runs-on"] == (f"${{{{ matrix.cloud == 'aws' && format('{expected}', matrix.stack, github.run_id, "
                              "github.run_attempt) || 'ubuntu-24.04' }}")


def _lists_marked_stacks(doc: dict) -> dict:
    stacks = doc["jobs"]["stacks"]
    assert any("python tools/deploy_matrix.py stacks" in r for r in _runs(stacks))
    return stacks


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
    _lists_marked_stacks(doc)
    assert preview["needs"] == ["test", "stacks"]
    assert _matrix_source(preview) == "${{ fromJSON(needs.stacks.outputs.all) }}"
    assert preview["if"] == "needs.stacks.outputs.all != '[]'"
    _runs_where_the_api_server_is_reachable(preview)
    cmd = next(r for r in _runs(preview) if r.startswith("pulumi preview"))
    assert "--stack ${{ matrix.stack }}" in cmd and "--policy-pack policies" in cmd
    assert "--policy-pack-config policies/policy-config.json" in cmd
    assert (ROOT / "policies" / "PulumiPolicy.yaml").exists() and (ROOT / "policies" / "policy-config.json").exists()
    _cloud_steps_use_oidc(preview)


def test_the_policy_pack_runs_from_the_installed_project():
    # The pack imports policies and gpu_train from the project installed in the virtualenv its
    # PulumiPolicy.yaml names (the Makefile's .venv), with no path of its own and no second pin list.
    pack = yaml.safe_load((ROOT / "policies" / "PulumiPolicy.yaml").read_text())
    assert pack["runtime"]["options"]["virtualenv"] == "../.venv"
    assert "\nVENV := .venv\n" in (ROOT / "Makefile").read_text()
    assert "sys.path" not in (ROOT / "policies" / "__main__.py").read_text()
    assert not (ROOT / "policies" / "requirements.txt").exists()
    for name, job in (("ci.yml", "preview"), ("deploy.yml", "dev"), ("deploy.yml", "prod")):
        runs = [r.strip() for r in _runs(_load(name)["jobs"][job])]
        pulumi = next(i for i, r in enumerate(runs) if r.startswith(("pulumi preview", "pulumi up")))
        assert "make setup" in runs[:pulumi], (name, job)
    # The CLI runs `python policies/`, so the pack's own directory comes first on sys.path: none of its
    # modules may stand in for a top-level module of the same name.
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from policies.crossguard import build_policies; "
              "build_policies(); print(sorted(n for n, m in sys.modules.items() if not n.startswith('policies') "
              "and str(getattr(m, '__file__', '') or '').startswith(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", script, str(ROOT / "policies")], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


def test_deploy_updates_dev_then_prod_behind_an_approval_environment():
    doc = _load("deploy.yml")
    _common_checks(doc)
    assert doc["on"]["push"]["branches"] == ["main"]
    dev, prod = doc["jobs"]["dev"], doc["jobs"]["prod"]
    _lists_marked_stacks(doc)
    assert _matrix_source(dev) == "${{ fromJSON(needs.stacks.outputs.nonprod) }}"
    assert _matrix_source(prod) == "${{ fromJSON(needs.stacks.outputs.prod) }}"
    assert prod["needs"] == ["stacks", "dev", "prod-runner"] and prod["environment"] == "production"
    assert "needs.dev.result == 'success'" in prod["if"]  # never after a failed non-prod update
    assert "needs.prod-runner.result == 'success'" in prod["if"]
    assert dev["needs"] == ["stacks", "dev-runner"]
    # Before an AWS stack's first deploy its in-VPC runner does not exist: the runner jobs create the
    # cloud side alone from a GitHub-hosted runner, under the same environment (and so the same approval).
    for name, env, source in (("dev-runner", "development", "nonprod"), ("prod-runner", "production", "prod")):
        job = doc["jobs"][name]
        assert job["runs-on"] == "ubuntu-24.04" and job["environment"] == env
        assert _matrix_source(job) == f"${{{{ fromJSON(needs.stacks.outputs.{source}) }}}}"
        cmd = next(r for r in _runs(job) if r.startswith("pulumi up"))
        assert "--exclude-dependents" in cmd and "pulumi:providers:kubernetes::cluster-k8s" in cmd
        assert "--policy-pack policies" in cmd
        check = next(st for st in job["steps"] if st.get("id") == "runner")
        assert "batch-get-projects" in check["run"] and check["if"] == "matrix.cloud == 'aws'"
        creds = next(st for st in job["steps"] if st.get("uses", "").startswith("aws-actions/configure-aws-credentials"))
        assert "role-to-assume" in creds["with"]
    for job in (dev, prod):
        _runs_where_the_api_server_is_reachable(job)
        cmd = next(r for r in _runs(job) if r.startswith("pulumi up"))
        assert "--yes" in cmd and "--stack ${{ matrix.stack }}" in cmd and "--policy-pack policies" in cmd
        _cloud_steps_use_oidc(job)
    assert not doc["concurrency"]["cancel-in-progress"]


def test_only_stacks_marked_for_deployment_are_previewed_or_deployed():
    from tools import deploy_matrix

    marked = sorted(s for s in STACKS if (yaml.safe_load((ROOT / "stacks" / f"Pulumi.{s}.yaml").read_text())
                                          ["config"].get("gpu-train:deploy") is True))
    found = deploy_matrix.deploy_matrix(ROOT / "stacks")
    assert sorted(e["stack"] for e in found["nonprod"] + found["prod"]) == marked


def test_docs_describe_the_workflows():
    text = Path(ROOT / "docs" / "ci.md").read_text()
    assert "production" in text and "--policy-pack policies" in text and "make test" in text
    assert "gpu-train:deploy: true" in text and "gpu-train:deployRunner" in text and "DNS-based" in text
