"""The examples (examples/plain-loop, examples/hf-gpt2) as a team runs them: `gpu-train run --local` with their
own job spec on 2 CPU workers; a worker SIGKILLed mid-run is restarted by torchrun and the run ends with the same
weights, bit for bit, as an uninterrupted one; a run resumed at another world size trains on the same samples in
the same order.

Run: .venv/bin/pytest tests/examples/test_runs.py -q   (about a minute per example on 2 busy cores)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("plain-loop", "hf-gpt2")
# A tiny model, a checkpoint every 10 steps; the killed run loses a worker at its first checkpoint, 50 steps before
# its end (seconds of training), and the test checks that a restart did happen.
STEPS, EVERY = 60, 10


def _spec(tmp_path: Path, example: str, steps: int) -> Path:
    """The example's own spec with fewer steps (its command's arguments), as a team edits it."""
    raw = yaml.safe_load((ROOT / "examples" / example / "job.yaml").read_text())
    raw["command"] = [*raw["command"][:2], "--steps", str(steps), "--checkpoint-every", str(EVERY)]
    path = tmp_path / f"{example}-{steps}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _start(tmp_path: Path, example: str, runs: Path, *, steps: int = STEPS, nproc: int = 2) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [str(Path(sys.executable).parent / "gpu-train"), "run", "--local", str(_spec(tmp_path, example, steps)),
           "--nproc", str(nproc), "--runs", str(runs), "--workdir", str(ROOT / "examples" / example)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    return out


def _steps(run_dir: Path) -> dict[int, dict]:
    """steps.jsonl by step; a step trained again after a restart keeps its last record."""
    return {r["step"]: r for r in map(json.loads, (run_dir / "steps.jsonl").read_text().splitlines())}


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _worker(run_dir: Path, rank: int) -> int:
    """The pid of the example's worker `rank` of this run (torchrun's child with RANK and the run's directory)."""
    want = {f"RANK={rank}".encode(), f"GPU_TRAIN_RUN_DIR={run_dir}".encode()}
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if want <= environ and b"train.py" in cmdline:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank} for {run_dir}")


class Reference(dict):
    """example -> the run directory of the example run once to the end, untouched (run on first use): what the
    other runs are compared with."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory
        self.output: dict[str, str] = {}  # example -> what its run printed

    def __missing__(self, example: str) -> Path:
        tmp = self.factory.mktemp(example)
        self.output[example] = _finish(_start(tmp, example, tmp / "runs"))
        self[example] = tmp / "runs" / yaml.safe_load((ROOT / "examples" / example / "job.yaml").read_text())["name"]
        return self[example]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory)


@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_trains_under_run_local_on_two_cpu_workers(uninterrupted, example):
    run = uninterrupted[example]
    steps = _steps(run)
    assert sorted(steps) == list(range(STEPS))
    assert {r["world_size"] for r in steps.values()} == {2} and {r["restart"] for r in steps.values()} == {0}
    assert steps[STEPS - 1]["loss"] < steps[0]["loss"]
    result = _result(run)
    assert (result["step"], result["world_size"]) == (STEPS, 2) and len(result["params_sha256"]) == 64
    # keep=2: the two newest verified checkpoints stay, the older ones are pruned.
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        f"step_{STEPS - EVERY:09d}", f"step_{STEPS:09d}"]
    # The library's loss line (TrainerMetrics.record_step), rank 0 only, every --log-every (default 10) steps: the
    # loss of the step steps.jsonl holds.
    out = uninterrupted.output[example]
    lines = [line for line in out.splitlines() if "[rank" in line and ": loss " in line]
    assert len(lines) == STEPS // 10 and all("[rank0]" in line for line in lines), out[-4000:]
    for line, step in zip(lines, range(10, STEPS + 1, 10), strict=True):
        assert f"step {step}: loss {steps[step - 1]['loss']:.4f}, " in line, line


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(uninterrupted, example, tmp_path):
    reference, runs = uninterrupted[example], tmp_path / "runs"  # the reference first: it runs on first use
    proc = _start(tmp_path, example, runs)
    run = runs / reference.name
    manifest = run / "checkpoints" / f"step_{EVERY:09d}" / "manifest.json"
    while not manifest.exists():  # the first checkpoint is complete: kill rank 1 while training goes on
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.02)
    os.kill(_worker(run, 1), signal.SIGKILL)
    out = _finish(proc)
    steps = _steps(run)
    restarted = sorted(s for s, r in steps.items() if r["restart"] == 1)
    assert restarted and restarted[-1] == STEPS - 1, out[-4000:]  # torchrun restarted the workers once ...
    assert restarted[0] % EVERY == 0 and restarted[0] >= EVERY  # ... which resumed from a checkpoint
    # ... and said so once, through the library (CheckpointManager.resume), naming it and its step.
    resumed = [line for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, out[-4000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{restarted[0]:09d}'} at step {restarted[0]}" in resumed[0]
    assert _result(run)["params_sha256"] == _result(reference)["params_sha256"]
    expected = _steps(reference)
    assert [steps[s]["loss"] for s in range(STEPS)] == [expected[s]["loss"] for s in range(STEPS)]


def test_a_run_resumed_at_another_world_size_keeps_the_sample_order(uninterrupted, tmp_path):
    """2 workers train the first half, 1 worker resumes their checkpoint and trains the second: every step reads
    the uninterrupted run's global batch."""
    example, runs = "plain-loop", tmp_path / "runs"
    _finish(_start(tmp_path, example, runs, steps=STEPS // 2))
    _finish(_start(tmp_path, example, runs, steps=STEPS, nproc=1))
    run, reference = runs / "plain-loop", _steps(uninterrupted[example])
    steps = _steps(run)
    assert [steps[s]["world_size"] for s in range(STEPS)] == [2] * (STEPS // 2) + [1] * (STEPS // 2)
    assert [steps[s]["samples"] for s in range(STEPS)] == [reference[s]["samples"] for s in range(STEPS)]
    # The first step after the resume starts from the checkpoint's weights (same loss as the reference, up to the
    # order of the gradient sums, which differs with the number of ranks).
    assert steps[STEPS // 2]["loss"] == pytest.approx(reference[STEPS // 2]["loss"], rel=1e-5)
    assert _result(run)["step"] == STEPS


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_example_serves_its_steps_on_the_port_the_platform_scrapes(example, tmp_path):
    """One worker with the launcher's TRAINER_METRICS_PORT: the step, loss and throughput under the names the
    platform's dashboards read, while it trains; SIGTERM then saves and exits 75 as always."""
    import socket
    import urllib.error

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINER_METRICS_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / example / "train.py"), "--steps", "100000"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 240
        while seen.get("trainer_step", 0) < 3:  # the signal: the endpoint itself reports three steps
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, f"no third step on port {port}: {seen}"
            try:
                seen = _scrape(port)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)  # the worker is still importing torch
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, out[-4000:]
    tokens_per_step = 8 * 32  # the examples' default --global-batch and --context
    assert seen["trainer_tokens_total"] >= 3 * tokens_per_step and seen["trainer_tokens_total"] % tokens_per_step == 0
    assert 0 < seen["trainer_loss"] < 10 and seen["trainer_tokens_per_second"] > 0
    assert seen["trainer_last_step_timestamp_seconds"] > 0
