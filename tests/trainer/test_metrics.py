"""Straggler signals: the step clock's split on known sleeps, and a real two-worker run in which rank 1 is slowed
artificially, read from both workers' Prometheus endpoints while it trains.

Run: .venv/bin/pytest tests/trainer/test_metrics.py -q
"""

from __future__ import annotations

import statistics
import time
import urllib.request

import pytest
import torch

from tests.trainer.clock import FakeClock
from tests.trainer.launch import FAULTS, SMALL, free_port, kill_group, start, summary
from trainer import metrics as metrics_module
from trainer.metrics import StepClock

# Trains under torchrun and scrapes the metrics endpoints.
pytestmark = pytest.mark.integration


def test_step_clock_splits_own_work_from_waiting(monkeypatch):
    clock = FakeClock().install(monkeypatch, metrics_module)
    step_clock = StepClock(torch.device("cpu"))
    step_clock.start()
    clock.advance(0.05)  # this rank's forward/backward
    step_clock.grads_ready()
    clock.advance(0.12)  # blocked until the slowest rank's gradients arrive
    step_clock.synced()
    assert step_clock.split() == pytest.approx((0.05, 0.12))
    # Without the gradient hook (torch.compile) nothing can be told apart: all of it is compute.
    step_clock.start()
    clock.advance(0.05)
    step_clock.synced()
    assert step_clock.split() == pytest.approx((0.05, 0.0))


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("trainer_rank_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.slow
def test_a_slowed_rank_shows_more_compute_and_the_others_more_collective_wait(tmp_path):
    """Rank 1 sleeps 0.25 s in every step between forward and backward (TRAINER_TEST_SLOW_RANK, a step callback
    of tests/trainer/faults.py): its compute
    gauge carries that, and rank 0, which then waits for its gradients, shows it as collective wait."""
    port = free_port()
    run_dir = tmp_path / "run"
    proc = start(run_dir, 2, [*SMALL, "train.steps=60", "checkpoint.every_steps=0", "eval.sample_tokens=0",
                              f"metrics.port={port}"],
                 module=FAULTS, env={"TRAINER_TEST_SLOW_RANK": "1", "TRAINER_TEST_SLOW_S": "0.25"})
    samples: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count('"event": "step"') >= 5):
            assert proc.poll() is None and time.monotonic() < deadline, "no step 5 within 120 s"
            time.sleep(0.1)
        for _ in range(6):
            for rank in (0, 1):
                samples[rank].append(_scrape(port + rank))  # local rank r serves on metrics.port + r
            time.sleep(0.3)
        assert proc.wait(timeout=120) == 0
    finally:
        kill_group(proc)
    assert summary(run_dir)["status"] == "completed"

    def median(rank: int, name: str) -> float:
        return statistics.median(s[f'trainer_rank_{name}_seconds{{rank="{rank}"}}'] for s in samples[rank])

    for rank in (0, 1):  # each endpoint serves its own global rank only
        assert all(f'rank="{1 - rank}"' not in key for s in samples[rank] for key in s)
    assert median(1, "compute") - median(0, "compute") >= 0.2
    assert median(0, "collective_wait") - median(1, "collective_wait") >= 0.2
    # Both ranks take the slow rank's time per step; neither waits for data.
    assert median(0, "step") >= 0.25 and median(1, "step") >= 0.25
    assert median(0, "data_wait") < 0.1 and median(1, "data_wait") < 0.1
