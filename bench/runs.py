"""Helpers that run the real trainer as a user would (the launcher and torchrun, as `gpu-train run --local` starts
them) and read its metrics log. Used by the overhead, recovery, elastic and GPU benchmarks.

Usage: `run_trainer(run_dir, preset, overrides, nproc=2)` -> list of metrics.jsonl events;
`module=FAULTS` (bench/faults.py) runs the trainer with the faults its TRAINER_TEST_* variables ask for.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.common import ROOT, launch_local
from trainer.distributed import free_port

QUIET = ["metrics.port=0", "tracking.enabled=false"]


def run_trainer(run_dir: Path, preset: str, overrides: list[str], *, nproc: int = 1, max_restarts: int = 0,
                env: dict[str, str] | None = None, timeout: float = 1200, log: Path | None = None,
                module: str = "trainer") -> list[dict]:
    """Run the trainer to completion under torchrun (c10d rendezvous) and return its events; `log` keeps its
    stdout and stderr."""
    cmd, full_env = launch_local(run_dir, preset, [*QUIET, *overrides], port=free_port(), nproc=nproc,
                                 max_restarts=max_restarts, module=module, env=env)
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def seconds_per_step(events: list[dict], from_step: int) -> float:
    """Wall clock per step between the end of `from_step` and the end of the last step, less the time the loop
    was blocked saving checkpoints in that window (the final save blocks for seconds; the bare loop saves none)."""
    steps = {e["step"]: e for e in events if e.get("event") == "step"}
    last = max(steps)
    saving = sum(steps[s].get("checkpoint_block_s") or 0.0 for s in steps if s > from_step)
    return (steps[last]["time"] - steps[from_step]["time"] - saving) / (last - from_step)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
