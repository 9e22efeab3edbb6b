"""`gpu-train apply` against the real control plane: a folder of job specs in git made true in the team's namespace.
Apply then re-apply leaves the JobSet alone; a changed spec replaces a job Kueue still holds in its queue and leaves
an admitted one running (reported) until `--replace-running` or a revert; a deleted spec is cancelled only with
--prune; a hand edit on the cluster is drift, reported and never overwritten; a job submitted by hand under the same
name is a conflict; every JobSet carries its commit, path and hash, which `list` shows.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_gitops.py -q

apply writes only by deleting and creating JobSets (gpu_train/jobs/gitops.py), so "wrote nothing" is checked as
the same JobSet (UID) still there and not being deleted. A job stays queued because another one holds the team's
four GPUs. The tests share the lane's plane and run in file order; `clean` empties the team namespaces around each.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gpu_train.jobs.jobset import COMMIT_ANNOTATION, HASH_ANNOTATION, MANAGED_ANNOTATION, PATH_ANNOTATION
from tests.cluster.conftest import job_spec, wait_for
from tests.cluster.jobs import JOBSET, NS, admitted, jobset_of, pending, workload_of
from tests.gpu_train.cli.conftest import only_error_lines

SPEC = {"team": "research", "pool": "l4-spot", "preset": "gpt2-124m", "nodes": "1:2", "gpusPerNode": 1, "steps": 200,
        "globalBatchTokens": 65536, "checkpointEvery": 50, "overrides": {"train.micro_batch_size": 8}}


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


def commit(repo: Path, specs: dict[str, dict | None], message: str) -> str:
    """Write jobs/research/<name>.yaml for each spec (None deletes it) and commit; returns the commit."""
    for name, spec in specs.items():
        path = repo / "jobs" / "research" / f"{name}.yaml"
        if spec is None:
            path.unlink()
        else:
            path.write_text(yaml.safe_dump({"name": name, **spec}))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def apply(cli, platform, repo, *extra: str) -> tuple[int, str, str]:
    return cli("apply", repo / "jobs", "--kubeconfig", platform.kubeconfigs["alice"], *extra)


def uid(platform, name: str) -> str | None:
    js = jobset_of(platform, name)
    return None if js is None or js["metadata"].get("deletionTimestamp") else js["metadata"]["uid"]


def queued_from_git(platform, cli, repo, tmp_path, name: str) -> None:
    """A hand-submitted job on all four of research's GPUs, then `name` committed and applied: it waits in the
    queue behind that job."""
    code, _, err = cli("submit", job_spec(tmp_path, name="git-filler", nodes="4:4"), "--kubeconfig",
                       platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("'git-filler' admitted", lambda: admitted(platform, "git-filler"))
    commit(repo, {name: SPEC}, "first")
    assert apply(cli, platform, repo)[0] == 0
    wait_for(f"'{name}' waiting in the queue", lambda: pending(platform, name))


def test_apply_creates_with_provenance_and_reapply_writes_nothing(platform, cli, repo, clean):
    head = commit(repo, {"git-first": SPEC}, "first job")
    code, out, err = apply(cli, platform, repo)
    assert code == 0, err
    assert f"create     research/git-first @ {head[:12]}" in out and "apply: 1 create" in out
    notes = jobset_of(platform, "git-first")["metadata"]["annotations"]
    assert notes[COMMIT_ANNOTATION] == head and notes[PATH_ANNOTATION] == "jobs/research/git-first.yaml"
    assert notes[MANAGED_ANNOTATION] == "gpu-train-apply" and notes[HASH_ANNOTATION].startswith("sha256:")
    first = uid(platform, "git-first")
    # The same commit again, and a later commit that leaves the spec alone: the hash apply computes again from
    # the spec is the one the API server stored, so nothing is written.
    code, out, _ = apply(cli, platform, repo)
    assert code == 0 and "unchanged  research/git-first" in out and uid(platform, "git-first") == first
    (repo / "README.md").write_text("unrelated\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "docs")
    code, out, _ = apply(cli, platform, repo)
    assert code == 0 and "unchanged  research/git-first" in out and uid(platform, "git-first") == first
    assert jobset_of(platform, "git-first")["metadata"]["annotations"][COMMIT_ANNOTATION] == head


def test_a_changed_spec_replaces_a_queued_job(platform, cli, repo, tmp_path, clean):
    queued_from_git(platform, cli, repo, tmp_path, "git-queued")
    old = jobset_of(platform, "git-queued")
    assert old["spec"]["suspend"] is True
    second = commit(repo, {"git-queued": {**SPEC, "steps": 400}}, "more steps")
    code, out, err = apply(cli, platform, repo)
    assert code == 0, err
    assert "replace    research/git-queued" in out and "not admitted by Kueue" in out
    new = jobset_of(platform, "git-queued")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["annotations"][COMMIT_ANNOTATION] == second
    assert new["metadata"]["annotations"][HASH_ANNOTATION] != old["metadata"]["annotations"][HASH_ANNOTATION]
    assert "train.steps=400" in new["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    wait_for("Kueue's Workload for the new JobSet", lambda: workload_of(platform, "git-queued"))


def test_a_running_job_keeps_running_until_replace_running_or_a_revert(platform, cli, repo, clean):
    commit(repo, {"git-running": SPEC}, "first")
    assert apply(cli, platform, repo)[0] == 0
    wait_for("Kueue to admit and unsuspend it", lambda: jobset_of(platform, "git-running")["spec"]["suspend"] is False)
    running = uid(platform, "git-running")
    commit(repo, {"git-running": {**SPEC, "steps": 400}}, "more steps")
    code, out, _ = apply(cli, platform, repo)
    assert code == 0 and "pending    research/git-running  spec changed but the job is running" in out
    assert uid(platform, "git-running") == running
    # The revert is the rollback: the spec is the running one's again, nothing pending, nothing written.
    git(repo, "revert", "--no-edit", "HEAD")
    code, out, _ = apply(cli, platform, repo)
    assert code == 0 and "unchanged  research/git-running" in out and uid(platform, "git-running") == running
    git(repo, "revert", "--no-edit", "HEAD")  # steps 400 again, this time replacing the running job
    code, out, _ = apply(cli, platform, repo, "--replace-running")
    assert code == 0 and "replace    research/git-running" in out and "running; --replace-running" in out
    assert uid(platform, "git-running") not in (None, running)


def test_a_deleted_spec_is_cancelled_only_with_prune(platform, cli, repo, clean):
    commit(repo, {"git-kept": SPEC, "git-dropped": {**SPEC, "nodes": "1:1"}}, "two jobs")
    assert apply(cli, platform, repo)[0] == 0
    kept, dropped = uid(platform, "git-kept"), uid(platform, "git-dropped")
    commit(repo, {"git-dropped": None}, "drop the second job")
    code, out, _ = apply(cli, platform, repo)
    assert code == 0 and "orphan     research/git-dropped  its spec was deleted; --prune cancels it" in out
    assert uid(platform, "git-dropped") == dropped
    code, out, _ = apply(cli, platform, repo, "--prune")
    assert code == 0 and "cancel     research/git-dropped" in out
    wait_for("the pruned JobSet gone", lambda: jobset_of(platform, "git-dropped") is None)
    assert uid(platform, "git-kept") == kept


def test_a_hand_edit_is_reported_as_drift_and_left_alone(platform, cli, repo, tmp_path, clean):
    queued_from_git(platform, cli, repo, tmp_path, "git-edited")
    # kubectl edit while it waits in the queue (the JobSet webhook allows pod template edits while suspended).
    live = jobset_of(platform, "git-edited")
    jobs = live["spec"]["replicatedJobs"]
    pod = jobs[0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"]["gpu-train.io/pool"] = "l40s-spot"
    pod["tolerations"].append({"key": "kueue", "operator": "Exists"})  # an addition is not drift
    platform.plane.client().resources.get(api_version=JOBSET[0], kind=JOBSET[1]).patch(
        name="git-edited", namespace=NS, body={"spec": {"replicatedJobs": jobs}},
        content_type="application/merge-patch+json")
    code, out, _ = apply(cli, platform, repo, "--prune", "--replace-running")
    assert code == 1
    assert "drift      research/git-edited  edited on the cluster: spec.replicatedJobs[0].template.spec.template.spec." \
           "nodeSelector.gpu-train.io/pool" in out
    after = jobset_of(platform, "git-edited")
    assert after["metadata"]["uid"] == live["metadata"]["uid"]
    assert after["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelector"][
        "gpu-train.io/pool"] == "l40s-spot"  # never overwritten


def test_a_job_submitted_by_hand_is_a_conflict_not_replaced(platform, cli, repo, tmp_path, clean):
    code, _, err = cli("submit", job_spec(tmp_path, name="git-hand"), "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    by_hand = jobset_of(platform, "git-hand")
    assert MANAGED_ANNOTATION not in by_hand["metadata"]["annotations"]
    commit(repo, {"git-hand": {**SPEC, "steps": 300}}, "same name")
    code, out, _ = apply(cli, platform, repo, "--prune")
    assert code == 1 and "conflict   research/git-hand" in out
    assert uid(platform, "git-hand") == by_hand["metadata"]["uid"]


def test_dry_run_writes_nothing_and_prints_the_estimate(platform, cli, repo, clean):
    commit(repo, {"git-dry": SPEC}, "first")
    code, out, err = apply(cli, platform, repo, "--dry-run")
    assert code == 0 and "apply (dry run): 1 create" in out, err
    assert "carbon: ~" in out and "kg CO2e in us-east-1" in out
    assert platform.list(*JOBSET, NS) == []


def test_apply_refuses_uncommitted_specs(platform, cli, repo, clean):
    commit(repo, {"git-dirty": SPEC}, "first")
    (repo / "jobs" / "research" / "git-dirty.yaml").write_text(yaml.safe_dump({"name": "git-dirty", **SPEC,
                                                                                "steps": 10}))
    code, _, err = apply(cli, platform, repo)
    assert code == 2 and only_error_lines(err) and "changed since the last commit" in err
    assert platform.list(*JOBSET, NS) == []


def test_list_shows_commit_path_and_hash(platform, cli, repo, clean):
    head = commit(repo, {"git-listed": SPEC}, "first")
    assert apply(cli, platform, repo)[0] == 0
    code, out, err = cli("list", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "KIND", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH", "HASH"]
    digest = jobset_of(platform, "git-listed")["metadata"]["annotations"][HASH_ANNOTATION].removeprefix("sha256:")
    assert row.split()[0] == "git-listed"
    assert row.split()[-3:] == [head[:12], "jobs/research/git-listed.yaml", digest[:12]]
