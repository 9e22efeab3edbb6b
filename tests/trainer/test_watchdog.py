"""Hang detection: the step bound worked out by hand, the watchdog firing (and not firing) on real threads, the
process-group timeouts it derives, NCCL's settings checked against torch's own headers, and a real two-worker
torchrun run whose rank 1 sleeps inside the step's collective.

Run: .venv/bin/pytest tests/trainer/test_watchdog.py -q
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from gpu_train.jobs.launch import nccl_env
from gpu_train.spec.errors import EXIT_HUNG
from gpu_train.spec.trainer_config import WatchdogConfig, build_config
from tests.trainer.clock import FakeClock
from tests.trainer.launch import FAULTS, SMALL, run_trainer, step_records, summary
from trainer import watchdog as watchdog_module
from trainer.watchdog import (
    Watchdog,
    checkpoint_timeout_s,
    collective_timeout_s,
    nccl_heartbeat_s,
    step_bound,
)

# Trains under torchrun with a hung rank.
pytestmark = pytest.mark.integration


def test_step_bound_worked_out_by_hand():
    cfg = WatchdogConfig(factor=10.0, window=4, floor_s=3.0, warmup_steps=2, startup_s=60.0)
    # The first two steps of a launch get the start-up allowance, whatever was measured.
    assert step_bound([0.5], 1, cfg)[0] == 60.0
    # median(0.1, 0.2, 0.9) = 0.2 -> 10 x 0.2 = 2.0 s, below the floor: 3.0 s.
    assert step_bound([0.1, 0.9, 0.2], 3, cfg)[0] == pytest.approx(3.0)
    # median(0.4, 0.5, 0.6, 5.0) = 0.55 -> 5.5 s: one slow step does not move the median much.
    bound, why = step_bound([0.4, 0.5, 0.6, 5.0], 10, cfg)
    assert bound == pytest.approx(5.5)
    assert "10 x median 0.550s of the last 4 steps" in why and "watchdog.floor_s 3s" in why
    # 10 x 8 s = 80 s, above the start-up allowance: capped at 60 s.
    assert step_bound([8.0, 8.0], 5, cfg)[0] == 60.0


def test_collective_timeouts_outlast_every_bound_the_watchdog_grants():
    """The process groups must not time out a collective before the watchdog has spoken."""
    cfg = WatchdogConfig(floor_s=5.0, startup_s=40.0, checkpoint_s=300.0, eval_s=90.0, factor=3.0)
    worst_step = max(step_bound(times, done, cfg)[0] for times, done in
                     (([0.1], 0), ([1.0] * 5, 5), ([1000.0] * 5, 5), ([0.001] * 5, 5)))
    assert worst_step == 40.0
    assert collective_timeout_s(cfg) > max(worst_step, cfg.eval_s)
    assert checkpoint_timeout_s(cfg) > cfg.checkpoint_s
    assert nccl_heartbeat_s(cfg) >= collective_timeout_s(cfg) - 1


def _torch_header(name: str) -> str:
    return (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d" / name).read_text()


def test_nccl_settings_are_names_torch_declares():
    """Every TORCH_NCCL_* variable set for the launcher and the JobSet is one torch 2.13 reads, and 3 is the
    error handling mode that tears the process down without aborting the communicators first."""
    header = _torch_header("ProcessGroupNCCL.hpp") + _torch_header("FlightRecorder.hpp")
    declared = set(re.findall(r'"(TORCH_(?:NCCL|FR)_[A-Z_]+)"', header))
    assert set(nccl_env()) | {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"} <= declared
    modes = dict(re.findall(r"(\w+) = (\d+)", header.split("enum ErrorHandlingMode")[1].split("};")[0]))
    assert modes["SkipCleanUp"] == nccl_env()["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    # The flight recorder's size: its first name is the current one, later ones warn as deprecated
    # (c10d/Utils.hpp, getCvarInt), so the first is the one to set.
    names = re.search(r"getCvarInt\(\s*\{([^}]*)\}", _torch_header("FlightRecorder.hpp")).group(1)
    assert re.findall(r'"([A-Z_]+)"', names)[0] in nccl_env()
    # The dump on timeout needs the flight recorder's buffer and the monitor thread (the header says so).
    assert int(nccl_env()["TORCH_FR_BUFFER_SIZE"]) > 0 and nccl_env()["TORCH_NCCL_ENABLE_MONITORING"] == "1"


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The watchdog's clock, moved by hand: firing depends on the moves only, never on the machine's load. Its
    thread still polls in real time, so a check that it fired waits for the event it sets."""
    return FakeClock().install(monkeypatch, watchdog_module)


def _watchdog(clock: FakeClock, dump_dir: Path | None = None,
              **kw) -> tuple[Watchdog, list[float], threading.Event]:
    fired_at: list[float] = []
    done = threading.Event()

    def on_hang() -> None:
        fired_at.append(clock.now)
        done.set()

    cfg = WatchdogConfig(floor_s=0.3, startup_s=0.6, warmup_steps=1, factor=3.0, **kw)
    wd = Watchdog(cfg, rank=3, local_rank=1, on_hang=on_hang, poll_s=0.01, dump_dir=dump_dir)
    return wd, fired_at, done


def _stuck_in_collective(clock: FakeClock, seconds: float, done: threading.Event) -> bool:
    """Hangs (on the watchdog's clock) for `seconds`, then waits for the watchdog's verdict on its real thread."""
    clock.advance(seconds)
    return done.wait(10)


def test_a_stuck_collective_fires_at_its_bound_naming_rank_phase_and_stacks(clock, capfd):
    wd, fired_at, done = _watchdog(clock)
    wd.start()
    try:
        for step in (1, 2, 3):  # quick steps: no firing, and they set the median
            wd.begin_step(step)
            clock.advance(0.01)
            wd.end_step(0.01)
        wd.begin_step(4)
        wd.phase("forward_backward")
        wd.phase("collective")
        t0 = clock.now
        clock.advance(0.29)  # just under the bound: however long the machine takes, no firing
        assert not done.wait(0.2) and not fired_at
        assert _stuck_in_collective(clock, 0.02, done), "the watchdog did not fire past its bound"
    finally:
        wd.stop()
    bound = 0.3  # max(floor 0.3, 3 x median 0.01)
    assert fired_at[0] - t0 == pytest.approx(bound + 0.01)
    err = capfd.readouterr().err
    assert "rank 3 (local rank 1 on " in err and "hung in phase 'collective' (step 4)" in err
    assert "bound 0.3s = max(watchdog.floor_s 0.3s, 3 x median 0.010s of the last 3 steps)" in err
    assert f"exiting {EXIT_HUNG}" in err
    stacks = err.split("----- rank 3: Python stacks of every thread -----")[1]
    assert "in _stuck_in_collective" in stacks and "in test_a_stuck_collective_fires" in stacks


def test_with_a_dump_directory_the_stacks_go_to_a_file_of_the_ranks_own(clock, tmp_path, capfd):
    """The ranks behind a hung one fire together and torchrun merges their stderr: each rank's stacks go whole to
    a file named after it, and stderr gets one line naming that file."""
    wd, fired_at, done = _watchdog(clock, dump_dir=tmp_path / "watchdog")
    wd.start()
    try:
        wd.begin_step(1)
        wd.phase("collective")
        assert _stuck_in_collective(clock, 0.61, done)  # past the first step's start-up allowance
    finally:
        wd.stop()
    assert fired_at and wd.dump_path is not None
    assert wd.dump_path.parent == tmp_path / "watchdog" and wd.dump_path.name.startswith("watchdog-rank3-step1-pid")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"every thread's stack is in {wd.dump_path}" in err[0]
    dump = wd.dump_path.read_text()
    assert dump.startswith("watchdog: rank 3 (local rank 1 on ") and "hung in phase 'collective' (step 1)" in dump
    assert "in _stuck_in_collective" in dump and "in test_with_a_dump_directory" in dump


def test_checkpoint_and_eval_have_their_own_allowances_and_the_loop_can_finish(clock):
    wd, fired_at, done = _watchdog(clock, checkpoint_s=1.0)
    wd.start()
    try:
        wd.begin_step(1)
        clock.advance(0.01)
        wd.end_step(0.01)
        with wd.allowance("checkpoint", 1.0):
            clock.advance(0.6)  # twice the step bound, within the checkpoint's allowance
            assert not done.wait(0.2) and not fired_at
        with wd.allowance("checkpoint", 1.0):
            clock.advance(1.01)
            assert done.wait(10), "a checkpoint past its allowance must fire"
    finally:
        wd.stop()
    # Disarmed (the end of the loop): nothing fires, however long it takes.
    wd2, fired2, done2 = _watchdog(clock)
    wd2.start()
    wd2.begin_step(1)
    wd2.disarm()
    clock.advance(3600)
    assert not done2.wait(0.2)
    wd2.stop()
    assert not fired2


def test_a_disabled_watchdog_starts_no_thread(clock):
    wd, fired_at, done = _watchdog(clock, enabled=False)
    wd.start()
    wd.begin_step(1)
    clock.advance(3600)
    assert not done.wait(0.2)
    wd.stop()
    assert not fired_at and wd._thread is None


def test_watchdog_settings_are_validated():
    from gpu_train.spec.trainer_config import ConfigError

    for bad, needle in (("watchdog.factor=0.5", "watchdog.factor must be >= 1"),
                        ("watchdog.floor_s=0", "watchdog.floor_s must be > 0"),
                        ("watchdog.startup_s=10", "watchdog.startup_s (10.0) must be >= watchdog.floor_s"),
                        ("watchdog.window=0", "watchdog.window must be > 0"),
                        ("watchdog.eval_s=nan", "watchdog.eval_s must be a finite number")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            build_config("tiny", overrides=[bad])


# ---------------------------------------------------------------------------------------------- real workers
HANG = [*SMALL, "train.steps=10", "checkpoint.every_steps=2", "eval.sample_tokens=0",
        # Small bounds so that the test takes seconds: 4 s a step once 3 steps are measured.
        "watchdog.floor_s=4", "watchdog.startup_s=60", "watchdog.factor=5"]


@pytest.mark.slow
def test_a_rank_sleeping_in_a_collective_is_found_and_the_group_resumes(tmp_path):
    """Rank 1 sleeps in step 7's all-reduce, which rank 0 waits in: the watchdog fires within its bound on
    the sleeping rank, naming it and dumping its stacks; torchrun restarts the group, which resumes from step 6
    and ends on the parameters of a run that never hung."""
    ref = run_trainer(tmp_path / "ref", 2, HANG)
    assert ref.returncode == 0, ref.output[-4000:]
    assert "watchdog:" not in ref.output  # no false alarm on a healthy run

    marker = tmp_path / "hang.marker"
    hung = run_trainer(tmp_path / "hung", 2, HANG, max_restarts=1, timeout=240, module=FAULTS, env={
        "TRAINER_TEST_HANG_AT_STEP": "6", "TRAINER_TEST_HANG_RANK": "1", "TRAINER_TEST_HANG_MARKER": str(marker),
        "TRAINER_TEST_HANG_S": "600"})
    assert hung.returncode == 0, hung.output[-6000:]
    out = hung.output
    lines = [line for line in out.splitlines() if "CRITICAL trainer.watchdog:" in line]
    mine = [line for line in lines if "[rank1]" in line]
    assert mine, out[-6000:]
    assert "rank 1 (local rank 1 on " in mine[0] and "hung in phase 'collective' (step 7)" in mine[0]
    spent, bound = (float(x) for x in re.search(r": ([\d.]+)s, bound ([\d.]+)s = ", mine[0]).groups())
    # Fired past its bound, and long before the 600 s sleep could have ended by itself: the watchdog ended the
    # hang. How soon past the bound depends on the machine's load, so that is not asserted.
    assert bound == pytest.approx(4.0, abs=0.05) and bound <= spent < 60
    # Its stacks, whole, in its own file beside the run (rank 0's fire at the same time and would interleave with
    # them on torchrun's merged stderr): the main thread asleep in the fault's step callback, called by the
    # Trainer's train_step before the step's all-reduce.
    dump = Path(re.search(r"every thread's stack is in (\S+);", mine[0]).group(1))
    assert dump.parent == tmp_path / "hung" / "watchdog" and dump.name.startswith("watchdog-rank1-step7-pid")
    stacks = dump.read_text()
    assert stacks.startswith("watchdog: rank 1 (local rank 1 on ")
    assert re.search(r"line \d+ in hang\n", stacks) and re.search(r"line \d+ in train_step\n", stacks), stacks
    assert "Python stacks of every thread" not in out  # nothing of it on stderr
    assert f"exitcode: {EXIT_HUNG}" in out  # what torchrun saw, and restarted on
    assert marker.exists()
    records = step_records(tmp_path / "hung")
    assert sorted(records) == list(range(1, 11))
    got, want = summary(tmp_path / "hung"), summary(tmp_path / "ref")
    assert got["restarts"] == 1 and got["status"] == "completed"
    assert got["params_sha256"] == want["params_sha256"]
    assert got["final_loss"] == want["final_loss"]
