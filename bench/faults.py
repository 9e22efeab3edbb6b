"""Fault injection for benchmarks and tests: the normal trainer, with step callbacks that kill, hang or slow a
rank, chosen by environment variables. Nothing of it is in the trainer itself; the trainer only exposes its
(otherwise empty) list of step callbacks (trainer/train.py). It lives here, beside the benchmarks that use it, so
that both they and the tests (tests/trainer/faults.py adds the tests' own doubles) import it from outside tests/.

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
  (marker TRAINER_TEST_HANG_MARKER, default RUN_DIR/.test-hang-N; it records when the sleep began): a hung worker;
- TRAINER_TEST_SLOW_RANK=R: rank R sleeps TRAINER_TEST_SLOW_S seconds (default 0.2) in every step, between the
  last micro batch's forward and backward passes: a straggler (no marker).
- TRAINER_TEST_NAN_AT_STEP=N: in step N, after its backward passes, rank 0 makes one gradient NaN (a diverged
  step) and saves the parameters and the optimizer state as they are then to RUN_DIR/.test-nan-before.pt, and
  again once step N's optimizer step has run (in step N + 1, after its forward pass, before the host reads step N's
  flags) to RUN_DIR/.test-nan-after.pt;
- TRAINER_TEST_COUNT_HOST_READS=FILE: counts the calls that read a tensor's value on the host (Tensor.item,
  tolist, cpu, __bool__, __float__, __int__) per 0-based step, a step counting from its first step callback to the
  next step's, and writes {"start": reads before the first step's callback, "steps": {step: reads}} to FILE at
  each step's first callback (so the counts of every step but the last are complete; the process ends with
  os._exit, which runs no atexit hook).
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


def slow(rank: int, seconds: float):
    def straggle(trainer: Any, point: str, at: int) -> None:
        if point == "after_forward" and trainer.env.rank == rank:
            time.sleep(seconds)

    return straggle


def nan_at(step: int):
    def snapshot(trainer: Any, name: str) -> None:
        import torch

        params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        torch.save({"params": params, "optimizer": trainer.optimizer.state_dict()}, trainer.run_dir / name)

    def poison(trainer: Any, point: str, at: int) -> None:
        if trainer.env.rank != 0:
            return
        if point == "before_sync" and at == step:
            snapshot(trainer, ".test-nan-before.pt")
            next(p for p in trainer.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        elif point == "after_forward" and at == step + 1:
            snapshot(trainer, ".test-nan-after.pt")

    return poison


HOST_READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")


def count_host_reads(path: str):
    import torch

    counts: dict[str, Any] = {"start": 0, "steps": {}}
    where: list[int | None] = [None]

    def counted(name: str):
        original = getattr(torch.Tensor, name)

        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            if where[0] is None:
                counts["start"] += 1
            else:
                counts["steps"][where[0]] = counts["steps"].get(where[0], 0) + 1
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))

    def track(_trainer: Any, _point: str, at: int) -> None:
        if where[0] is None or at > where[0]:
            Path(path).write_text(json.dumps(counts))
            where[0] = at
            counts["steps"].setdefault(at, 0)

    return track


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
    if "TRAINER_TEST_SLOW_RANK" in env:
        out.append(slow(int(env["TRAINER_TEST_SLOW_RANK"]), float(env.get("TRAINER_TEST_SLOW_S", "0.2"))))
    if "TRAINER_TEST_NAN_AT_STEP" in env:
        out.append(nan_at(int(env["TRAINER_TEST_NAN_AT_STEP"])))
    if "TRAINER_TEST_COUNT_HOST_READS" in env:
        out.append(count_host_reads(env["TRAINER_TEST_COUNT_HOST_READS"]))
    return out


if __name__ == "__main__":
    from trainer.__main__ import exit_now, main

    exit_now(main(sys.argv[1:], step_callbacks=callbacks(os.environ)))
