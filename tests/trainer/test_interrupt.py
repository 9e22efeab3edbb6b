"""Ctrl-C follows SIGTERM's path: at whatever step it comes, every worker finishes that step, saves it and stops;
the command the user ran exits 130 with one line and no traceback; the same command then continues exactly
where an uninterrupted run would be. In one process, to the launcher alone (two workers under torchrun), and to
`gpu-train run --local`'s whole process group, as a terminal sends it.

Run: .venv/bin/pytest tests/trainer/test_interrupt.py -q
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.trainer.launch import (
    FAULTS,
    ROOT,
    SMALL,
    Nodes,
    child_env,
    kill_group,
    run_trainer,
    start,
    summary,
)
from trainer.checkpoint import verify
from trainer.errors import EXIT_INTERRUPTED

pytestmark = pytest.mark.slow

STEPS = 14
# Checkpoints only at the end and on a signal: the one the signal makes is the one a relaunch resumes from.
BASE = [*SMALL, f"train.steps={STEPS}", "checkpoint.every_steps=0"]
# Rank 0 slowed to 0.2 s a step (tests/trainer/faults.py), so that the signal lands inside the run.
SLOW = {"TRAINER_TEST_SLOW_RANK": "0", "TRAINER_TEST_SLOW_S": "0.2"}


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"event": "step"' in line for line in path.read_text().splitlines())


def _wait_for_step(run_dir: Path, step: int, alive, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while _steps_done(run_dir) < step:
        assert alive(), "the run ended before it was interrupted"
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout}s"
        time.sleep(0.05)


def _stopped_at(run_dir: Path) -> int:
    got = summary(run_dir)
    assert got["status"] == "preempted" and got["signal"] == "SIGINT", got
    step = got["step"]
    assert 0 < step < STEPS
    assert verify(run_dir / "checkpoints" / f"step_{step:09d}")["step"] == step
    return step


def test_ctrl_c_in_one_process_saves_that_step_and_the_same_command_continues_exactly(tmp_path):
    reference = run_trainer(tmp_path / "reference", None, BASE)
    assert reference.returncode == 0, reference.output[-3000:]
    run_dir, at = tmp_path / "run", random.Random().randrange(2, STEPS - 4)
    proc = start(run_dir, None, BASE, module=FAULTS, env=SLOW)
    try:
        _wait_for_step(run_dir, at, lambda: proc.poll() is None)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground process group
        code = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    output = run_dir.with_name("run.log").read_text()
    assert code == EXIT_INTERRUPTED, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    step = _stopped_at(run_dir)
    assert f"SIGINT: saved checkpoint at step {step}, stopping" in output
    assert f"python -m trainer: interrupted (SIGINT) at step {step}; the same command resumes" in output

    again = run_trainer(run_dir, None, BASE)
    assert again.returncode == 0, again.output[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:09d}'} at step {step}" in again.output
    assert summary(run_dir)["params_sha256"] == summary(tmp_path / "reference")["params_sha256"], f"stopped at {step}"


def test_sigint_to_the_launcher_alone_stops_two_workers_after_a_checkpoint(tmp_path):
    """Only the launcher gets the signal (kill -INT <pid>): it forwards it once to torchrun, whose two workers
    finish the same step, save it and exit 75; the launcher says so in one line and exits 130, and a relaunch ends
    on the parameters of a two-worker run never interrupted."""
    reference = run_trainer(tmp_path / "reference", 2, BASE)
    assert reference.returncode == 0, reference.output[-3000:]
    at = random.Random().randrange(2, STEPS - 4)
    nodes = Nodes(tmp_path, overrides=BASE, nnodes="1", nproc=2, max_restarts=2, module=FAULTS, env=SLOW)
    run_dir = nodes.run_dir(0)
    try:
        agent = nodes.start(0)
        _wait_for_step(run_dir, at, lambda: agent.proc.poll() is None)
        agent.signal(signal.SIGINT)
        code = agent.wait(timeout=120)
    finally:
        nodes.close()
    output = agent.output()
    assert code == EXIT_INTERRUPTED, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    step = _stopped_at(run_dir)
    for rank in (0, 1):
        assert f"[rank{rank}] WARNING trainer: SIGINT: saved checkpoint at step {step}, stopping" in output
    # torchrun and its workers write to the same pipe: a line of theirs cut short may precede the launcher's.
    lines = re.findall(r"gpu-train-launch: [^\n]*", output)
    assert lines == [f"gpu-train-launch: stopped by SIGINT: the workers saved the checkpoint of step {step}; the same "
                     "command resumes from it"], output[-3000:]
    assert "will restart worker group" not in output

    again = Nodes(tmp_path, overrides=BASE, nnodes="1", nproc=2, name="again")
    try:
        again.start(0)
        assert again.wait_all(180) == [0], again.logs()
    finally:
        again.close()
    assert summary(run_dir)["params_sha256"] == summary(tmp_path / "reference")["params_sha256"], f"stopped at {step}"


def test_ctrl_c_on_gpu_train_run_local_stops_the_whole_tree_after_a_checkpoint(tmp_path):
    """`gpu-train run --local` with two workers, Ctrl-C to its process group (what a terminal does): 130, one line
    from the launcher, no traceback anywhere, a checkpoint of the step it stopped at, nothing left running."""
    spec = tmp_path / "long.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "long", "team": "local", "pool": "local", "preset": "tiny", "nodes": "1:1", "steps": 100000,
        "globalBatchTokens": 384, "checkpointEvery": 100000, "maxRestarts": 3,
        "overrides": {o.split("=")[0]: o.split("=")[1] for o in SMALL if not o.startswith("train.global_batch")},
    }))
    log = tmp_path / "gpu-train.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpu_train.cli", "run", "--local", str(spec), "--nproc", "2",
                                 "--runs", str(tmp_path / "runs")], cwd=ROOT, env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = tmp_path / "runs" / "long"
    try:
        _wait_for_step(run_dir, random.Random().randrange(3, 30), lambda: proc.poll() is None)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        kill_group(proc)
    output = log.read_text()
    assert code == EXIT_INTERRUPTED, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    got = summary(run_dir)
    assert got["status"] == "preempted" and got["signal"] == "SIGINT"
    step = got["step"]
    assert verify(run_dir / "checkpoints" / f"step_{step:09d}")["step"] == step
    assert f"gpu-train-launch: stopped by SIGINT: the workers saved the checkpoint of step {step}" in output
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step
    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"still running: {leftovers}"
