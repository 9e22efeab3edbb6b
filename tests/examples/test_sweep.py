"""A team's own loop as a sweep's trials (examples/plain-loop/sweep.yaml): the library's TrialBudget holds the loop
at a rung with a checkpoint, a trial paused there and promoted ends on the weights of one that never paused, and
`gpu-train sweep run --local` runs the example's ASHA sweep to a best trial.

Run: .venv/bin/pytest tests/examples/test_sweep.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.launch import wait_for_status

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plain-loop"
STEPS, TOKENS_PER_STEP, RUNG = 24, 256, 1536


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINER_", "MLFLOW_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _budget(path: Path, tokens: int) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps({"tokens": tokens}))
    tmp.replace(path)


def _start(cwd: Path, budget: Path) -> subprocess.Popen:
    """The example as a trial's command runs it (one worker, no launcher: its places fall back to cwd/runs/local)."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(EXAMPLE / "train.py"), "--steps", str(STEPS), "--lr", "0.004", "--val-batches", "2",
           "--checkpoint-every", "1000", "--budget-uri", budget.as_uri()]
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _result(cwd: Path) -> dict:
    return json.loads((cwd / "runs" / "local" / "result.json").read_text())


def _samples(cwd: Path) -> dict[int, list]:
    rows = map(json.loads, (cwd / "runs" / "local" / "steps.jsonl").read_text().splitlines())
    return {r["step"]: r["samples"] for r in rows}


def test_a_trial_paused_at_a_rung_and_promoted_ends_as_if_it_never_paused(tmp_path):
    straight_budget = tmp_path / "straight" / "budget.json"
    straight_budget.parent.mkdir(parents=True)
    _budget(straight_budget, STEPS * TOKENS_PER_STEP)
    straight = _start(tmp_path / "straight", straight_budget)
    assert straight.wait(timeout=240) == 0, straight.communicate()[0][-3000:]

    budget = tmp_path / "trial" / "budget.json"
    budget.parent.mkdir(parents=True)
    _budget(budget, RUNG)
    proc = _start(tmp_path / "trial", budget)
    try:
        held = wait_for_status(budget.parent / "status.json", "held", proc)
        assert (held["step"], held["tokens"], held["budget_tokens"]) == (RUNG // TOKENS_PER_STEP, RUNG, RUNG)
        assert [e["tokens"] for e in held["evals"]] == [RUNG]  # its validation loss where it holds
        proc.send_signal(signal.SIGTERM)  # paused: the checkpoint of the rung is already saved
        assert proc.wait(timeout=240) == 75
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _budget(budget, STEPS * TOKENS_PER_STEP)  # promoted to the whole budget
    again = _start(tmp_path / "trial", budget)
    assert again.wait(timeout=240) == 0, again.communicate()[0][-3000:]

    done = json.loads((budget.parent / "status.json").read_text())
    assert (done["state"], done["tokens"]) == ("completed", STEPS * TOKENS_PER_STEP)
    assert done["params_sha256"] == _result(tmp_path / "trial")["params_sha256"] == \
        _result(tmp_path / "straight")["params_sha256"]
    assert _samples(tmp_path / "trial") == _samples(tmp_path / "straight")
    straight_done = json.loads((straight_budget.parent / "status.json").read_text())
    assert done["val_loss"] == straight_done["val_loss"]


def test_the_examples_asha_sweep_pauses_prunes_and_ends_on_its_best_trial(tmp_path):
    cmd = [str(Path(sys.executable).parent / "gpu-train"), "sweep", "run", "--local", str(EXAMPLE / "sweep.yaml"),
           "--runs", str(tmp_path / "runs")]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    sweep_dir = tmp_path / "runs" / "plain-sweep"
    records = [json.loads(line) for line in (sweep_dir / "journal.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events.count("suggest") == 4 and "pause" in events and "prune" in events
    finished = {r["trial"]: r for r in records if r["event"] == "finish"}
    assert finished and len(finished) + events.count("prune") == 4
    for trial, r in finished.items():  # each finished trial's weights are the ones its own loop wrote
        result = json.loads((sweep_dir / trial / "result.json").read_text())
        assert (result["step"], result["params_sha256"]) == (STEPS, r["params_sha256"])
    (done,) = [r for r in records if r["event"] == "done"]
    best = min(finished.values(), key=lambda r: r["value"])
    assert (done["best"], done["value"]) == (best["trial"], best["value"])
    # Each trial ran with the parameters Optuna asked for, substituted into its command: its loop saved the
    # arguments it parsed in every checkpoint's manifest, and its budget object is the one the sweep gave it.
    suggested = {r["trial"]: r["params"] for r in records if r["event"] == "suggest"}
    for trial, params in suggested.items():
        (manifest, *_) = sorted((sweep_dir / trial / "checkpoints").glob("step_*/manifest.json"))
        args = json.loads(manifest.read_text())["config"]
        assert (args["lr"], args["width"]) == (params["lr"], params["width"]), trial
        assert args["budget_uri"] == (sweep_dir / trial / "budget.json").as_uri()
    assert (sweep_dir / "sweep.png").is_file()
