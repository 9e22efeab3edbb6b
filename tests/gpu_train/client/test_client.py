"""The Python client (gpu_train.client) against the same fake API server as the command's tests: submit a spec file,
a mapping and a JobSpec, follow the job (status, logs, wait), pause, resume and cancel it; the same checks and
errors as `gpu-train`, which prints what the client returns.

Run: .venv/bin/pytest tests/gpu_train/client -q
"""

from __future__ import annotations

import json

import pytest
import yaml

from gpu_train.client import Client, ClientError, JobStatus
from gpu_train.spec.job import read_job
from tests.gpu_train.cli.conftest import ALICE, IMAGE, REGISTRY, spec
from tests.gpu_train.cli.fake_api import pod
from tools.validation import crd


def _client(api, tmp_path, **kw) -> Client:
    return Client(kubeconfig=api.kubeconfig(tmp_path, ALICE, "team-research"), **kw)


def _running(api, name: str) -> None:
    """Kueue admits the job and its two pods run; rank 0 has logged three steps."""
    (wl,) = api.of("workloads", "team-research")
    wl["status"] = {"conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted", "message": "",
                                    "lastTransitionTime": "2026-03-01T10:01:00Z"}],
                    "admission": {"clusterQueue": "team-research", "podSetAssignments": [
                        {"name": "worker", "flavors": {"nvidia.com/gpu": "l4-spot"}, "count": 2}]}}
    js = api.get("jobsets", "team-research", name)
    for rank in (0, 1):
        api.put("pods", pod(js, rank))
    api.logs[("team-research", pod(js, 0)["metadata"]["name"], "trainer")] = "step 1\nstep 2\nstep 3\n"


def test_submit_status_logs_and_cancel(api, tmp_path):
    client = _client(api, tmp_path)
    assert client.team == "research"  # the kubeconfig context's namespace
    job = client.submit(spec(tmp_path))
    assert (job.name, job.team, job.submitted.created) == ("gpt2-smoke", "research", True)
    (post,) = [r for r in api.requests if r[0] == "POST"]
    assert post[1] == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/team-research/jobsets"
    assert post[3] == job.manifest and crd.validate(post[3]).problems == []

    st = job.status()
    assert isinstance(st, JobStatus) and (st.state, st.queue, st.pods) == ("Queued", "research-queue", [])
    assert not st.finished
    _running(api, "gpt2-smoke")
    st = client.status("gpt2-smoke")
    assert st.state == "Running" and [p.rank for p in st.pods] == ["0", "1"]
    assert st.notes == ["admitted by cluster queue team-research on pool l4-spot"]
    assert "".join(job.logs()) == "step 1\nstep 2\nstep 3\n"
    assert "".join(client.logs("gpt2-smoke", tail=1)) == "step 3\n"

    job.cancel()
    (delete,) = [r for r in api.requests if r[0] == "DELETE"]
    assert delete[1].endswith("/namespaces/team-research/jobsets/gpt2-smoke")
    assert api.get("jobsets", "team-research", "gpt2-smoke") is None
    with pytest.raises(ClientError, match="no job 'gpt2-smoke' in team-research"):
        job.status()


def test_pause_and_resume_set_the_workloads_active_field(api, tmp_path):
    client = _client(api, tmp_path)
    job = client.submit(spec(tmp_path))
    assert job.pause() == "research-queue"
    (wl,) = api.of("workloads", "team-research")
    assert wl["spec"]["active"] is False and job.status().state == "Paused"
    job.resume()
    (wl,) = api.of("workloads", "team-research")
    assert wl["spec"]["active"] is True and job.status().state == "Queued"


def test_a_mapping_or_a_jobspec_is_submitted_like_a_file(api, tmp_path):
    raw = yaml.safe_load(spec(tmp_path).read_text())
    client = _client(api, tmp_path)
    from_mapping = client.submit({**raw, "name": "from-mapping"})
    from_model = client.submit(read_job({**raw, "name": "from-model"}, key="job"))
    names = {js["metadata"]["name"] for js in api.of("jobsets", "team-research")}
    assert names == {"from-mapping", "from-model"}
    # The same JobSet as the file's, but for the name (the file adds its path to the provenance annotations).
    a, b = (dict(j.manifest) for j in (from_mapping, from_model))
    for m in (a, b):
        m["metadata"] = {k: v for k, v in m["metadata"].items() if k != "annotations"}
    assert json.dumps(a).replace("from-mapping", "X") == json.dumps(b).replace("from-model", "X")


def test_a_dry_run_with_a_contract_file_needs_no_cluster(tmp_path, doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    job = Client(platform=platform).submit(spec(tmp_path), dry_run=True)
    assert not job.submitted.created and job.manifest["kind"] == "JobSet"
    assert job.manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == IMAGE
    assert job.submitted.estimate.startswith("carbon: ~")


def test_the_checks_are_the_commands(api, tmp_path):
    client = _client(api, tmp_path)
    with pytest.raises(ClientError, match=r"job.pool 'h100' is not one of gpuPools\[\].name") as err:
        client.submit(spec(tmp_path, pool="h100"))
    assert err.value.code == 2
    with pytest.raises(ClientError, match="team namespaces admit only images from the platform registry"):
        client.submit(spec(tmp_path), image="docker.io/library/python@sha256:" + "1" * 64)
    mine = REGISTRY + "research/custom@sha256:" + "2" * 64
    job = client.submit(spec(tmp_path), image=mine)
    assert job.manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == mine
    with pytest.raises(ClientError, match="already exists in team-research") as err:
        client.submit(spec(tmp_path))
    assert err.value.code == 1
    with pytest.raises(ClientError, match="is not a job name"):
        client.status("Not_A_Name")


def test_wait_follows_the_job_until_it_ends(api, tmp_path):
    client = _client(api, tmp_path)
    job = client.submit(spec(tmp_path))
    seen: list[str] = []

    def poll(_seconds: float) -> None:
        """Between polls the job moves on: admitted, then completed (as the JobSet controller marks it)."""
        if len(seen) == 1:
            _running(api, "gpt2-smoke")
        else:
            js = api.get("jobsets", "team-research", "gpt2-smoke")
            js["status"] = {"conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                                            "message": "", "lastTransitionTime": "2026-03-01T11:00:00Z"}]}

    final = job.wait(poll_s=1, on_change=lambda st: seen.append(st.state), sleep=poll)
    assert final.state == "Completed" and final.finished and seen == ["Queued", "Running", "Completed"]
    ticks = iter(range(100))
    with pytest.raises(TimeoutError, match="still Queued"):
        client.submit(spec(tmp_path, name="slow")).wait(timeout_s=2, poll_s=1, clock=lambda: next(ticks),
                                                        sleep=lambda s: None)
