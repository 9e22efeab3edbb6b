"""Helpers that run the real trainer as a user would (`python -m trainer`, `torchrun`) and read its
metrics log. Used by the overhead, recovery and elastic benchmarks.

Usage: `run_trainer(run_dir, preset, overrides, nproc=2)` -> list of metrics.jsonl events;
`module=FAULTS` (tests/trainer/faults.py) runs the trainer with the faults its TRAINER_TEST_* variables ask for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_train.jobs import launch
from trainer.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["metrics.port=0", "tracking.enabled=false"]


def run_trainer(run_dir: Path, preset: str, overrides: list[str], *, nproc: int = 1, max_restarts: int = 0,
                env: dict[str, str] | None = None, timeout: float = 1200, log: Path | None = None,
                module: str = "trainer") -> list[dict]:
    """Run the trainer to completion under torchrun (c10d rendezvous) and return its events; `log` keeps its
    stdout and stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--max-restarts={max_restarts}",
           "-m", module, "--preset", preset, "--run-dir", str(run_dir), *QUIET, *overrides]
    # The switch the launcher sets for torchrun (trainer/distributed.py): a restarted group needs a fresh store.
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                launch.STORE_SWITCH: "1", **(env or {})}
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
