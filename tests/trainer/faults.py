"""The trainer as the tests run it: the faults of bench/faults.py (TRAINER_TEST_* step callbacks, documented
there) and the tests' own doubles, chosen by environment variables. Nothing of it is in the trainer itself.

Run it where `python -m trainer` would run (same arguments; torchrun, the launcher, plain python):
    TRAINER_TEST_KILL_AT_STEP=5 torchrun --nproc-per-node=2 ... -m tests.trainer.faults --preset tiny ...
From Python: `FAULTS` is the module name for tests/trainer/launch.py.

The doubles:
- TRAINER_TEST_UNREADABLE=DIR: from the start, this process sees DIR as a directory it may not read, as a
  non-root user sees one owned by another user with mode 0700: listing or opening DIR, and looking at, opening or
  removing anything inside it, fail with PermissionError (EACCES). For tests that run as root, which reads
  anything (a test not running as root can chmod the directory instead).
- TRAINER_TEST_ENERGY_DIR=DIR: each rank's GPU energy counter is the stand-in of tests/trainer/energy_counter.py,
  a file in DIR, handed to the trainer (trainer.energy reads whatever counter it is given).
"""

from __future__ import annotations

import os
import sys
from typing import Any

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



if __name__ == "__main__":
    if os.environ.get("TRAINER_TEST_UNREADABLE"):
        deny(os.environ["TRAINER_TEST_UNREADABLE"])
    from bench.faults import callbacks
    from tests.trainer.energy_counter import open_counter
    from trainer.__main__ import exit_now, main

    counter = open_counter(int(os.environ.get("LOCAL_RANK", "0"))) if os.environ.get("TRAINER_TEST_ENERGY_DIR") else None
    exit_now(main(sys.argv[1:], step_callbacks=callbacks(os.environ), energy_counter=counter))
