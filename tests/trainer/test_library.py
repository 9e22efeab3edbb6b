"""The trainer's guarantees used alone, as a team's own loop would: the checkpointer, the sharded dataset and
sampler, the watchdog and the preemption helper in a plain PyTorch loop (preempted, then resumed to the same
weights as a run never interrupted); the preemption helper's signals; the metrics processor's sinks and ETA.

Run: .venv/bin/pytest tests/trainer/test_library.py -q
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.trainer.launch import ROOT, child_env
from trainer.metrics import JsonlLog, MetricsProcessor, TrainerMetrics, read_jsonl
from trainer.preemption import Preemption

# Trains plain loops across worker processes.
pytestmark = pytest.mark.integration

OWN_LOOP = textwrap.dedent("""
    import json, os, signal, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from trainer.checkpoint import CheckpointManager
    from gpu_train.spec.trainer_config import WatchdogConfig
    from trainer.data import GlobalSampler, open_dataset, read_step
    from trainer.distributed import free_port
    from trainer.outputs import state_sha256
    from trainer.preemption import Preemption
    from trainer.watchdog import Watchdog

    ckpt_dir, steps, preempt_after = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(257, 32), torch.nn.Linear(32, 257))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ds = open_dataset("synthetic", context=16)
    sampler = GlobalSampler(ds.num_windows, global_batch=8, seed=1, shard_windows=ds.shard_windows, block_shards=2)
    ckpt = CheckpointManager(ckpt_dir, keep=2)          # rank, world and device from the process group
    state = {}
    found = ckpt.resume(model, opt, apply=state.update)
    if found:
        sampler.load_state_dict(state["sampler"])
    watchdog = Watchdog(WatchdogConfig(floor_s=120, startup_s=300), rank=0)
    watchdog.start()
    with Preemption(sigint=True) as preemption:
        for step in range(sampler.next_step, steps):
            watchdog.begin_step(step + 1)
            xy, _ = read_step(ds, sampler, step, rank=0, world=1, end_step=steps)
            xy = torch.from_numpy(xy)
            loss = torch.nn.functional.cross_entropy(model(xy[:, :-1]).reshape(-1, 257), xy[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            watchdog.end_step(0.0)
            if step + 1 == preempt_after:
                os.kill(os.getpid(), signal.SIGTERM)    # as a spot reclaim would
            last = preemption.preempted() or step + 1 == steps
            if last or (step + 1) % 2 == 0:
                ckpt.save(step + 1, model, opt, {"sampler": sampler.state_dict()}, {"note": "own loop"}, block=last)
            if last:
                break
    watchdog.stop()
    ckpt.close()
    ds.close()
    print(json.dumps({"resumed_from": str(found) if found else None, "step": step + 1,
                      "preempted": preemption.preempted(), "params": state_sha256(model.state_dict())}))
    dist.destroy_process_group()
""")


def _own_loop(ckpt_dir, steps: int, preempt_after: int = 0) -> dict:
    proc = subprocess.run([sys.executable, "-c", OWN_LOOP, str(ckpt_dir), str(steps), str(preempt_after)],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_library_parts_resume_a_plain_loop_exactly(tmp_path):
    straight = _own_loop(tmp_path / "straight", 8)
    assert straight == {"resumed_from": None, "step": 8, "preempted": False, "params": straight["params"]}

    first = _own_loop(tmp_path / "ckpt", 8, preempt_after=5)
    assert first["preempted"] and first["step"] == 5 and first["params"] != straight["params"]
    second = _own_loop(tmp_path / "ckpt", 8)
    assert second["resumed_from"].endswith("step_000000005") and second["step"] == 8
    assert second["params"] == straight["params"]


def test_preemption_catches_sigterm_and_optionally_sigint_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with Preemption() as preemption:
        assert signal.getsignal(signal.SIGINT) == before[1]  # SIGINT only when asked for
        assert not preemption.preempted() and preemption.at is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.preempted() and preemption.at is not None
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with Preemption(sigint=True) as preemption:
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without the handler
        assert preemption.preempted()
    assert signal.getsignal(signal.SIGINT) == before[1]


def test_the_metrics_processor_feeds_every_sink_and_logs_an_eta(tmp_path, caplog):
    class Tracker:
        def __init__(self) -> None:
            self.points: list[tuple[int, dict]] = []

        def log_metrics(self, metrics: dict, step: int) -> None:
            self.points.append((step, metrics))

    tracker, prometheus = Tracker(), TrainerMetrics(port=0, rank=0)
    metrics = MetricsProcessor(prometheus=prometheus, jsonl=JsonlLog(tmp_path / "metrics.jsonl"), tracker=tracker,
                               total_steps=4, tokens_per_step=1000, log_every=2, tracking_every=2, progress=False)
    caplog.set_level(logging.INFO, logger="trainer")
    for step in (1, 2, 3, 4):
        metrics.log(step, {"loss": 5.0 - step, "lr": 1e-3, "tokens": 1000 * step, "step_s": 0.5, "data_wait_s": 0.1,
                           "forward_backward_s": 0.3, "optimizer_s": 0.05, "compute_s": 0.3,
                           "collective_wait_s": 0.05, "checkpoint_block_s": 0.0, "checkpoint_age_s": None})
    metrics.log(4, {"event": "eval", "val_loss": 1.5, "best_val_loss": 1.5, "best_val_step": 4,
                    "evals_without_improvement": 0, "eval_s": 0.2, "windows": 8})
    metrics.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["event"], r["step"]) for r in records] == [("step", 1), ("step", 2), ("step", 3), ("step", 4),
                                                          ("eval", 4)]
    assert records[0]["tokens_per_s"] == 2000 and records[0]["mfu"] is None  # no GPU peak on a CPU
    assert [s for s, _ in tracker.points] == [2, 4, 4]  # every tracking_every steps, then the evaluation
    assert tracker.points[-1][1] == {"val_loss": 1.5, "best_val_loss": 1.5}
    sample = prometheus.registry.get_sample_value
    assert sample("trainer_step") == 4 and sample("trainer_val_loss") == 1.5
    assert sample("trainer_tokens_total") == 4000 and sample("trainer_rank_compute_seconds", {"rank": "0"}) == 0.3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines[0].startswith("step 2/4 loss 3.0000") and " ETA 0:00:" in lines[0]
    assert lines[1].startswith("step 4/4") and lines[1].endswith("ETA 0:00:00")
    assert "validation loss 1.5000" in lines[2]
