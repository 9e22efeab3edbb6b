"""`gpu-train status` against the fake API server: what it reads (Kueue's Workload found by its owner, its visibility
API, rank 0's metrics through the pod proxy); an API server that cannot be reached; the progress line from the
trainer's metrics. `list`, `pause`, `resume`, `cancel` and their refusals on a real API server:
tests/cluster/test_cli_jobs.py.

Run: .venv/bin/pytest tests/gpu_train/cli/test_jobs.py -q
"""

from __future__ import annotations

import socket

import pytest
import yaml

from gpu_train.client import status as jobs
from tests.gpu_train.cli.conftest import ALICE, only_error_lines, requests_of, spec
from tests.gpu_train.cli.fake_api import pod

METRICS = """# HELP trainer_step Last completed optimizer step
# TYPE trainer_step gauge
trainer_step 120.0
# HELP trainer_loss Training loss of the last step (mean over the global batch)
# TYPE trainer_loss gauge
trainer_loss 3.41234
# HELP trainer_tokens_per_second Global training throughput in tokens per second
# TYPE trainer_tokens_per_second gauge
trainer_tokens_per_second 16384.0
# HELP trainer_tokens_total Tokens trained on since this process started (global)
# TYPE trainer_tokens_total counter
trainer_tokens_total 7.86432e+06
"""


@pytest.fixture
def submitted(api, tmp_path, cli):
    """gpt2-smoke submitted by alice (the fake API made its Workload, as Kueue does)."""
    kubeconfig = api.kubeconfig(tmp_path, ALICE, "team-research")
    assert cli("submit", spec(tmp_path), "--kubeconfig", kubeconfig)[0] == 0
    api.requests.clear()
    return kubeconfig


def _workload(api):
    (wl,) = api.of("workloads", "team-research")
    return wl


def _admit(api, jobset_name="gpt2-smoke"):
    wl = _workload(api)
    wl["status"] = {"conditions": [
        {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "Quota reserved in "
         "ClusterQueue team-research", "lastTransitionTime": "2026-03-01T10:01:00Z"},
        {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "The workload is admitted",
         "lastTransitionTime": "2026-03-01T10:01:00Z"}],
        "admission": {"clusterQueue": "team-research", "podSetAssignments": [
            {"name": "worker", "flavors": {"cpu": "l4-spot", "memory": "l4-spot", "nvidia.com/gpu": "l4-spot"},
             "resourceUsage": {"nvidia.com/gpu": "2"}, "count": 2}]}}
    js = api.get("jobsets", "team-research", jobset_name)
    for rank in (0, 1):
        api.put("pods", pod(js, rank))
    api.metrics[("team-research", pod(js, 0)["metadata"]["name"], 9400)] = METRICS


def test_status_of_a_queued_job_gives_its_position_from_kueues_visibility_api(api, submitted, cli):
    wl = _workload(api)
    api.pending[("team-research", "research-queue")] = [
        {"metadata": {"name": "jobset-other-00000"}, "priority": 0, "localQueueName": "research-queue",
         "positionInClusterQueue": 0, "positionInLocalQueue": 0},
        {"metadata": {"name": wl["metadata"]["name"]}, "priority": 0, "localQueueName": "research-queue",
         "positionInClusterQueue": 3, "positionInLocalQueue": 1}]
    code, out, err = cli("status", "gpt2-smoke", "--kubeconfig", submitted)
    assert code == 0, err
    assert "job gpt2-smoke in team-research: Queued" in out
    assert "position 2 in queue research-queue, 4 in its cluster queue" in out
    assert "Kueue: couldn't assign flavors to pod set worker: insufficient unused quota" in out
    # The Workload was found by the JobSet's UID label, then its owner reference.
    (listing,) = requests_of(api, "GET", "/workloads")
    uid = api.get("jobsets", "team-research", "gpt2-smoke")["metadata"]["uid"]
    assert listing[2]["labelSelector"] == [f"kueue.x-k8s.io/job-uid={uid}"]


def test_status_survives_a_visibility_api_that_does_not_answer(api, submitted, cli):
    api.visibility_served = False
    code, out, _ = cli("status", "gpt2-smoke", "--kubeconfig", submitted)
    assert code == 0 and "queue position unknown (Kueue's visibility API: 503" in out


def test_status_of_a_running_job_reads_rank_0s_metrics_through_the_pod_proxy(api, submitted, cli):
    _admit(api)
    code, out, err = cli("status", "gpt2-smoke", "--kubeconfig", submitted)
    assert code == 0, err
    assert "job gpt2-smoke in team-research: Running" in out
    assert "admitted by cluster queue team-research on pool l4-spot" in out
    assert "rank 0  gpt2-smoke-worker-0-0-x7k2p  Running" in out and "rank 1  gpt2-smoke-worker-0-1-x7k2p" in out
    # 80 steps left x 65536 tokens / 16384 tokens/s = 320 s.
    assert "step 120/200  loss 3.4123  tokens/s 16,384  ETA 0:05:20" in out
    (proxy,) = requests_of(api, "GET", "/proxy/")
    assert proxy[1] == "/api/v1/namespaces/team-research/pods/gpt2-smoke-worker-0-0-x7k2p:9400/proxy/metrics"


def test_a_trainer_not_serving_metrics_yet_leaves_the_rest_of_the_status(api, submitted, cli):
    _admit(api)
    api.metrics.clear()
    code, out, err = cli("status", "gpt2-smoke", "--kubeconfig", submitted)
    assert code == 0, err
    assert "rank 0  gpt2-smoke-worker-0-0-x7k2p  Running" in out
    assert "no progress yet:" in out and "503" in out


def test_an_unreachable_api_server(tmp_path, cli):
    """A kubeconfig whose server is a loopback port nothing listens on: the connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"https://127.0.0.1:{port}"
    kubeconfig = tmp_path / "gone.yaml"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "gone", "namespace": "team-research"}}],
        "users": [{"name": "gone", "user": {"token": "unused"}}]}))
    code, _, err = cli("list", "--kubeconfig", kubeconfig)
    assert code == 1 and only_error_lines(err)
    assert f"cannot reach the Kubernetes API server at {server} to list jobsets: [Errno " in err
    assert "Connection refused" in err


def test_progress_and_metrics_parsing():
    metrics = jobs.read_metrics(METRICS)
    assert metrics == {"trainer_step": 120.0, "trainer_loss": 3.41234, "trainer_tokens_per_second": 16384.0}
    assert jobs.progress(metrics, 200, 65536) == "step 120/200  loss 3.4123  tokens/s 16,384  ETA 0:05:20"
    assert jobs.progress({}, 200, 65536) == "no step yet"
    assert jobs.progress({"trainer_step": 5.0, "trainer_loss": float("nan")}, None, None) == "step 5"
