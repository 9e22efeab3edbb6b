"""The trainer as the tests run it: the faults of bench/faults.py (TRAINER_TEST_* step callbacks, documented
there), the faults only tests use and the tests' own doubles, chosen by environment variables. Nothing of it is in
the trainer itself.

Run it where `python -m trainer` would run (same arguments; torchrun, the launcher, plain python):
    TRAINER_TEST_KILL_AT_STEP=5 torchrun --nproc-per-node=2 ... -m tests.trainer.faults --preset tiny ...
From Python: `FAULTS` is the module name for tests/trainer/launch.py.

The faults only tests use (steps are 0-based):
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

The doubles:
- TRAINER_TEST_UNREADABLE=DIR: from the start, this process sees DIR as a directory it may not read, as a
  non-root user sees one owned by another user with mode 0700: listing or opening DIR, and looking at, opening or
  removing anything inside it, fail with PermissionError (EACCES). For tests that run as root, which reads
  anything (a test not running as root can chmod the directory instead).
- TRAINER_TEST_ENERGY_DIR=DIR: each rank's GPU energy counter is the stand-in of tests/trainer/energy_counter.py,
  a file in DIR, handed to the trainer (trainer.energy reads whatever counter it is given).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import faults as bench_faults

FAULTS = "tests.trainer.faults"


def deny(root: str) -> None:
    """Make `root` unreadable to this process (module docstring): os, io and builtins entry points that pathlib,
    shutil and torch.distributed.checkpoint use raise EACCES for it and for anything inside it."""
    import builtins
    import errno
    import io

    top = os.path.abspath(root)  # abspath, not realpath: realpath calls os.lstat, which is wrapped below

    def blocked(path: Any, *, itself: bool) -> bool:
        if isinstance(path, int) or path is None:
            return False
        try:
            real = os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:
            return False
        return real.startswith(top + os.sep) or (itself and real == top)

    def guard(fn, *, itself: bool):
        def guarded(path, *args, **kwargs):
            if blocked(path, itself=itself):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(os.fspath(path)))
            return fn(path, *args, **kwargs)
        return guarded

    for name, itself in (("stat", False), ("lstat", False), ("listdir", True), ("scandir", True), ("open", True),
                         ("unlink", False), ("rmdir", False), ("remove", False)):
        setattr(os, name, guard(getattr(os, name), itself=itself))
    io.open = builtins.open = guard(builtins.open, itself=True)


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
    """bench/faults.py's step callbacks, then those of the faults only tests use, as `env` asks for them."""
    out = bench_faults.callbacks(env)
    if "TRAINER_TEST_SLOW_RANK" in env:
        out.append(slow(int(env["TRAINER_TEST_SLOW_RANK"]), float(env.get("TRAINER_TEST_SLOW_S", "0.2"))))
    if "TRAINER_TEST_NAN_AT_STEP" in env:
        out.append(nan_at(int(env["TRAINER_TEST_NAN_AT_STEP"])))
    if "TRAINER_TEST_COUNT_HOST_READS" in env:
        out.append(count_host_reads(env["TRAINER_TEST_COUNT_HOST_READS"]))
    return out


if __name__ == "__main__":
    if os.environ.get("TRAINER_TEST_UNREADABLE"):
        deny(os.environ["TRAINER_TEST_UNREADABLE"])
    from tests.trainer.energy_counter import open_counter
    from trainer.__main__ import exit_now, main

    counter = open_counter(int(os.environ.get("LOCAL_RANK", "0"))) if os.environ.get("TRAINER_TEST_ENERGY_DIR") else None
    exit_now(main(sys.argv[1:], step_callbacks=callbacks(os.environ), energy_counter=counter))
