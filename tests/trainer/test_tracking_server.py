"""The tracker against a real MLflow server on localhost: `.venv/bin/pytest tests/trainer/test_tracking_server.py -q`.

One `mlflow server` process (SQLite backend, proxied artifacts in a temp dir) serves the module; the outage
test kills it and starts it again on the same port and backend.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpu_train.spec.trainer_config import TrackingConfig
from trainer.tracking import (
    TAG_CHECKPOINT_URI,
    TAG_DATASET_MANIFEST,
    TAG_DATASET_URI,
    TAG_IMAGE_DIGEST,
    TAG_RESUMES,
    Tracker,
    TrackerOptions,
)

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = Path(sys.executable).with_name("mlflow")
FAST = TrackerOptions(start_timeout_s=20, flush_timeout_s=60)

pytestmark = pytest.mark.slow


class LocalServer:
    """`mlflow server` on 127.0.0.1 with a SQLite backend; stop() and start() keep port and data."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [
            str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"), "--serve-artifacts",
            "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
        ]
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"mlflow server did not become healthy: {(self.root / 'server.log').read_text()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # The whole process group: uvicorn runs the app in a child process.
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LocalServer(tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    yield srv
    srv.stop()


def _tracker(server: LocalServer, run_dir: Path, experiment: str, **kw) -> Tracker:
    return Tracker.create(TrackingConfig(uri=server.uri, experiment=experiment), run_dir=run_dir,
                          options=FAST, **kw)


def _steps(client: MlflowClient, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_run_logs_params_metrics_and_artifacts(server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_IMAGE_DIGEST", "sha256:" + "cd" * 32)
    tracker = _tracker(server, tmp_path / "run-a", "params-metrics")
    assert tracker.run_id  # opened on the first try, ready for the first checkpoint
    tracker.log_params({"train": {"lr": 3e-4, "steps": 20}, "model.norm": "rmsnorm"})
    tracker.set_tags({TAG_DATASET_URI: "synthetic"})
    for step in range(0, 20, 2):
        tracker.log_metrics({"loss": 4.0 / (step + 1), "tokens_per_s": 1000.0 + step, "mfu": 0.3}, step=step)
    plot = tmp_path / "loss.png"
    plot.write_bytes(b"\x89PNG fake plot bytes")
    tracker.log_artifact(plot)
    tracker.log_checkpoint(10, "s3://bucket/run-a/step_00000010")
    tracker.close()

    client = MlflowClient(server.uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.lr": "0.0003", "train.steps": "20", "model.norm": "rmsnorm"}
    assert run.data.tags[TAG_IMAGE_DIGEST] == "sha256:" + "cd" * 32
    assert run.data.tags[TAG_DATASET_URI] == "synthetic"
    assert run.data.tags[TAG_CHECKPOINT_URI] == "s3://bucket/run-a/step_00000010"
    assert _steps(client, tracker.run_id, "tokens_per_s") == list(range(0, 20, 2))
    names = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert {"loss.png", "checkpoints"} <= names
    record = client.download_artifacts(tracker.run_id, "checkpoints/step_00000010.json", str(tmp_path))
    assert "s3://bucket/run-a/step_00000010" in Path(record).read_text()
    assert tracker.run_id in tracker.ui_hint()


KILLED_WORKER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from gpu_train.spec.trainer_config import TrackingConfig
    from trainer.tracking import Tracker, TrackerOptions
    uri, run_dir, last = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    t = Tracker.create(TrackingConfig(uri=uri, experiment="resume"), run_dir=run_dir,
                       options=TrackerOptions(start_timeout_s=20))
    print(t.run_id, flush=True)
    for step in range(last + 1):
        t.log_metrics({"loss": 10.0 - step}, step=step)
    assert t.flush(60)
    os.kill(os.getpid(), signal.SIGKILL)  # like a preempted node: no close(), run left RUNNING
""")


def test_kill_and_resume_continues_one_run_without_duplicate_steps(server, tmp_path):
    run_dir = tmp_path / "run-r"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WORKER, server.uri, str(run_dir), "14"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run_id = proc.stdout.split()[0]
    client = MlflowClient(server.uri)
    assert client.get_run(run_id).info.status == "RUNNING"

    # The newest checkpoint was at step 9: steps 10..14 run again after the restart, then 15..24 are new.
    resumed = _tracker(server, run_dir, "resume", resume_run_id=run_id)
    assert resumed.run_id == run_id
    for step in range(10, 25):
        resumed.log_metrics({"loss": 20.0 - step, "lr": 1e-3}, step=step)
    resumed.close()

    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    steps = _steps(client, run_id)
    assert steps == list(range(25))  # strictly unique and increasing: nothing logged twice
    # Steps 10..14 kept the values from before the kill; the replays were not sent.
    values = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert values[12] == 10.0 - 12 and values[20] == 20.0 - 20
    assert _steps(client, run_id, "lr") == list(range(10, 25))  # a key new after resume is not filtered
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags[TAG_RESUMES] == "1"


def test_register_model_with_lineage_tags(server, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_IMAGE_DIGEST", "sha256:" + "ef" * 32)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(os.urandom(2048))
    (model_dir / "config.json").write_text('{"n_layer": 2}')
    tracker = _tracker(server, tmp_path / "run-m", "registry")
    tracker.log_checkpoint(40, "gs://bucket/run-m/step_00000040")
    tracker.register_model(model_dir, "tiny-gpt", {
        TAG_DATASET_URI: "s3://data/owt/manifest.json", TAG_DATASET_MANIFEST: "9f" * 32,
        "config": '{"model": {"n_layer": 2}}',
    })
    tracker.close()

    client = MlflowClient(server.uri)
    versions = client.search_model_versions("name='tiny-gpt'")
    assert len(versions) == 1
    version = versions[0]
    assert version.run_id == tracker.run_id and version.status == "READY"
    assert version.tags == {
        TAG_DATASET_URI: "s3://data/owt/manifest.json", TAG_DATASET_MANIFEST: "9f" * 32,
        "config": '{"model": {"n_layer": 2}}', TAG_IMAGE_DIGEST: "sha256:" + "ef" * 32,
        TAG_CHECKPOINT_URI: "gs://bucket/run-m/step_00000040",
        **({k: v for k, v in version.tags.items() if k == "mlflow.source.git.commit"}),
    }
    files = {a.path for a in client.list_artifacts(tracker.run_id, "model")}
    assert files == {"model/model.safetensors", "model/config.json"}


def test_server_outage_does_not_stop_training_and_logging_resumes(server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer.tracking")
    tracker = _tracker(server, tmp_path / "run-o", "outage")
    run_id = tracker.run_id
    for step in range(10):
        tracker.log_metrics({"loss": 1.0}, step=step)
    assert tracker.flush(30)

    server.stop()
    completed = 0
    for step in range(10, 40):  # the "training loop" while the server is down
        tracker.log_metrics({"loss": 0.5}, step=step)
        time.sleep(0.02)
        completed += 1
    assert completed == 30 and not tracker.flush(0.5)
    assert any("is unreachable" in r.getMessage() for r in caplog.records)

    server.start()
    for step in range(40, 50):
        tracker.log_metrics({"loss": 0.25}, step=step)
    tracker.close()

    client = MlflowClient(server.uri)
    assert _steps(client, run_id) == list(range(50))  # buffered points arrived, later ones too
    messages = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable" in m for m in messages) == 1  # one warning for the whole outage
    assert sum("reachable again" in m for m in messages) == 1
    assert client.get_run(run_id).info.status == "FINISHED"


def _train(server: LocalServer, run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run_dir),
           f"train.steps={steps}", "checkpoint.every_steps=5", "data.uri=synthetic", f"tracking.uri={server.uri}",
           "tracking.experiment=e2e", "tracking.log_every=2", *extra]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["TRAINER_IMAGE_DIGEST"] = "sha256:" + "12" * 32
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_python_m_trainer_logs_registers_and_resumes_one_run(server, tmp_path):
    run_dir = tmp_path / "run"
    first = _train(server, run_dir, 12, "tracking.register_name=tiny-e2e")
    client = MlflowClient(server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    run_id = run.info.run_id
    assert run_id in first.stdout  # the end-of-run text says where the run is
    assert run.data.params["model.n_layer"] and run.data.params["data.uri"] == "synthetic"
    assert run.data.tags[TAG_DATASET_URI] == "synthetic" and run.data.tags[TAG_IMAGE_DIGEST].endswith("12" * 32)
    assert {"loss.png", "summary.json", "checkpoints", "model"} <= {a.path for a in client.list_artifacts(run_id)}
    # The step-time split and throughput; MFU is None on a CPU (unknown peak) and so not logged there.
    assert {"loss", "tokens_per_s", "data_wait_s", "forward_backward_s", "optimizer_s"} <= run.data.metrics.keys()
    (version,) = client.search_model_versions("name='tiny-e2e'")
    assert version.run_id == run_id and version.tags[TAG_DATASET_URI] == "synthetic"
    assert version.tags[TAG_DATASET_MANIFEST] and version.tags[TAG_IMAGE_DIGEST].endswith("12" * 32)
    logged_before = _steps(client, run_id)
    assert logged_before[-1] == 12

    # As if the job died before its last checkpoint: the restart resumes at step 10 and runs 11..12 again.
    shutil.rmtree(run_dir / "checkpoints" / "step_000000012")
    second = _train(server, run_dir, 16)
    assert "resumed from" in second.stdout + second.stderr
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    steps = _steps(client, run_id)
    assert steps == sorted(set(steps)) and steps[: len(logged_before)] == logged_before and steps[-1] == 16
    assert client.get_run(run_id).data.tags[TAG_RESUMES] == "1"
