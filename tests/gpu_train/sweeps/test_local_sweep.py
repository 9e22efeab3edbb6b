"""A real ASHA sweep on this machine: `gpu-train sweep run --local` trains four tiny trials under torchrun (gloo), one
at a time, with one rung. The controller is killed with SIGKILL just after its first pause and started again.

The learning rates are a grid visited in a known order (seed 5: 0.03, 0.01, 0.003, 0.0003, found by asking
Optuna's GridSampler), and after four steps a higher rate has the lower loss, so ASHA (eta 2) promotes t000 at
once; t001 pauses (the best 2 // 2 = 1 of [t000, t001] is t000); t002 and t003 pause; with four values at the
rung the best two go on, so t001 is promoted from its pause and resumes from its checkpoint.

Checked: the pause and the promotion; the best trial; no trial lost or run twice across the kill; the journal's
replay; the plot, the status table, MLflow's parent and child runs; and both a trial held and raised in the same
processes (t000) and a trial stopped and resumed from its checkpoint (t001) end with weights bit-identical to
the same trial trained without a budget.

Run: .venv/bin/pytest tests/gpu_train/sweeps/test_local_sweep.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpu_train.jobs.launch import Site, local
from gpu_train.spec.sweep import load_sweep, trial_job
from gpu_train.sweeps.journal import read_journal

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 900  # under contention a launch takes tens of seconds; this only bounds a hang

SPEC = {
    "name": "asha-it",
    "trialTemplate": {"name": "asha-it", "team": "local", "pool": "local", "preset": "tiny", "nodes": "1:1",
                      "steps": 8, "globalBatchTokens": 512, "checkpointEvery": 1000, "maxRestarts": 0,
                      "overrides": {"eval.batches": 2, "eval.sample_tokens": 0, "train.warmup_steps": 0,
                                    "train.micro_batch_size": 8}},
    "searchSpace": {"train.lr": {"distribution": "choice", "values": [0.03, 0.01, 0.003, 0.0003]}},
    "algorithm": {"name": "grid", "seed": 5, "earlyStopping": {"name": "asha", "minTokens": 2048,
                                                                "reductionFactor": 2}},
    "trialConfig": {"numTrials": 4, "parallelTrials": 1},
}


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # torchrun
    out.pop("MLFLOW_TRACKING_URI", None)
    return out


def gpu_train(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpu_train.cli", *map(str, args)], env=env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def wait_for(journal: Path, event: str, controller: subprocess.Popen) -> None:
    """Until the journal holds `event`; a controller that exits first fails the test with what it printed."""
    deadline = time.monotonic() + DEADLINE_S
    while not any(r["event"] == event for r in read_journal(journal)):
        if controller.poll() is not None:
            raise AssertionError(f"the controller exited {controller.returncode} before a {event} record:\n"
                                 f"{controller.communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, f"no {event} record in {journal}"
        time.sleep(0.2)


def plain_run(sweep, trial: str, params: dict, run_dir: Path) -> subprocess.Popen:
    """The same trial as a plain job: no budget, no pause (each in a parent of its own: its own MLflow store)."""
    job = trial_job(sweep, trial, params, {})
    cmd, launch_env = local(job, Site(run_dir=str(run_dir), dataset_uri="synthetic"), 1, environ=env())
    run_dir.parent.mkdir(parents=True)
    with open(run_dir.parent / "launcher.log", "wb") as log:
        return subprocess.Popen(cmd, env=launch_env, stdout=log, stderr=subprocess.STDOUT)


def test_a_killed_asha_sweep_continues_pauses_promotes_and_matches_unpaused_training(tmp_path):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    runs = tmp_path / "runs"
    sweep_dir = runs / "asha-it"
    journal = sweep_dir / "journal.jsonl"

    first = gpu_train("sweep", "run", "--local", spec, "--runs", runs)
    wait_for(journal, "pause", first)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)

    second = gpu_train("sweep", "run", "--local", spec, "--runs", runs)
    out, _ = second.communicate(timeout=DEADLINE_S)
    assert second.returncode == 0, out
    assert "resuming from its journal" in out

    records = read_journal(journal)
    events = [(r["event"], r.get("trial")) for r in records if r["event"] in ("pause", "promote", "finish", "prune")]
    suggested = {r["trial"]: r["params"]["train.lr"] for r in records if r["event"] == "suggest"}
    assert suggested == {"asha-it-t000": 0.03, "asha-it-t001": 0.01, "asha-it-t002": 0.003, "asha-it-t003": 0.0003}
    assert sorted(r["number"] for r in records if r["event"] == "suggest") == [0, 1, 2, 3]  # none lost, none twice
    assert events == [("promote", "asha-it-t000"), ("finish", "asha-it-t000"), ("pause", "asha-it-t001"),
                      ("pause", "asha-it-t002"), ("pause", "asha-it-t003"), ("promote", "asha-it-t001"),
                      ("finish", "asha-it-t001"), ("prune", "asha-it-t002"), ("prune", "asha-it-t003")]
    resumed = [r for r in records if r["event"] == "promote" and r.get("resume")]
    assert [r["trial"] for r in resumed] == ["asha-it-t001"]
    t1_log = (sweep_dir / "asha-it-t001" / "launcher.log").read_text()
    assert "resumed from" in t1_log and "at step 4 (2048 tokens seen)" in t1_log
    finish = {r["trial"]: r for r in records if r["event"] == "finish"}
    done = records[-1]
    assert done["event"] == "done" and done["best"] == min(finish, key=lambda t: finish[t]["value"])
    # trained: t000 and t001 to 4,096 tokens, the others to the rung: 12,288 of the 16,384 of four full trials
    statuses = {t: json.loads((sweep_dir / t / "status.json").read_text()) for t in suggested}
    assert sum(s["tokens"] for s in statuses.values()) == 2 * 4096 + 2 * 2048

    replay = gpu_train("sweep", "replay", spec, "--runs", runs)
    text, _ = replay.communicate(timeout=120)
    assert replay.returncode == 0 and "0 differ" in text, text

    status = gpu_train("sweep", "status", spec, "--runs", runs)
    text, _ = status.communicate(timeout=120)
    assert status.returncode == 0 and "asha-it-t000 *" in text and "4/4 trials" in text
    assert (sweep_dir / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{sweep_dir / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "asha-it"]
    runs_found = client.search_runs([experiment.experiment_id])
    parent = done_parent = records[0]["mlflow_parent_run_id"]
    children = [r for r in runs_found if r.data.tags.get("mlflow.parentRunId") == parent]
    assert done_parent and {r.info.run_name for r in children} == set(suggested)
    assert client.get_run(parent).data.tags["best_trial"] == done["best"]

    # the same two trials without a budget: the weights are bit-identical
    sweep = load_sweep(spec)
    plains = {t: plain_run(sweep, t, {"train.lr": suggested[t]}, tmp_path / f"plain-{t}" / t)
              for t in ("asha-it-t000", "asha-it-t001")}
    for t, proc in plains.items():
        assert proc.wait(timeout=DEADLINE_S) == 0, (tmp_path / f"plain-{t}" / "launcher.log").read_text()[-3000:]
        summary = json.loads((tmp_path / f"plain-{t}" / t / "summary.json").read_text())
        assert summary["params_sha256"] == finish[t]["params_sha256"], t
