"""Fault injection for benchmarks and tests: the normal trainer, with step callbacks that kill or hang a rank,
chosen by environment variables. Nothing of it is in the trainer itself; the trainer only exposes its (otherwise
empty) list of step callbacks (trainer/train.py). It lives here, beside the benchmarks that use it, so that both
they and the tests (tests/trainer/faults.py adds the faults and doubles only tests use) import it from outside
tests/.

Run it where `python -m trainer` would run (same arguments; torchrun, the launcher, plain python):
    TRAINER_TEST_KILL_AT_STEP=5 TRAINER_TEST_KILL_RANK=1 \\
        torchrun --nproc-per-node=2 ... -m bench.faults --preset tiny --run-dir runs/x train.steps=8
From Python: `FAULTS` is the module name for bench/runs.py; `callbacks(os.environ)` the step callbacks.

The faults (steps are 0-based), each at most once per marker file, which the fault creates first and does
nothing if it exists, so that the restarted group trains on:
- TRAINER_TEST_KILL_AT_STEP=N (TRAINER_TEST_KILL_RANK=R, default 0): rank R SIGKILLs itself in step N after its
  backward passes, before the step's all-reduce and the optimizer step (marker TRAINER_TEST_KILL_MARKER,
  default RUN_DIR/.test-kill-N): a lost worker; a list N,M,... kills it once in each of those steps (markers
  RUN_DIR/.test-kill-N, or TRAINER_TEST_KILL_MARKER-N);
- TRAINER_TEST_HANG_AT_STEP=N (TRAINER_TEST_HANG_RANK=R, default 0): rank R sleeps TRAINER_TEST_HANG_S seconds
  (default 3600) in step N's collective phase instead of joining the all-reduce, which the other ranks wait in
  (marker TRAINER_TEST_HANG_MARKER, default RUN_DIR/.test-hang-N; it records when the sleep began): a hung worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAULTS = "bench.faults"


def marked_once(marker: Path) -> bool:
    """Create `marker` (recording this process and the time); False if it already existed."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"pid": os.getpid(), "time": time.time()}) + "\n")
    return True


def kill_at(step: int, rank: int, marker: str | None):
    def kill(trainer: Any, point: str, at: int) -> None:
        if point == "before_sync" and at == step and trainer.env.rank == rank and marked_once(
                Path(marker or trainer.run_dir / f".test-kill-{step}")):
            os.kill(os.getpid(), signal.SIGKILL)

    return kill


def hang_at(step: int, rank: int, seconds: float, marker: str | None):
    def hang(trainer: Any, point: str, at: int) -> None:
        if point == "before_sync" and at == step and trainer.env.rank == rank and marked_once(
                Path(marker or trainer.run_dir / f".test-hang-{step}")):
            time.sleep(seconds)

    return hang


def callbacks(env: Mapping[str, str]) -> list[Any]:
    """The step callbacks the TRAINER_TEST_* variables in `env` ask for (module docstring)."""
    out = []
    if "TRAINER_TEST_KILL_AT_STEP" in env:
        steps = [int(s) for s in env["TRAINER_TEST_KILL_AT_STEP"].split(",")]
        marker = env.get("TRAINER_TEST_KILL_MARKER")
        out += [kill_at(step, int(env.get("TRAINER_TEST_KILL_RANK", "0")),
                        f"{marker}-{step}" if marker and len(steps) > 1 else marker) for step in steps]
    if "TRAINER_TEST_HANG_AT_STEP" in env:
        out.append(hang_at(int(env["TRAINER_TEST_HANG_AT_STEP"]), int(env.get("TRAINER_TEST_HANG_RANK", "0")),
                           float(env.get("TRAINER_TEST_HANG_S", "3600")), env.get("TRAINER_TEST_HANG_MARKER")))
    return out


if __name__ == "__main__":
    from trainer.__main__ import exit_now, main

    exit_now(main(sys.argv[1:], step_callbacks=callbacks(os.environ)))
