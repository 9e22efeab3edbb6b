"""A real CPU run: the loss falls on the learnable synthetic data, every output is written, MLflow gets the run
and its id lands in the checkpoint; the Prometheus endpoint serves exactly the agreed metric names.

Run: .venv/bin/pytest tests/trainer/test_train.py -q
"""

from __future__ import annotations

import json
import math
import urllib.request

from tests.trainer.launch import SMALL, free_port, run_trainer, step_records, summary
from trainer.checkpoint import verify
from trainer.metrics import TrainerMetrics

INTERFACE_METRICS = [
    "trainer_step", "trainer_loss", "trainer_tokens_per_second", "trainer_mfu", "trainer_tokens_total",
    "trainer_step_seconds", "trainer_data_wait_seconds", "trainer_forward_backward_seconds",
    "trainer_optimizer_seconds", "trainer_checkpoint_blocking_seconds", "trainer_checkpoint_duration_seconds",
    "trainer_checkpoint_last_success_timestamp_seconds", "trainer_restarts_total",
    "trainer_last_step_timestamp_seconds",
]


def test_cpu_run_lowers_loss_and_writes_outputs(tmp_path):
    run_dir = tmp_path / "runs" / "learn"
    overrides = [o for o in SMALL if not o.startswith("tracking.")] + [
        "train.steps=40", "train.lr=1e-2", "train.min_lr=1e-3", "checkpoint.every_steps=20",
        "tracking.enabled=true", "tracking.log_every=5", "tracking.register_name=tiny-test",
    ]
    res = run_trainer(run_dir, None, overrides)
    assert res.returncode == 0, res.output[-4000:]

    records = step_records(run_dir)
    first, last = records[1]["loss"], summary(run_dir)["final_loss"]
    assert first > 5.0  # about ln(264) at initialisation
    assert last < first - 2.0, f"loss {first:.3f} -> {last:.3f}"
    result = summary(run_dir)
    assert set(result) >= {"step", "tokens", "final_loss", "params_sha256", "restarts", "tokens_per_s", "mfu"}
    assert result["step"] == 40 and result["tokens"] == 40 * 384
    assert result["mfu"] is None and result["tokens_per_s"] > 0
    assert len(result["params_sha256"]) == 64
    assert "MFU n/a" in res.output and "final loss" in res.output
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["train"]["lr"] == 1e-2 and resolved["model"]["d_model"] == 32
    for rec in records.values():
        assert rec["step_s"] >= rec["data_wait_s"] >= 0 and rec["forward_backward_s"] > 0
        assert math.isfinite(rec["loss"])

    manifest = verify(run_dir / "checkpoints" / "step_000000040")
    assert manifest["config"] == resolved
    run_id = manifest["trainer"]["mlflow_run_id"]
    assert run_id

    # MLflow: the run holds the loss history, the artifacts, and the registered model.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == "40"
    assert run.data.tags["dataset.uri"] == "synthetic"
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [5, 10, 15, 20, 25, 30, 35, 40]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"loss.png", "summary.json"} <= artifacts
    assert client.get_registered_model("tiny-test").name == "tiny-test"


def test_prometheus_endpoint_serves_the_interface_names():
    port = free_port()
    m = TrainerMetrics(port=port)
    try:
        m.observe_step(step=3, loss=2.5, tokens=4096, step_s=0.2, data_wait_s=0.01, fwd_bwd_s=0.15, optim_s=0.03,
                       ckpt_block_s=0.0, tokens_per_s=20480.0, mfu=None, now=1.7e9)
        m.observe_checkpoint(1.5, 1.7e9)
        m.restarts.set(2)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        m.close()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = value
    for name in INTERFACE_METRICS:
        assert any(s == name or s.startswith(name + "_bucket") or s == name + "_count" for s in samples), name
    assert samples["trainer_step"] == "3.0"
    assert samples["trainer_tokens_total"] == "4096.0"
    assert samples["trainer_mfu"] == "NaN"
    assert samples["trainer_restarts_total"] == "2.0"
    assert samples["trainer_step_seconds_count"] == "1.0"
    # No labels beyond what Prometheus adds at scrape time.
    assert not any("{" in s and not s.split("{")[0].endswith("_bucket") for s in samples)
