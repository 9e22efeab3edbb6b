"""The sweep controller with cluster trials, against the fake API server and a local S3 server (moto): trials are
created as JobSets in the team's queue with the sweep priority class; a budget raised at a rung is an object in
the checkpoints bucket; a pause is the Workload PATCH `gpu-train pause` sends, and a promotion from a pause the
one `gpu-train resume` sends. The trainer's side (status.json at a rung) is written by the test.

Run: .venv/bin/pytest tests/gpu_train/cli/test_sweep_cluster.py -q
"""

from __future__ import annotations

import io
import json
import logging
import socket

import boto3
import pytest

from gpu_train.client.cluster import connect
from gpu_train.jobs.jobset import PRIORITY_LABEL, QUEUE_LABEL
from gpu_train.spec import naming
from gpu_train.spec.contract import PlatformContract
from gpu_train.sweeps.cluster import ClusterBackend
from gpu_train.sweeps.controller import Controller
from gpu_train.sweeps.spec import parse_sweep
from tests.gpu_train.cli.conftest import ALICE, contract_doc, requests_of
from tests.gpu_train.cli.test_sweep import SWEEP

pytestmark = pytest.mark.integration
BUCKET = "gpu-train-aws-dev-checkpoints"
RUNG = 655360  # 10 steps of 65,536 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture
def doc(s3_endpoint):
    d = contract_doc()
    d["endpoints"]["objectStore"] = s3_endpoint
    return d


def held(s3, trial: str, loss: float) -> None:
    """What the trainer writes when it holds at the rung."""
    s3.put_object(Bucket=BUCKET, Key=f"research/lr-sweep/{trial}/status.json", Body=json.dumps(
        {"state": "held", "tokens": RUNG, "evals": [{"step": 10, "tokens": RUNG, "val_loss": loss}],
         "val_loss": loss}).encode())


def budget(s3, trial: str) -> int:
    body = s3.get_object(Bucket=BUCKET, Key=f"research/lr-sweep/{trial}/budget.json")["Body"].read()
    return json.loads(body)["tokens"]


def active(api, trial: str) -> bool:
    (wl,) = [w for w in api.of("workloads", "team-research")
             if w["metadata"]["ownerReferences"][0]["name"] == trial]
    return wl["spec"].get("active", True)


def test_cluster_trials_are_queued_jobsets_paused_and_resumed_like_gpu_train_pause(api, doc, s3_endpoint, tmp_path):
    sweep = parse_sweep({**SWEEP, "algorithm": {"name": "random", "seed": 1, "earlyStopping": {
        "name": "asha", "minTokens": RUNG, "reductionFactor": 2}}, "trialConfig": {"numTrials": 4,
                                                                                   "parallelTrials": 2}}, "s.yaml")
    session = connect(str(api.kubeconfig(tmp_path, ALICE, "team-research")), None)
    contract = PlatformContract.from_document(doc, "test")
    backend = ClusterBackend(session, contract, sweep, source="s.yaml")
    controller = Controller(sweep, tmp_path / "sweep", backend, out=io.StringIO())
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)

    assert controller.step()
    jobsets = {j["metadata"]["name"]: j for j in api.of("jobsets", "team-research")}
    assert sorted(jobsets) == ["lr-sweep-t000", "lr-sweep-t001"]
    for j in jobsets.values():
        assert j["metadata"]["labels"][QUEUE_LABEL] == naming.local_queue_name("research")
        assert j["metadata"]["labels"][PRIORITY_LABEL] == naming.priority_class_name("sweep")
    assert budget(s3, "lr-sweep-t000") == budget(s3, "lr-sweep-t001") == RUNG

    held(s3, "lr-sweep-t000", 3.0)  # first at the rung: goes on in place
    held(s3, "lr-sweep-t001", 4.0)  # the best 2 // 2 = 1 of [3, 4] is 3: paused
    api.requests.clear()
    assert controller.step()
    assert budget(s3, "lr-sweep-t000") == 2 * RUNG
    (patch,) = requests_of(api, "PATCH", "/workloads/")
    assert patch[3] == {"spec": {"active": False}} and not active(api, "lr-sweep-t001")
    assert "lr-sweep-t002" in {j["metadata"]["name"] for j in api.of("jobsets", "team-research")}

    held(s3, "lr-sweep-t002", 5.0)  # [3, 4, 5]: paused; t003 starts
    assert controller.step()
    held(s3, "lr-sweep-t003", 6.0)  # [3, 4, 5, 6]: paused, and now the best 2 include t001's 4.0
    api.requests.clear()
    assert controller.step()
    patches = [r[3] for r in requests_of(api, "PATCH", "/workloads/")]
    assert {"spec": {"active": True}} in patches and active(api, "lr-sweep-t001")
    assert budget(s3, "lr-sweep-t001") == 2 * RUNG
    states = {t.id: t.state for t in controller.state.trials.values()}
    assert states == {"lr-sweep-t000": "running", "lr-sweep-t001": "running", "lr-sweep-t002": "paused",
                      "lr-sweep-t003": "paused"}
