"""How `gpu-train list` and `status` read a data preparation's RayJob (gpu_train/client/prepare.py) and print it
(gpu_train/cli/show.py): KubeRay's status fields to a state, and the rows and lines beside a JobSet's. Pure, no
cluster: what the API server and Kueue do with a RayJob is tested in tests/cluster/test_prepare_cluster.py.

Run: .venv/bin/pytest tests/gpu_train/client/test_prepare.py -q
"""

from __future__ import annotations

import io

import pytest

from gpu_train.cli import show
from gpu_train.client import prepare
from gpu_train.client.status import JobStatus, JobSummary, queue_state

ADMITTED = {"metadata": {"name": "rayjob-web-1"}, "spec": {"active": True},
            "status": {"conditions": [{"type": "Admitted", "status": "True"}]}}


@pytest.mark.parametrize(("status", "done", "state"), [
    ({}, None, "Running"),
    ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, None, "Running"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}, True, "Completed"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "FAILED"}, False, "Failed"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED"}, False, "Failed"),
    ({"jobDeploymentStatus": "Failed"}, False, "Failed"),
])
def test_kuberays_status_decides_whether_it_ended_and_kueue_the_rest(status, done, state):
    rayjob = {"kind": "RayJob", "metadata": {"name": "web"}, "status": status}
    assert prepare.ray_succeeded(rayjob) is done
    assert queue_state(prepare.ray_succeeded(rayjob), ADMITTED) == state


def test_kuberays_fields_are_shown_as_it_set_them_or_that_it_set_none():
    assert prepare.kuberay_notes({"status": {}}) == [
        "KubeRay has set no status on it yet (no Ray cluster before Kueue admits it)"]
    rayjob = {"status": {"jobDeploymentStatus": "Failed", "jobStatus": "", "reason": "DeadlineExceeded",
                         "message": "the Ray job did not finish in time", "startTime": "2026-01-01T00:00:00Z"}}
    assert prepare.kuberay_notes(rayjob) == [
        "KubeRay: jobDeploymentStatus Failed, reason DeadlineExceeded, message the Ray job did not finish in time"]


def test_list_shows_the_kind_of_each_row_and_status_names_a_data_preparation():
    out = io.StringIO()
    rows = [JobSummary(name="gpt2", state="Running", nodes="2", pool="l4-spot", age="5m"),
            JobSummary(name="web", state="Queued", nodes="3", pool="-", age="1m", kind=prepare.KIND)]
    assert show.job_list(rows, "research", out=out) == 0
    header, *lines = out.getvalue().splitlines()
    assert header.split() == ["NAME", "KIND", "STATE", "NODES", "POOL", "AGE", "COMMIT", "PATH", "HASH"]
    assert [line.split()[:5] for line in lines] == [["gpt2", "job", "Running", "2", "l4-spot"],
                                                    ["web", "prepare", "Queued", "3", "-"]]
    out = io.StringIO()
    st = JobStatus(name="web", namespace="team-research", state="Queued", queue="research-queue", kind=prepare.KIND,
                   notes=["Kueue: couldn't assign flavors"])
    show.job_status(st, out=out)
    assert out.getvalue() == "data preparation web in team-research: Queued\n  Kueue: couldn't assign flavors\n"


@pytest.mark.parametrize(("conditions", "done", "state"), [
    ([], None, "Running"),
    ([{"type": "Suspended", "status": "False"}], None, "Running"),
    # The Job controller's terminal conditions (k8s.io/api/batch/v1: JobComplete, JobFailed); FailureTarget and
    # SuccessCriteriaMet come first and are not the end yet.
    ([{"type": "FailureTarget", "status": "True"}], None, "Running"),
    ([{"type": "SuccessCriteriaMet", "status": "True"}, {"type": "Complete", "status": "True"}], True, "Completed"),
    ([{"type": "FailureTarget", "status": "True"}, {"type": "Failed", "status": "True",
                                                     "reason": "FailedIndexes"}], False, "Failed"),
    ([{"type": "Complete", "status": "False"}], None, "Running"),
])
def test_a_jobs_conditions_decide_whether_it_ended_and_kueue_the_rest(conditions, done, state):
    job = {"kind": "Job", "metadata": {"name": "web"}, "status": {"conditions": conditions}}
    assert prepare.succeeded(job) is done
    assert queue_state(prepare.succeeded(job), ADMITTED) == state


def test_the_jobs_counts_are_shown_as_the_job_controller_set_them_or_that_it_set_none():
    job = {"kind": "Job", "spec": {"completions": 3}, "status": {}}
    assert prepare.job_notes(job) == [
        "the Job controller has set no status on it yet (no member pods before Kueue admits it)"]
    job["status"] = {"active": 1, "succeeded": 1, "failed": 3, "failedIndexes": "2", "completedIndexes": "0"}
    assert prepare.job_notes(job) == ["Job: 1 of 3 members succeeded, 1 running, 3 pods failed, failed indexes 2"]
    job = {"kind": "Job", "spec": {"parallelism": 3}}
    assert prepare._pods(job) == 3
