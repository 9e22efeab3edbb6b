"""A token budget under two data-parallel workers: both hold at the budget's step (rank 0 reads the budget, one
all-reduce shares it, so no rank trains on or hangs alone), status.json reports the all-reduced validation loss
there, a raised budget trains on in the same processes, and the run ends on the parameters of the same run with
no budget. A sweep's pause and promotion at another world size: held at 2 workers, stopped (its pause), promoted
and run on by one worker, it trains on the global batches an unpaused run would.

Run: .venv/bin/pytest tests/trainer/test_budget.py -q
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.trainer.launch import SMALL, kill_group, run_trainer, start, step_records, summary, wait_for_status
from tests.trainer.test_elastic import _expected_batch_hashes

pytestmark = pytest.mark.slow

STEPS = 6
BATCH = 384  # SMALL's train.global_batch_tokens
BASE = [*SMALL, f"train.steps={STEPS}", f"eval.every_steps={STEPS}", "eval.batches=2", "eval.sample_tokens=0",
        "checkpoint.every_steps=100"]


def write_budget(path: Path, tokens: int) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps({"tokens": tokens}))
    tmp.replace(path)


def test_two_workers_hold_at_the_budget_and_train_on_when_it_is_raised(tmp_path):
    budget = tmp_path / "budget" / "budget.json"
    budget.parent.mkdir()
    write_budget(budget, 2 * BATCH)
    run_dir = tmp_path / "held"
    proc = start(run_dir, 2, [*BASE, f"train.budget_uri={budget.as_uri()}"])
    try:
        held = wait_for_status(budget.parent / "status.json", "held", proc)
        assert (held["step"], held["tokens"], held["world_size"], held["budget_tokens"]) == (2, 768, 2, 768)
        assert [(e["step"], e["tokens"]) for e in held["evals"]] == [(2, 768)]  # evaluated where it holds
        assert held["val_loss"] == held["evals"][0]["val_loss"]
        write_budget(budget, STEPS * BATCH)
        assert proc.wait(timeout=240) == 0
    finally:
        kill_group(proc)
    done = json.loads((budget.parent / "status.json").read_text())
    assert (done["state"], done["step"], done["tokens"]) == ("completed", STEPS, STEPS * BATCH)
    assert [e["tokens"] for e in done["evals"]] == [768, STEPS * BATCH]
    assert done["params_sha256"] == summary(run_dir)["params_sha256"]

    reference = run_trainer(tmp_path / "plain", 2, BASE)
    assert reference.returncode == 0, reference.output[-3000:]
    assert summary(tmp_path / "plain")["params_sha256"] == done["params_sha256"]


def test_a_trial_paused_at_two_workers_and_promoted_at_one_trains_on_the_same_batches(tmp_path):
    budget = tmp_path / "budget" / "budget.json"
    budget.parent.mkdir()
    write_budget(budget, 2 * BATCH)
    run_dir = tmp_path / "trial"
    overrides = [*BASE, f"train.budget_uri={budget.as_uri()}", "metrics.batch_hash=true"]
    proc = start(run_dir, 2, overrides)
    try:
        wait_for_status(budget.parent / "status.json", "held", proc)
        proc.send_signal(signal.SIGTERM)  # the pause: Kueue's eviction reaches torchrun as SIGTERM
        code = proc.wait(timeout=240)
    finally:
        kill_group(proc)
    assert code != 0 and summary(run_dir)["status"] == "preempted"
    write_budget(budget, STEPS * BATCH)  # promoted to the whole budget, where one worker has room
    resumed = run_trainer(run_dir, 1, overrides)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resumed from" in resumed.output
    records = step_records(run_dir)
    assert sorted(records) == list(range(1, STEPS + 1))
    starts = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in starts if r.get("event") == "start"] == [2, 1]
    assert {s: r["batch_sha256"] for s, r in records.items()} == _expected_batch_hashes(overrides, STEPS)
    done = json.loads((budget.parent / "status.json").read_text())
    assert (done["state"], done["tokens"], done["world_size"]) == ("completed", STEPS * BATCH, 1)
