"""A team's work through the real control plane, as its members: `gpu-train submit` admitted by the real Kueue in
the team's queue, a job over quota waiting with Kueue's own reason, the JobSet controller's Jobs, the scheduler
placing pods on the pool's kwok nodes only, `list` and `status` showing what the cluster shows, pause, resume and
cancel releasing and regaining quota, a production job preempting a sweep trial, a lost node's pod replaced, and
what Kueue does with an elastic `MIN:MAX` job.

Run: .venv/bin/pytest tests/cluster/test_team_work.py -q

The tests share one plane and run in file order; each removes its jobs before it ends, so each starts with the
team's quota free (the `clean` fixture checks it).
"""

from __future__ import annotations

from tests.cluster.conftest import STACK, job_spec, wait_for
from tests.cluster.jobs import (
    JOBSET,
    NS,
    WORKLOAD,
    admitted,
    condition,
    gpu_usage,
    pods_of,
    running_pods,
    submit,
    workload_of,
)


def test_the_stacks_own_job_is_admitted_by_kueue_in_its_queue(platform, stack_objects, clean):
    """The stack's job as its plan has it, applied again (other tests' `clean` removes every team JobSet)."""
    js = next(o for o in stack_objects[STACK] if o["kind"] == "JobSet")
    name, ns = js["metadata"]["name"], js["metadata"]["namespace"]
    platform.plane.apply([js])
    wait_for(f"the stack's job {name} admitted", lambda: admitted(platform, name, ns))
    assert workload_of(platform, name, ns)["status"]["admission"]["clusterQueue"] == "team-research"


def test_a_submitted_job_is_admitted_within_quota_and_placed_on_its_pool_only(platform, cli, tmp_path, clean):
    code, out, err = submit(cli, platform, tmp_path, name="fits", nodes="2:2")
    assert code == 0, err
    wait_for("Kueue to admit 'fits'", lambda: admitted(platform, "fits"))
    wl = workload_of(platform, "fits")
    (assignment,) = wl["status"]["admission"]["podSetAssignments"]
    assert assignment["flavors"]["nvidia.com/gpu"] == "l4-spot" and assignment["count"] == 2
    # The JobSet controller made the worker Job; the scheduler bound its pods; kwok runs them.
    pods = wait_for("both pods Running", lambda: len(running_pods(platform, "fits")) == 2 and
                    running_pods(platform, "fits"))
    nodes = {n.metadata.name: n for n in platform.core().list_node().items}
    for pod in pods:
        node = nodes[pod.spec.node_name]
        assert node.metadata.labels["gpu-train.io/pool"] == "l4-spot", pod.spec.node_name
    assert len({p.spec.node_name for p in pods}) == 2  # one pod per node
    wait_for("Kueue to count 2 GPUs reserved", lambda: gpu_usage(platform) == 2)

    code, out, err = cli("list", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    row = next(line.split() for line in out.splitlines() if line.startswith("fits "))
    assert row[1:5] == ["job", "Running", "2", "l4-spot"]
    code, out, err = cli("status", "fits", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    assert "job fits in team-research: Running" in out
    assert "admitted by cluster queue team-research on pool l4-spot" in out
    for pod in pods:
        assert pod.metadata.name in out


def test_a_job_over_quota_waits_with_kueues_own_reason(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="first", nodes="2:2")[0] == 0
    wait_for("'first' admitted", lambda: admitted(platform, "first"))
    assert submit(cli, platform, tmp_path, name="second", nodes="4:4")[0] == 0
    wl = wait_for("Kueue's verdict on 'second'", lambda: (w := workload_of(platform, "second")) and
                  condition(w, "QuotaReserved") and w)
    reserved = condition(wl, "QuotaReserved")
    assert reserved["status"] == "False" and reserved["reason"] == "Pending"
    assert "insufficient unused quota for nvidia.com/gpu in flavor l4-spot" in reserved["message"]
    assert not pods_of(platform, "second")
    code, out, err = cli("status", "second", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    assert "job second in team-research: Queued" in out and "insufficient unused quota" in out


def test_pause_and_resume_release_and_regain_quota(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="pausable", nodes="2:2")[0] == 0
    wait_for("'pausable' running", lambda: len(running_pods(platform, "pausable")) == 2)
    wait_for("Kueue to count 2 GPUs reserved", lambda: gpu_usage(platform) == 2)
    code, out, err = cli("pause", "pausable", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("the quota released and the pods gone", lambda: gpu_usage(platform) == 0 and
             not running_pods(platform, "pausable"))
    assert platform.get(*JOBSET, "pausable", NS)["spec"]["suspend"] is True
    assert cli("list", "--kubeconfig", platform.kubeconfigs["alice"])[1].count("Paused") == 1
    code, out, err = cli("resume", "pausable", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("the quota regained and the pods back", lambda: gpu_usage(platform) == 2 and
             len(running_pods(platform, "pausable")) == 2)


def test_cancel_deletes_the_job_and_frees_its_quota(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="doomed", nodes="1:1")[0] == 0
    wait_for("'doomed' admitted", lambda: admitted(platform, "doomed"))
    code, out, err = cli("cancel", "doomed", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0, err
    wait_for("the JobSet, its Workload and its quota gone", lambda: platform.get(*JOBSET, "doomed", NS) is None
             and not platform.list(*WORKLOAD, NS) and gpu_usage(platform) == 0)


def test_a_production_job_preempts_a_running_sweep_trial(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="trial", nodes="4:4", priorityClass="sweep")[0] == 0
    wait_for("the trial running on all 4 GPUs", lambda: admitted(platform, "trial") and gpu_usage(platform) == 4)
    assert submit(cli, platform, tmp_path, name="prod", nodes="2:2", priorityClass="production")[0] == 0
    wait_for("the production job admitted", lambda: admitted(platform, "prod"), timeout=120)
    trial = workload_of(platform, "trial")
    evicted = condition(trial, "Evicted")
    assert evicted and evicted["status"] == "True" and evicted["reason"] == "Preempted", trial["status"]
    assert condition(trial, "Preempted")["reason"] == "InClusterQueue"


def test_a_lost_nodes_pod_is_replaced_under_the_same_index_without_a_restart(platform, cli, tmp_path, clean):
    assert submit(cli, platform, tmp_path, name="survivor", nodes="2:2")[0] == 0
    pods = wait_for("both pods Running", lambda: len(running_pods(platform, "survivor")) == 2 and
                    running_pods(platform, "survivor"))
    victim = next(p for p in pods if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == "1")
    node = victim.spec.node_name
    core = platform.core()
    core.delete_node(node)
    try:
        # The pod GC marks the orphaned pod DisruptionTarget and deletes it; the Job's pod failure policy ignores
        # it and creates a replacement under index 1, which the scheduler puts on another node of the pool.
        replaced = wait_for("a replacement for index 1 on another node", lambda: [
            p for p in running_pods(platform, "survivor")
            if p.metadata.labels["batch.kubernetes.io/job-completion-index"] == "1"
            and p.metadata.uid != victim.metadata.uid], timeout=150)
        assert replaced[0].spec.node_name != node
        js = platform.get(*JOBSET, "survivor", NS)
        assert (js.get("status") or {}).get("restarts", 0) == 0
        assert admitted(platform, "survivor")
    finally:
        platform.plane.add_nodes([n for n in platform.nodes if n["metadata"]["name"] == node])


def test_an_elastic_job_is_admitted_whole_at_max_or_waits(platform, cli, tmp_path, clean):
    """What Kueue 0.19 does with `nodes: MIN:MAX` (docs/teams.md): the JobSet's worker Job has MAX pods, Kueue
    reserves quota for all MAX and admits nothing less; with fewer than MAX GPUs free the job waits, even though
    MIN would fit (no partial admission for JobSets)."""
    assert submit(cli, platform, tmp_path, name="elastic", nodes="1:2")[0] == 0
    wait_for("'elastic' admitted", lambda: admitted(platform, "elastic"))
    (assignment,) = workload_of(platform, "elastic")["status"]["admission"]["podSetAssignments"]
    assert assignment["count"] == 2
    wait_for("Kueue to count 2 GPUs reserved", lambda: gpu_usage(platform) == 2)
    assert submit(cli, platform, tmp_path, name="filler", nodes="1:1")[0] == 0
    wait_for("'filler' admitted", lambda: admitted(platform, "filler"))
    wait_for("Kueue to count 3 GPUs reserved", lambda: gpu_usage(platform) == 3)
    assert submit(cli, platform, tmp_path, name="elastic2", nodes="1:2")[0] == 0
    wl = wait_for("Kueue's verdict on 'elastic2'", lambda: (w := workload_of(platform, "elastic2")) and
                  condition(w, "QuotaReserved") and w)
    assert condition(wl, "QuotaReserved")["status"] == "False"
    assert gpu_usage(platform) == 3 and not pods_of(platform, "elastic2")  # nothing more was reserved


def test_rbac_a_viewer_cannot_submit_and_another_team_cannot_see(platform, cli, tmp_path, clean):
    code, _, err = submit(cli, platform, tmp_path, user="vera", name="sneaky")
    assert code != 0 and 'User "vera" cannot create resource "jobsets"' in err, err
    assert platform.get(*JOBSET, "sneaky", NS) is None
    assert submit(cli, platform, tmp_path, name="private", nodes="1:1")[0] == 0
    code, out, err = cli("status", "private", "--kubeconfig", platform.kubeconfigs["vera"])
    assert code == 0, err  # a viewer of research may follow it
    code, _, err = cli("status", "private", "--team", "research", "--kubeconfig", platform.kubeconfigs["mallory"])
    assert code != 0 and 'User "mallory" cannot' in err, err
    # bob submits for platform; research's alice cannot read platform's jobs (aws-dev makes ml-platform a viewer
    # of research, not the other way round).
    code, _, err = submit(cli, platform, tmp_path, user="bob", name="platjob", team="platform", pool="l40s-spot")
    assert code == 0, err
    code, _, err = cli("status", "platjob", "--team", "platform", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code != 0 and 'User "alice" cannot' in err, err


def test_apply_dry_run_with_a_platform_file_compares_with_the_cluster(platform, cli, tmp_path, clean):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "jobs" / "research").mkdir(parents=True)
    spec = job_spec(repo / "jobs" / "research", name="gitjob", nodes="1:1")
    job_spec(repo / "jobs" / "research", name="keeper", nodes="1:1")
    for args in (["init", "-q"], ["config", "user.email", "ci@example.com"], ["config", "user.name", "ci"],
                 ["add", "-A"], ["commit", "-q", "-m", "gitjob"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    jobs, contract = repo / "jobs", platform.contract_file
    alice = platform.kubeconfigs["alice"]
    code, out, err = cli("apply", jobs, "--dry-run", "--platform", contract, "--kubeconfig", alice)
    assert code == 0, err
    assert "create     research/gitjob" in out and "create     research/keeper" in out and not err
    assert cli("apply", jobs, "--kubeconfig", alice)[0] == 0
    code, out, err = cli("apply", jobs, "--dry-run", "--platform", contract, "--kubeconfig", alice)
    assert code == 0, err
    assert "unchanged  research/gitjob" in out and "unchanged  research/keeper" in out
    spec.unlink()
    subprocess.run(["git", "commit", "-qam", "gone"], cwd=repo, check=True, capture_output=True)
    code, out, err = cli("apply", jobs, "--dry-run", "--prune", "--platform", contract, "--kubeconfig", alice)
    assert "cancel     research/gitjob" in out and "unchanged  research/keeper" in out, out + err
    # No kubeconfig at all: it says that it did not look, and every job shows as create.
    code, out, err = cli("apply", jobs, "--dry-run", "--platform", contract)
    assert code == 0 and "not compared with a cluster" in err and "create     research/keeper" in out


def _fail(platform, pod, exit_code: int) -> None:
    """kwok's chaos stage ends the pod's containers with this exit code (tools/cluster/controllers.py)."""
    from tools.cluster.controllers import FAIL_EXIT_CODE, FAIL_LABEL

    platform.core().patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace, {"metadata": {
        "labels": {FAIL_LABEL: "true"}, "annotations": {FAIL_EXIT_CODE: str(exit_code)}}})


def test_bad_input_exit_2_fails_the_jobset_at_once(platform, cli, tmp_path, clean):
    """docs/deploy-job.md: exit code 2 (bad input) fails the Job at once (podFailurePolicy FailJob) and so the
    JobSet (failurePolicy on reason PodFailurePolicy), with no restart."""
    assert submit(cli, platform, tmp_path, name="badinput", nodes="2:2")[0] == 0
    pods = wait_for("both pods Running", lambda: len(running_pods(platform, "badinput")) == 2 and
                    running_pods(platform, "badinput"))
    _fail(platform, pods[0], 2)
    js = wait_for("the JobSet Failed", lambda: condition(platform.get(*JOBSET, "badinput", NS), "Failed"))
    assert js["status"] == "True"
    assert (platform.get(*JOBSET, "badinput", NS).get("status") or {}).get("restarts", 0) == 0
    code, out, err = cli("status", "badinput", "--kubeconfig", platform.kubeconfigs["alice"])
    assert code == 0 and "job badinput in team-research: Failed" in out, out + err


def test_any_other_failure_is_retried_by_the_job(platform, cli, tmp_path, clean):
    """Exit code 1 counts against the worker Job's backoffLimit: the Job replaces the pod under the same index."""
    assert submit(cli, platform, tmp_path, name="flaky", nodes="1:1")[0] == 0
    (pod,) = wait_for("the pod Running", lambda: running_pods(platform, "flaky"))
    _fail(platform, pod, 1)
    wait_for("a new pod for index 0", lambda: [p for p in running_pods(platform, "flaky")
                                               if p.metadata.uid != pod.metadata.uid])
    assert condition(platform.get(*JOBSET, "flaky", NS), "Failed") is None
