"""Recovery: seconds from a worker's death (kill -9) to the first completed step after torchrun
restarted the group and every rank loaded the newest checkpoint.

Usage: `python -m bench --only recovery`. Two CPU workers under torchrun (--max-restarts=1); rank 1
kills itself at a chosen step through the trainer's test hook (TRAINER_TEST_KILL_AT_STEP).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.common import Figure
from bench.overhead import SMALL
from bench.runs import run_trainer, summary

KILL_AT = 12


def _recovery_seconds(events: list[dict]) -> float:
    """Last step logged before the restart -> first step logged after it (an upper bound on the
    time since the kill: it includes the part of the step that was lost)."""
    restart = next(i for i, e in enumerate(events) if e.get("event") == "start" and e.get("restart_count", 0) > 0)
    before = [e for e in events[:restart] if e.get("event") == "step"][-1]
    after = next(e for e in events[restart:] if e.get("event") == "step")
    return after["time"] - before["time"]


def run(quick: bool = False) -> list[Figure]:
    repeats = 1 if quick else 3
    figures = []
    for label, overrides in (("tiny preset", []), ("small GPT (4x128, ctx 128)", SMALL)):
        seconds, resumed_from = [], None
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(tmp) / "run"
                events = run_trainer(run_dir, "tiny", [*overrides, "train.steps=20", "checkpoint.every_steps=5",
                                                       "metrics.log_every=1"],
                                     nproc=2, max_restarts=1,
                                     env={"TRAINER_TEST_KILL_AT_STEP": str(KILL_AT), "TRAINER_TEST_KILL_RANK": "1"})
                assert summary(run_dir)["restarts"] == 1, "the worker was not killed and restarted"
                resumed_from = next(Path(e["resumed_from"]).name for e in events
                                    if e.get("event") == "start" and e.get("restart_count", 0) > 0)
                seconds.append(_recovery_seconds(events))
        figures.append(Figure("recovery", f"worker kill -9 -> first step after resume ({label})",
                              statistics.median(seconds), "s",
                              notes=f"2 CPU workers, killed at step {KILL_AT}, resumed from {resumed_from}, "
                                    f"median of {repeats}"))
    return figures
