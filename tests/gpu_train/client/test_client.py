"""The Python client (gpu_train.client) with no cluster: a dry run from a contract file. Against a cluster (submit,
status, wait, pause, resume, cancel) it is tests/cluster/test_client.py; how it words an API server's refusals,
test_cluster.py.

Run: .venv/bin/pytest tests/gpu_train/client -q
"""

from __future__ import annotations

import json

import pytest

from gpu_train.client import Client
from tests.gpu_train.cli.conftest import IMAGE, spec


def test_a_dry_run_with_a_contract_file_needs_no_cluster(tmp_path, doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    job = Client(platform=platform).submit(spec(tmp_path), dry_run=True)
    assert not job.submitted.created and job.manifest["kind"] == "JobSet"
    assert job.manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == IMAGE
    assert job.submitted.estimate.startswith("carbon: ~")


def test_a_pause_waits_for_kueues_workload_when_asked_and_refuses_at_once_otherwise(monkeypatch):
    # A sweep pauses a trial it may have created in its last pass, before Kueue made the Workload.
    from gpu_train.client import ClientError, jobs

    seen, patched = iter([None, None, {"metadata": {"name": "wl"}}]), []
    monkeypatch.setattr(jobs, "get_jobset", lambda *a: {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}}})
    monkeypatch.setattr(jobs, "find_workload", lambda *a: next(seen))
    monkeypatch.setattr(jobs, "patch_active", lambda s, team, wl, active: patched.append((wl["metadata"]["name"],
                                                                                           active)))
    monkeypatch.setattr(jobs, "WORKLOAD_POLL_S", 0.0)
    assert jobs.set_active(None, "research", "t", False, wait_s=60) == "q" and patched == [("wl", False)]
    seen = iter([None, {"metadata": {"name": "wl"}}])
    with pytest.raises(ClientError, match="has no Workload yet"):
        jobs.set_active(None, "research", "t", False)
    assert patched == [("wl", False)]
