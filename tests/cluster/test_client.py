"""The Python client (gpu_train.client) against the real control plane, as alice: submit a spec file, a mapping and a
JobSpec (the API server stores what the client rendered), follow the job (status, wait) while Kueue queues, admits
and the JobSet controller fails it, pause, resume and cancel it; the same checks and errors as `gpu-train`, which
prints what the client returns.

Run: .venv/bin/pytest -p no:xdist tests/cluster/test_client.py -q

Reading logs (Client.logs, Job.logs) is not done here: the API server does not proxy to kwok's pods. `gpu-train logs`,
which prints what Client.logs returns, is tested in tests/gpu_train/cli/test_logs.py. A job stays queued because
another one holds the team's four GPUs. `clean` empties the team namespaces around each test.
"""

from __future__ import annotations

import json

import pytest
import yaml

from gpu_train.client import Client, ClientError, JobStatus
from gpu_train.jobs import gitops
from gpu_train.spec.job import read_job
from tests.cluster.conftest import job_spec, wait_for
from tests.cluster.jobs import (
    JOBSET,
    NS,
    WORKLOAD,
    delete_jobset,
    fail_pod,
    is_true,
    jobset_of,
    pending,
    running_pods,
    workload_of,
)


def _container(manifest) -> dict:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


def _stored_as_rendered(platform, job) -> bool:
    """The API server kept every field the client rendered; what it and Kueue added is not drift."""
    return gitops.drift(dict(job.manifest), jobset_of(platform, job.name)) == []


def _fill_the_quota(platform, client, tmp_path) -> None:
    client.submit(job_spec(tmp_path, name="cl-filler", nodes="4:4"))
    wait_for("'cl-filler' admitted", lambda: is_true(workload_of(platform, "cl-filler"), "Admitted"))


@pytest.fixture
def client(platform) -> Client:
    return Client(kubeconfig=str(platform.kubeconfigs["alice"]))


def test_submit_status_and_cancel(platform, client, tmp_path, clean):
    assert client.team == "research"  # the kubeconfig context's namespace
    _fill_the_quota(platform, client, tmp_path)
    job = client.submit(job_spec(tmp_path, name="cl-first", nodes="2:2"))
    assert (job.name, job.team, job.submitted.created) == ("cl-first", "research", True)
    assert _stored_as_rendered(platform, job)
    wait_for("'cl-first' waiting behind the filler", lambda: pending(platform, "cl-first"))
    st = job.status()
    assert isinstance(st, JobStatus) and (st.state, st.queue, st.pods) == ("Queued", "research-queue", [])
    assert not st.finished
    client.cancel("cl-filler")
    pods = wait_for("both pods of 'cl-first' Running", lambda: len(p := running_pods(platform, "cl-first")) == 2 and p)
    st = client.status("cl-first")
    assert st.state == "Running" and sorted(p.rank for p in st.pods) == ["0", "1"]
    assert {p.name for p in st.pods} == {p.metadata.name for p in pods}
    assert st.notes[0] == "admitted by cluster queue team-research on pool l4-spot"

    job.cancel()
    wait_for("the JobSet gone", lambda: jobset_of(platform, "cl-first") is None)
    with pytest.raises(ClientError, match="no job 'cl-first' in team-research"):
        job.status()


def test_pause_and_resume_set_the_workloads_active_field(platform, client, tmp_path, clean):
    job = client.submit(job_spec(tmp_path, name="cl-pause"))
    wait_for("'cl-pause' admitted", lambda: is_true(workload_of(platform, "cl-pause"), "Admitted"))
    name = workload_of(platform, "cl-pause")["metadata"]["name"]
    assert job.pause() == "research-queue"
    assert platform.get(*WORKLOAD, name, NS)["spec"]["active"] is False and job.status().state == "Paused"
    job.resume()
    assert platform.get(*WORKLOAD, name, NS)["spec"]["active"] is True
    wait_for("Kueue to admit it again", lambda: job.status().state == "Running")


def test_a_mapping_or_a_jobspec_is_submitted_like_a_file(platform, client, tmp_path, clean):
    raw = yaml.safe_load(job_spec(tmp_path, name="cl-file").read_text())
    from_mapping = client.submit({**raw, "name": "cl-mapping"})
    from_model = client.submit(read_job({**raw, "name": "cl-model"}, key="job"))
    assert {js["metadata"]["name"] for js in platform.list(*JOBSET, NS)} == {"cl-mapping", "cl-model"}
    assert _stored_as_rendered(platform, from_mapping) and _stored_as_rendered(platform, from_model)
    # The same JobSet as the file's, but for the name (the file adds its path to the provenance annotations).
    a, b = (dict(j.manifest) for j in (from_mapping, from_model))
    for m in (a, b):
        m["metadata"] = {k: v for k, v in m["metadata"].items() if k != "annotations"}
    assert json.dumps(a).replace("cl-mapping", "X") == json.dumps(b).replace("cl-model", "X")


def test_the_checks_are_the_commands(platform, client, tmp_path, clean):
    with pytest.raises(ClientError, match=r"job.pool 'h100' is not one of gpuPools\[\].name") as err:
        client.submit(job_spec(tmp_path, name="cl-checked", pool="h100"))
    assert err.value.code == 2
    with pytest.raises(ClientError, match="team namespaces admit only images from the platform registry"):
        client.submit(job_spec(tmp_path, name="cl-checked"), image="docker.io/library/python@sha256:" + "1" * 64)
    assert platform.list(*JOBSET, NS) == []
    (registry,) = platform.contract["registries"]
    mine = registry + "research/custom@sha256:" + "2" * 64
    job = client.submit(job_spec(tmp_path, name="cl-checked"), image=mine)
    assert _container(job.manifest)["image"] == mine == _container(jobset_of(platform, "cl-checked"))["image"]
    with pytest.raises(ClientError, match="already exists in team-research") as err:
        client.submit(job_spec(tmp_path, name="cl-checked"))
    assert err.value.code == 1
    with pytest.raises(ClientError, match="is not a job name"):
        client.status("Not_A_Name")


def test_wait_follows_the_job_until_it_ends(platform, client, tmp_path, clean):
    _fill_the_quota(platform, client, tmp_path)
    slow = client.submit(job_spec(tmp_path, name="cl-slow"))
    wait_for("'cl-slow' waiting behind the filler", lambda: pending(platform, "cl-slow"))
    ticks = iter(range(100))
    with pytest.raises(TimeoutError, match="still Queued"):
        slow.wait(timeout_s=2, poll_s=1, clock=lambda: next(ticks), sleep=lambda s: None)
    slow.cancel()
    job = client.submit(job_spec(tmp_path, name="cl-wait"))
    wait_for("'cl-wait' waiting behind the filler", lambda: pending(platform, "cl-wait"))
    seen: list[str] = []

    def poll(_seconds: float) -> None:
        """Between polls the job moves on: the filler goes and Kueue admits it; then its pod ends with exit code
        2 (kwok's failure stage), which fails the JobSet at once (docs/deploy-job.md)."""
        if len(seen) == 1:
            delete_jobset(platform, "cl-filler")
            wait_for("'cl-wait' Running", lambda: running_pods(platform, "cl-wait"))
        else:
            (pod,) = running_pods(platform, "cl-wait")
            fail_pod(platform, pod, 2)
            wait_for("the JobSet Failed", lambda: is_true(jobset_of(platform, "cl-wait"), "Failed"))

    final = job.wait(poll_s=1, on_change=lambda st: seen.append(st.state), sleep=poll)
    assert final.state == "Failed" and final.finished and seen == ["Queued", "Running", "Failed"]
