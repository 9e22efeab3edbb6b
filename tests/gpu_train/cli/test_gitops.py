"""`gpu-train lint` and `gpu-train apply` against the fake API server: apply then re-apply writes nothing; a changed
spec is replaced while Kueue holds it and left running (reported) once admitted; a deleted spec is cancelled only
with --prune; a hand edit is reported as drift; every JobSet carries its commit, path and hash.

Run: .venv/bin/pytest tests/gpu_train/cli/test_gitops.py -q
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gpu_train.jobs.jobset import (
    COMMIT_ANNOTATION,
    HASH_ANNOTATION,
    MANAGED_ANNOTATION,
    PATH_ANNOTATION,
    config_hash,
)
from tests.gpu_train.cli.conftest import ALICE, only_error_lines

SPEC = {"name": "gpt2-smoke", "team": "research", "pool": "l4-spot", "preset": "gpt2-124m", "nodes": "1:2",
        "gpusPerNode": 1, "steps": 200, "globalBatchTokens": 65536, "checkpointEvery": 50,
        "overrides": {"train.micro_batch_size": 8}}
WRITES = ("POST", "PUT", "PATCH", "DELETE")
# Each test runs git and a fake API server.
pytestmark = pytest.mark.integration


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    (root / "jobs" / "research").mkdir(parents=True)
    git(root, "init", "-q")
    git(root, "config", "user.email", "ci@example.com")
    git(root, "config", "user.name", "ci")
    return root


def commit(repo: Path, specs: dict[str, dict], message: str) -> str:
    """Write jobs/<team>/<name>.yaml for each spec (None deletes it) and commit; returns the commit."""
    for name, spec in specs.items():
        path = repo / "jobs" / "research" / f"{name}.yaml"
        if spec is None:
            path.unlink()
        else:
            path.write_text(yaml.safe_dump(spec))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def writes(api, since: int = 0) -> list[tuple[str, str]]:
    return [(m, p) for m, p, _, _ in api.requests[since:] if m in WRITES]


def apply(cli, api, repo, tmp_path, *extra: str):
    kubeconfig = api.kubeconfig(tmp_path, ALICE, "team-research")
    return cli("apply", repo / "jobs", "--kubeconfig", kubeconfig, *extra)


def live(api, name="gpt2-smoke"):
    return api.get("jobsets", "team-research", name)


def test_apply_creates_with_provenance_and_reapply_writes_nothing(api, repo, tmp_path, cli):
    head = commit(repo, {"gpt2-smoke": SPEC}, "first job")
    code, out, err = apply(cli, api, repo, tmp_path)
    assert code == 0, err
    assert f"create     research/gpt2-smoke @ {head[:12]}" in out and "apply: 1 create" in out
    notes = live(api)["metadata"]["annotations"]
    assert notes[COMMIT_ANNOTATION] == head and notes[PATH_ANNOTATION] == "jobs/research/gpt2-smoke.yaml"
    assert notes[MANAGED_ANNOTATION] == "gpu-train-apply"
    sent = next(b for m, p, _, b in api.requests if m == "POST")
    assert notes[HASH_ANNOTATION] == config_hash(sent)  # the hash of exactly what was sent
    # The same commit again, and a later commit that leaves the spec alone: only reads.
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path)
    assert code == 0 and "unchanged  research/gpt2-smoke" in out and writes(api, before) == []
    (repo / "README.md").write_text("unrelated\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "docs")
    before = len(api.requests)
    assert apply(cli, api, repo, tmp_path)[0] == 0 and writes(api, before) == []
    assert live(api)["metadata"]["annotations"][COMMIT_ANNOTATION] == head  # the commit the JobSet came from


def test_a_changed_spec_replaces_a_queued_job(api, repo, tmp_path, cli):
    commit(repo, {"gpt2-smoke": SPEC}, "first")
    apply(cli, api, repo, tmp_path)
    old = live(api)
    assert old["spec"]["suspend"] is True  # queued: Kueue has not admitted it
    second = commit(repo, {"gpt2-smoke": {**SPEC, "steps": 400}}, "more steps")
    before = len(api.requests)
    code, out, err = apply(cli, api, repo, tmp_path)
    assert code == 0, err
    assert "replace    research/gpt2-smoke" in out and "not admitted by Kueue" in out
    path = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/team-research/jobsets"
    assert writes(api, before) == [("DELETE", f"{path}/gpt2-smoke"), ("POST", path)]
    new = live(api)
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["annotations"][COMMIT_ANNOTATION] == second
    assert new["metadata"]["annotations"][HASH_ANNOTATION] != old["metadata"]["annotations"][HASH_ANNOTATION]
    assert "train.steps=400" in new["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["args"]


def test_a_running_job_keeps_running_until_replace_running_or_a_revert(api, repo, tmp_path, cli):
    commit(repo, {"gpt2-smoke": SPEC}, "first")
    apply(cli, api, repo, tmp_path)
    live(api)["spec"]["suspend"] = False  # Kueue admitted it: its pods run
    commit(repo, {"gpt2-smoke": {**SPEC, "steps": 400}}, "more steps")
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path)
    assert code == 0 and "pending    research/gpt2-smoke  spec changed but the job is running" in out
    assert writes(api, before) == []
    # The revert is the rollback: the spec is the running one again, nothing pending, nothing written.
    git(repo, "revert", "--no-edit", "HEAD")
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path)
    assert code == 0 and "unchanged  research/gpt2-smoke" in out and writes(api, before) == []
    git(repo, "revert", "--no-edit", "HEAD")  # steps 400 again, this time replacing the running job
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path, "--replace-running")
    assert code == 0 and "replace    research/gpt2-smoke" in out and "running; --replace-running" in out
    assert [m for m, _ in writes(api, before)] == ["DELETE", "POST"]


def test_a_deleted_spec_is_cancelled_only_with_prune(api, repo, tmp_path, cli):
    commit(repo, {"gpt2-smoke": SPEC, "second": {**SPEC, "name": "second"}}, "two jobs")
    apply(cli, api, repo, tmp_path)
    commit(repo, {"second": None}, "drop the second job")
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path)
    assert code == 0 and "orphan     research/second  its spec was deleted; --prune cancels it" in out
    assert writes(api, before) == [] and live(api, "second") is not None
    code, out, _ = apply(cli, api, repo, tmp_path, "--prune")
    assert code == 0 and "cancel     research/second" in out
    assert live(api, "second") is None and live(api) is not None
    assert writes(api, before) == [("DELETE", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/team-research/jobsets/second")]


def test_a_hand_edit_is_reported_as_drift_and_left_alone(api, repo, tmp_path, cli):
    commit(repo, {"gpt2-smoke": SPEC}, "first")
    apply(cli, api, repo, tmp_path)
    pod = live(api)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"]["gpu-train.io/pool"] = "l40s-spot"  # kubectl edit while it waits in the queue
    pod["tolerations"].append({"key": "kueue", "operator": "Exists"})  # an addition is not drift
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path, "--prune", "--replace-running")
    assert code == 1
    assert "drift      research/gpt2-smoke  edited on the cluster: spec.replicatedJobs[0].template.spec.template.spec." \
           "nodeSelector.gpu-train.io/pool" in out
    assert writes(api, before) == []
    assert pod["nodeSelector"]["gpu-train.io/pool"] == "l40s-spot"  # never overwritten


def test_a_job_submitted_by_hand_is_a_conflict_not_replaced(api, repo, tmp_path, cli):
    kubeconfig = api.kubeconfig(tmp_path, ALICE, "team-research")
    path = tmp_path / "gpt2-smoke.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    assert cli("submit", path, "--kubeconfig", kubeconfig)[0] == 0
    assert MANAGED_ANNOTATION not in live(api)["metadata"]["annotations"]
    commit(repo, {"gpt2-smoke": {**SPEC, "steps": 300}}, "same name")
    before = len(api.requests)
    code, out, _ = apply(cli, api, repo, tmp_path, "--prune")
    assert code == 1 and "conflict   research/gpt2-smoke" in out and writes(api, before) == []


def test_dry_run_writes_nothing_and_prints_the_estimate(api, repo, tmp_path, cli):
    commit(repo, {"gpt2-smoke": SPEC}, "first")
    code, out, _ = apply(cli, api, repo, tmp_path, "--dry-run")
    assert code == 0 and writes(api) == [] and "apply (dry run): 1 create" in out
    assert "carbon: ~" in out and "kg CO2e in us-east-1" in out


def test_apply_refuses_uncommitted_specs(api, repo, tmp_path, cli):
    commit(repo, {"gpt2-smoke": SPEC}, "first")
    (repo / "jobs" / "research" / "gpt2-smoke.yaml").write_text(yaml.safe_dump({**SPEC, "steps": 10}))
    code, _, err = apply(cli, api, repo, tmp_path)
    assert code == 2 and only_error_lines(err) and "changed since the last commit" in err
    assert writes(api) == []


def test_list_shows_commit_path_and_hash(api, repo, tmp_path, cli):
    head = commit(repo, {"gpt2-smoke": SPEC}, "first")
    apply(cli, api, repo, tmp_path)
    code, out, _ = cli("list", "--kubeconfig", api.kubeconfig(tmp_path, ALICE, "team-research"))
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH", "HASH"]
    digest = live(api)["metadata"]["annotations"][HASH_ANNOTATION].removeprefix("sha256:")
    assert row.split()[-3:] == [head[:12], "jobs/research/gpt2-smoke.yaml", digest[:12]]


def test_lint_names_file_and_field(tmp_path, cli, doc):
    import json

    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    jobs = tmp_path / "jobs" / "research"
    jobs.mkdir(parents=True)
    (jobs / "good.yaml").write_text(yaml.safe_dump({**SPEC, "name": "good"}))
    code, out, err = cli("lint", tmp_path / "jobs", "--platform", platform)
    assert code == 0, err
    assert "ok  " in out and "1 job spec passes every check" in out
    assert "carbon: ~" in out
    (jobs / "wrong-name.yaml").write_text(yaml.safe_dump({**SPEC, "name": "other"}))
    (jobs / "bad-steps.yaml").write_text(yaml.safe_dump({**SPEC, "name": "bad-steps", "steps": 0}))
    (jobs / "good.yml").write_text(yaml.safe_dump({**SPEC, "name": "good"}))
    (tmp_path / "jobs" / "platform").mkdir()
    (tmp_path / "jobs" / "platform" / "misfiled.yaml").write_text(yaml.safe_dump({**SPEC, "name": "misfiled"}))
    code, _, err = cli("lint", tmp_path / "jobs", "--platform", platform)
    assert code == 2 and only_error_lines(err)
    assert f"{jobs}/wrong-name.yaml: job.name 'other' does not match the file name 'wrong-name'" in err
    assert f"{jobs}/bad-steps.yaml: job.steps must be >= 1 (got 0)" in err
    assert f"{jobs}/good.yml: job 'good' of team 'research' is also defined in {jobs}/good.yaml" in err
    assert "misfiled.yaml: job.team 'research' does not match its folder 'platform'" in err


def test_the_example_jobs_folder_passes_lint(tmp_path, cli, doc):
    import json

    from tests.gpu_train.cli.conftest import ROOT

    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))  # the aws-dev example stack's pools and teams
    code, out, err = cli("lint", ROOT / "examples" / "jobs", "--platform", platform)
    assert code == 0, err
    assert "2 job specs pass every check" in out and out.count("carbon: ~") == 2
