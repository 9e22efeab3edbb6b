"""Start the trainer as real processes (plain `python -m trainer` or torchrun with gloo workers) for tests.

Usage:
    res = run_trainer(run_dir, nproc=2, overrides=SMALL + ["train.steps=6"], max_restarts=1, env={...})
    res.returncode, res.output, summary(run_dir), step_records(run_dir)

Every launch runs in its own session and the whole process group is killed when it ends or times out, so no
worker outlives a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainer.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]

# A model and batch small enough for seconds per run on a busy 2-core machine. 12 sequences per step divide
# into micro batches of 2 for 1, 2 and 3 workers (6, 3 and 2 micro batches per worker).
SMALL = [
    "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.context=32",
    "train.global_batch_tokens=384", "train.micro_batch_size=2", "train.warmup_steps=2",
    "tracking.enabled=false", "metrics.log_every=1",
]


@dataclass
class Result:
    returncode: int
    output: str


def command(run_dir: Path, nproc: int | None, overrides: list[str], max_restarts: int = 0) -> list[str]:
    trainer = ["-m", "trainer", "--preset", "tiny", "--run-dir", str(run_dir), *overrides]
    if nproc is None:
        return [sys.executable, *trainer]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5", *trainer,
    ]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRAINER_METRICS_PORT"}
           and not k.startswith(("TORCHELASTIC_", "TRAINER_TEST_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


def start(run_dir: Path, nproc: int | None, overrides: list[str], *, max_restarts: int = 0,
          env: dict[str, str] | None = None, log_path: Path | None = None) -> subprocess.Popen:
    log_path = log_path or run_dir.with_name(run_dir.name + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            command(run_dir, nproc, overrides, max_restarts), cwd=ROOT, env=child_env(env), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_trainer(run_dir: Path, nproc: int | None, overrides: list[str], *, max_restarts: int = 0,
                env: dict[str, str] | None = None, timeout: float = 240) -> Result:
    log_path = run_dir.with_name(run_dir.name + ".log")
    proc = start(run_dir, nproc, overrides, max_restarts=max_restarts, env=env, log_path=log_path)
    try:
        proc.wait(timeout=timeout)
    finally:
        kill_group(proc)
    return Result(proc.returncode, log_path.read_text(errors="replace"))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def step_records(run_dir: Path) -> dict[int, dict]:
    """The last metrics.jsonl record per step (a redone step after a restart replaces the first attempt)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "step":
            out[rec["step"]] = rec
    return out
