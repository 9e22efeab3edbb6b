"""What a resume keeps and what it takes from the new settings: one MLflow run per job across kills, restarts,
relaunches and world-size changes (with every step's metrics once), and the learning-rate schedule after a resume
that changed it. Several nodes: tests/trainer/test_multinode.py.

Run: .venv/bin/pytest tests/trainer/test_resume.py -q
"""

from __future__ import annotations

import math

import pytest

from tests.trainer.launch import FAULTS, SMALL, run_trainer, step_records, summary
from trainer.distributed import free_port

pytestmark = pytest.mark.slow

# MLflow's embedded store, every step logged; no end-of-run sample (seconds on a busy machine). Checkpoints are
# written synchronously, so that a kill in the step after a checkpoint always finds it complete.
TRACKED = [o for o in SMALL if not o.startswith("tracking.")] + [
    "tracking.enabled=true", "tracking.log_every=1", "eval.sample_tokens=0", "checkpoint.every_steps=2",
    "checkpoint.async_save=false",
]


def mlflow_runs(uri: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("gpu-train")
    return client.search_runs([experiment.experiment_id]) if experiment else []


def metric_steps(uri: str, run_id: str, key: str) -> list[int]:
    from mlflow import MlflowClient

    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def test_two_workers_keep_one_mlflow_run_across_kills_restarts_and_a_resize(tmp_path):
    """Two workers killed at step 3 (no restarts left), relaunched and killed at step 6 (torchrun restarts the
    group) and at step 9 (the launch ends), relaunched on one worker: one MLflow run, each step's metrics once.
    Before every rank saved rank 0's trainer state, the checkpoint could hold a rank's copy without the run id."""
    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [*TRACKED, f"tracking.uri={uri}", "train.steps=12"]
    first = run_trainer(run_dir, 2, overrides, module=FAULTS,
                        env={"TRAINER_TEST_KILL_AT_STEP": "3", "TRAINER_TEST_KILL_RANK": "1"})
    assert first.returncode != 0, first.output[-3000:]
    second = run_trainer(run_dir, 2, overrides, module=FAULTS, max_restarts=1,
                         env={"TRAINER_TEST_KILL_AT_STEP": "6,9", "TRAINER_TEST_KILL_RANK": "1"})
    assert second.returncode != 0, second.output[-3000:]
    assert second.output.count("resumed from") >= 2, second.output[-3000:]
    third = run_trainer(run_dir, 1, overrides)
    assert third.returncode == 0, third.output[-3000:]
    assert summary(run_dir)["step"] == 12

    runs = mlflow_runs(uri)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["trainer.resumes"] == "3"  # launch 2, its restart, launch 3
    for key in ("loss", "lr", "tokens", "step_s"):
        assert metric_steps(uri, run.info.run_id, key) == list(range(1, 13)), key


def test_steps_a_killed_process_never_sent_reach_the_relaunchs_run(tmp_path):
    """The first launch's MLflow server never answers, so its run never opens (as on the slow first start of a
    store), and it is killed in step 3, after its checkpoint at step 2. The relaunch, at a store that answers,
    records steps 1-2 from that checkpoint and 3-6 by training: each step once."""
    port = free_port()  # nothing listens on it
    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = run_trainer(run_dir, 1, [*TRACKED, f"tracking.uri=http://127.0.0.1:{port}", "train.steps=6"],
                        module=FAULTS, env={"TRAINER_TEST_KILL_AT_STEP": "3"})
    assert first.returncode != 0 and "is unreachable" in first.output, first.output[-3000:]
    second = run_trainer(run_dir, 1, [*TRACKED, f"tracking.uri={uri}", "train.steps=6"])
    assert second.returncode == 0, second.output[-3000:]
    assert "the last process had not sent are sent now (steps 1-2)" in second.output, second.output[-3000:]
    runs = mlflow_runs(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    for key in ("loss", "lr", "tokens"):
        assert metric_steps(uri, runs[0].info.run_id, key) == list(range(1, 7)), key


def _by_hand(k: int, *, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """0-based step k of docs/trainer.md's schedule: linear warmup over `warmup` steps, then a cosine from lr down
    to min_lr at `steps`."""
    if k < warmup:
        return lr * (k + 1) / warmup
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (k - warmup) / (steps - warmup))) / 2


def test_a_resume_with_a_new_lr_min_lr_and_steps_follows_the_new_schedule_from_its_step(tmp_path):
    """Killed at step 6 of 10 with lr 3e-3 -> 3e-4; resumed with lr 1e-3, min_lr 1e-4 and 16 steps: every later
    step uses the new schedule at its step (no second warmup, the decay ending at step 16), and one line says
    what changed. Before, the restored scheduler kept the old lr as its base and applied 3x the new schedule."""
    run_dir = tmp_path / "run"
    base = [*SMALL, "checkpoint.every_steps=2", "checkpoint.async_save=false", "train.warmup_steps=2"]
    old = {"lr": 3e-3, "min_lr": 3e-4, "warmup": 2, "steps": 10}
    new = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "steps": 16}
    first = run_trainer(run_dir, None, [*base, "train.lr=3e-3", "train.min_lr=3e-4", "train.steps=10"],
                        module=FAULTS, env={"TRAINER_TEST_KILL_AT_STEP": "6"})
    assert first.returncode != 0 and (run_dir / "checkpoints" / "step_000000006").is_dir(), first.output[-3000:]
    second = run_trainer(run_dir, None, [*base, "train.lr=1e-3", "train.min_lr=1e-4", "train.steps=16"])
    assert second.returncode == 0, second.output[-3000:]

    records = step_records(run_dir)
    assert sorted(records) == list(range(1, 17))
    for step, rec in records.items():  # the record of 1-based step s carries the lr it trained with
        want = _by_hand(step - 1, **(old if step <= 6 else new))
        assert rec["lr"] == pytest.approx(want, rel=1e-12, abs=0), (step, rec["lr"], want)
    changed = [line for line in second.output.splitlines() if "resuming at step 6 with changed settings" in line]
    assert len(changed) == 1, second.output[-3000:]
    line = changed[0]
    assert "train.lr 0.003 -> 0.001" in line and "train.min_lr 0.0003 -> 0.0001" in line
    assert "train.steps 10 -> 16" in line and "warmup_steps" not in line.split(";")[0]
    assert f"lr of step 7: {_by_hand(6, **old):.4g} -> {_by_hand(6, **new):.4g}" in line
