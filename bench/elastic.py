"""Elastic scaling: per-worker throughput with 1 and 2 CPU workers on the same global batch, and the
scaling efficiency between them.

Usage: `python -m bench --only elastic`. Each worker is limited to one thread (OMP_NUM_THREADS=1) so
the two-worker run uses the same cores per worker as the one-worker run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import Figure, ratio
from bench.overhead import SMALL
from bench.runs import run_trainer, seconds_per_step

GLOBAL_BATCH_TOKENS = 8192  # SMALL's global batch


def run(quick: bool = False) -> list[Figure]:
    steps = 30 if quick else 60
    per_worker = {}
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            events = run_trainer(Path(tmp) / "run", "tiny",
                                 [*SMALL, f"train.steps={steps}", "checkpoint.every_steps=0"], nproc=world)
        per_worker[world] = GLOBAL_BATCH_TOKENS / seconds_per_step(events, 10) / world
    eff = ratio(per_worker[2], per_worker[1])
    return [
        Figure("elastic", "per-worker throughput, 1 worker", per_worker[1], "tokens/s", notes="small GPT, CPU"),
        Figure("elastic", "per-worker throughput, 2 workers (scaling efficiency)", per_worker[2], "tokens/s",
               per_worker[1], "1 worker", eff, notes="DDP over gloo, same global batch"),
    ]
