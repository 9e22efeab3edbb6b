"""A stand-in GPU energy counter for the trainer's tests, handed to the trainer by tests/trainer/faults.py when
TRAINER_TEST_ENERGY_DIR is set.

Each rank's counter lives in a file, TRAINER_TEST_ENERGY_DIR/gpu<local rank>.mj, and behaves like a GPU that used
STEP_MJ millijoules between two readings: every read returns the stored value plus STEP_MJ and stores it. The
trainer reads it exactly twice per rank (start and end of training), so each rank measures STEP_MJ.
"""

from __future__ import annotations

import os
from pathlib import Path

STEP_MJ = 36_000_000  # 10 Wh


class FileCounter:
    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.exists():
            path.write_text("1000000\n")

    def read_mj(self) -> float:
        value = float(self.path.read_text()) + STEP_MJ
        self.path.write_text(f"{value:.0f}\n")
        return value


def open_counter(local_rank: int) -> FileCounter:
    return FileCounter(Path(os.environ["TRAINER_TEST_ENERGY_DIR"]) / f"gpu{local_rank}.mj")
