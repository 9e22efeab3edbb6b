"""`gpu-train list / status / pause / resume / cancel` against the real control plane: `list` shows the state Kueue
and the JobSet controller give each job (Queued behind another job, then Running), with its provenance; pause and
resume set the real Workload's `spec.active` and Kueue evicts and readmits it; a finished job cannot be paused;
cancel deletes the JobSet and the garbage collector takes Kueue's Workload with it; RBAC lets a viewer follow a job
and refuses the viewer a pause and another team's member a look; the team comes from the kubeconfig's context.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_cli_jobs.py -q

The tests share the lane's plane and run in file order; the `clean` fixture leaves the team namespaces empty
before and after each. What `status` says of the queue position and of rank 0's progress is not asserted here.
"""

from __future__ import annotations

from tests.cluster.conftest import job_spec, wait_for
from tests.cluster.jobs import (
    NS,
    WORKLOAD,
    delete_jobset,
    fail_pod,
    gpu_usage,
    is_true,
    jobset_of,
    kubeconfig_variant,
    pending,
    running_pods,
    workload_of,
)
from tests.gpu_train.cli.conftest import only_error_lines


def _submit(platform, cli, tmp_path, name: str, nodes: str = "1:1") -> None:
    code, _, err = cli("submit", job_spec(tmp_path, name=name, nodes=nodes), "--kubeconfig",
                       platform.kubeconfigs["alice"])
    assert code == 0, err


def _admitted(platform, name: str) -> bool:
    return is_true(workload_of(platform, name), "Admitted")


def _row(out: str, name: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[0] == name)


def test_list_shows_each_jobs_state(platform, cli, tmp_path, clean):
    alice = platform.kubeconfigs["alice"]
    _submit(platform, cli, tmp_path, "jobs-filler", "4:4")
    wait_for("'jobs-filler' admitted on all 4 GPUs", lambda: _admitted(platform, "jobs-filler"))
    _submit(platform, cli, tmp_path, "jobs-listed", "2:2")
    wait_for("'jobs-listed' waiting behind the filler", lambda: pending(platform, "jobs-listed"))
    code, out, err = cli("list", "--kubeconfig", alice)
    assert code == 0, err
    assert out.splitlines()[0].split() == ["NAME", "KIND", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH", "HASH"]
    row = _row(out, "jobs-listed")
    assert row[:5] == ["jobs-listed", "job", "Queued", "2", "l4-spot"]
    # Submitted from a file outside any git repository: no commit; its path and the config hash's first 12 digits.
    digest = jobset_of(platform, "jobs-listed")["metadata"]["annotations"]["gpu-train.io/config-hash"]
    assert row[6] == "-" and row[7].endswith("jobs-listed.yaml") and row[8] == digest.removeprefix("sha256:")[:12]
    assert _row(out, "jobs-filler")[2] == "Running"
    delete_jobset(platform, "jobs-filler")
    wait_for("'jobs-listed' admitted once the quota is free", lambda: _admitted(platform, "jobs-listed"))
    assert _row(cli("list", "--kubeconfig", alice)[1], "jobs-listed")[2] == "Running"


def test_a_viewer_can_follow_a_job(platform, cli, tmp_path, clean):
    _submit(platform, cli, tmp_path, "jobs-followed", "2:2")
    pods = wait_for("both pods Running", lambda: len(p := running_pods(platform, "jobs-followed")) == 2 and p)
    code, out, err = cli("status", "jobs-followed", "--kubeconfig", platform.kubeconfigs["vera"])
    assert code == 0, err
    assert "job jobs-followed in team-research: Running" in out
    assert "admitted by cluster queue team-research on pool l4-spot" in out
    for pod in pods:
        rank = pod.metadata.labels["batch.kubernetes.io/job-completion-index"]
        assert f"rank {rank}  {pod.metadata.name}  Running  node {pod.spec.node_name}" in out


def test_pause_and_resume_set_the_workloads_active_field(platform, cli, tmp_path, clean):
    alice = platform.kubeconfigs["alice"]
    _submit(platform, cli, tmp_path, "jobs-pause")
    wait_for("'jobs-pause' admitted", lambda: _admitted(platform, "jobs-pause"))
    name = workload_of(platform, "jobs-pause")["metadata"]["name"]
    code, out, err = cli("pause", "jobs-pause", "--kubeconfig", alice)
    assert code == 0, err
    assert "paused job 'jobs-pause'" in out
    wl = platform.get(*WORKLOAD, name, NS)
    assert wl["spec"]["active"] is False
    # Kueue evicts a deactivated Workload, suspends the JobSet and releases its quota.
    wait_for("Kueue to evict it and release its quota", lambda: jobset_of(platform, "jobs-pause")["spec"]["suspend"]
             is True and gpu_usage(platform, NS) == 0)
    evicted = next(c for c in platform.get(*WORKLOAD, name, NS)["status"]["conditions"] if c["type"] == "Evicted")
    assert (evicted["status"], evicted["reason"]) == ("True", "Deactivated")
    assert _row(cli("list", "--kubeconfig", alice)[1], "jobs-pause")[2] == "Paused"
    code, out, err = cli("resume", "jobs-pause", "--kubeconfig", alice)
    assert code == 0, err
    assert platform.get(*WORKLOAD, name, NS)["spec"]["active"] is True  # the same Workload, active again
    wait_for("'jobs-pause' admitted again", lambda: _admitted(platform, "jobs-pause") and
             gpu_usage(platform, NS) == 1)
    assert _row(cli("list", "--kubeconfig", alice)[1], "jobs-pause")[2] == "Running"


def test_a_viewer_may_not_pause(platform, cli, tmp_path, clean):
    _submit(platform, cli, tmp_path, "jobs-nopause")
    wl = wait_for("Kueue's Workload for 'jobs-nopause'", lambda: workload_of(platform, "jobs-nopause"))
    code, _, err = cli("pause", "jobs-nopause", "--kubeconfig", platform.kubeconfigs["vera"])
    assert code == 1 and only_error_lines(err)
    assert "you may not pause workload" in err and 'User "vera" cannot patch resource "workloads"' in err
    assert platform.get(*WORKLOAD, wl["metadata"]["name"], NS)["spec"]["active"] is True


def test_pausing_a_failed_job(platform, cli, tmp_path, clean):
    """kwok ends the pod with exit code 2 (bad input): the JobSet fails at once (docs/deploy-job.md)."""
    _submit(platform, cli, tmp_path, "jobs-failed")
    (pod,) = wait_for("the pod Running", lambda: running_pods(platform, "jobs-failed"))
    fail_pod(platform, pod, 2)
    wait_for("the JobSet Failed", lambda: is_true(jobset_of(platform, "jobs-failed"), "Failed"))
    code, _, err = cli("pause", "jobs-failed", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 2 and only_error_lines(err)
    assert "job 'jobs-failed' has failed; there is nothing to pause" in err


def test_cancel_deletes_the_jobset_and_kueues_workload_goes_with_it(platform, cli, tmp_path, clean):
    alice = platform.kubeconfigs["alice"]
    _submit(platform, cli, tmp_path, "jobs-cancel")
    wl = wait_for("'jobs-cancel' admitted", lambda: _admitted(platform, "jobs-cancel") and
                  workload_of(platform, "jobs-cancel"))
    code, out, err = cli("cancel", "jobs-cancel", "--kubeconfig", alice)
    assert code == 0, err
    wait_for("the JobSet gone, its Workload collected, its quota free", lambda: jobset_of(platform, "jobs-cancel")
             is None and platform.get(*WORKLOAD, wl["metadata"]["name"], NS) is None and
             gpu_usage(platform, NS) == 0)
    code, _, err = cli("cancel", "jobs-cancel", "--kubeconfig", alice)
    assert code == 2 and only_error_lines(err) and "no job 'jobs-cancel' in team-research" in err


def test_unknown_jobs_and_other_teams(platform, cli, tmp_path, clean):
    alice = platform.kubeconfigs["alice"]
    code, _, err = cli("status", "nope", "--kubeconfig", alice)
    assert code == 2 and only_error_lines(err) and "no job 'nope' in team-research (`gpu-train list`" in err
    # bob submits for platform; alice, of research only, may not read it.
    code, _, err = cli("submit", job_spec(tmp_path, name="jobs-theirs", team="platform", pool="l40s-spot"),
                       "--kubeconfig", platform.kubeconfigs["bob"])
    assert code == 0, err
    code, _, err = cli("status", "jobs-theirs", "--team", "platform", "--kubeconfig", alice)
    assert code == 1 and only_error_lines(err) and "not a member of team 'platform'" in err
    assert 'User "alice" cannot get resource "jobsets"' in err
    code, _, err = cli("status", "Not_A_Name", "--kubeconfig", alice)
    assert code == 2 and "is not a job name" in err


def test_the_team_comes_from_the_context_or_team(platform, cli, tmp_path, clean):
    _submit(platform, cli, tmp_path, "jobs-context")
    plain = kubeconfig_variant(platform, "alice", tmp_path / "no-namespace", namespace="")
    code, _, err = cli("list", "--kubeconfig", plain)
    assert code == 2 and "which team?" in err and "--team <team>" in err
    code, out, err = cli("list", "--kubeconfig", plain, "--team", "research")
    assert code == 0 and _row(out, "jobs-context")[0] == "jobs-context", err
