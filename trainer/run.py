"""What the bundled trainer opens once its inputs are checked and its checkpoint resumed: config.json, the MLflow
run, the metrics sinks, the watchdog and the step clock.

Usage (trainer/train.py):
    sinks = open_outputs(cfg, env, run_dir, exits, status=lambda: trainer.status, run_id=..., run_key=..., ...)
    sinks.tracker, sinks.metrics, sinks.watchdog, sinks.clock   # the Trainer keeps them; `exits` closes them

Opened only after the checks and the resume, so that a refused launch changes nothing on disk or in MLflow.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_train.sizing.flops import gpu_peak_flops, model_flops_per_token
from gpu_train.sizing.layout import MESH_DIMS, Layout
from gpu_train.spec.trainer_config import Config, flatten, to_dict
from trainer.distributed import DistEnv
from trainer.metrics import JsonlLog, MetricsProcessor, StepClock, TrainerMetrics
from trainer.parallelize import model_params
from trainer.tracking import Tracker
from trainer.watchdog import Watchdog

log = logging.getLogger("trainer")
MLFLOW_STATUS = {"completed": "FINISHED", "stopped_early": "FINISHED", "preempted": "KILLED"}


@dataclass(frozen=True)
class RunSinks:
    """What open_outputs opened, for the Trainer to keep (each is closed by the exit stack it was given)."""

    tracker: Tracker  # the MLflow run (rank 0; a no-op elsewhere)
    metrics: MetricsProcessor  # one record per step to the console, Prometheus, metrics.jsonl and MLflow
    watchdog: Watchdog  # this rank's hang detection, started by the loop
    clock: StepClock  # splits a step's compute from its collective wait


def parallel_mode(layout: Layout, pp_schedule: str) -> str:
    """How the model is spread at this layout, as trainer/runner.py and trainer/pipeline.py build it: pipeline
    stages (with their schedule) and tensor parallelism when used, then the data parallelism: DDP when nothing
    else is used, else FSDP2, sharding over dp_shard (HSDP when it also replicates) or replicating only."""
    parts = []
    if layout.pp > 1:
        parts.append(f"pp ({pp_schedule})")
    if layout.tp > 1:
        parts.append("tp")
    if not layout.sharded:
        parts.append("ddp")
    elif layout.dp_shard > 1:
        parts.append("hsdp" if layout.dp_replicate > 1 else "fsdp")
    else:
        parts.append("fsdp2 replicated")
    return " + ".join(parts)


def layout_text(layout: Layout, pp_schedule: str) -> str:
    """The start-up line's layout: `dp=2 (replicate 2 x shard 1) x tp=1 x pp=1, ddp`."""
    return (f"dp={layout.dp} (replicate {layout.dp_replicate} x shard {layout.dp_shard}) x tp={layout.tp} x "
            f"pp={layout.pp}, {parallel_mode(layout, pp_schedule)}")


def open_outputs(cfg: Config, env: DistEnv, run_dir: Path, exits: contextlib.ExitStack, *,
                 status: Callable[[], str], run_id: str | None, run_key: str, carried: list[list[Any]],
                 resumed_from: str | None, step: int, val_loss: float | None, manifest_sha256: str,
                 global_batch: int, accum: int, layout: Layout, dtype: torch.dtype | None) -> RunSinks:
    """config.json, tracking, metrics and the watchdog, each closed (in reverse) by `exits`; the MLflow run with
    `status()` (the run's status when it closes). `run_key` goes into every checkpoint from the first one on,
    before MLflow may have answered with the run id: a relaunch from a checkpoint that holds no run id finds the
    run by its key (trainer/tracking.py). `carried`: the checkpoint's metric points MLflow may lack
    (Tracker.unsent)."""
    tc = cfg.train
    rank0 = env.rank == 0
    if rank0:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    tracker = Tracker.create(cfg.tracking, run_dir=run_dir, resume_run_id=run_id, run_key=run_key, enabled=rank0,
                             carried=carried)
    exits.callback(lambda: tracker.close(status=MLFLOW_STATUS.get(status(), "FAILED")))
    tracker.log_params(flatten(cfg))
    tracker.log_dataset(cfg.data.uri, manifest_sha256)
    prometheus = TrainerMetrics(port=cfg.metrics.port + env.local_rank if cfg.metrics.port else 0, rank=env.rank,
                                restarts=env.restart_count, val_loss=val_loss)
    n_params, n_nonemb = model_params(cfg.model)  # the whole model's, whatever part of it this rank holds
    metrics = MetricsProcessor(
        prometheus=prometheus, jsonl=JsonlLog(run_dir / "metrics.jsonl") if rank0 else None,
        tracker=tracker, total_steps=tc.steps, tokens_per_step=tc.global_batch_tokens,
        flops_per_token=model_flops_per_token(cfg.model, n_nonemb), world_size=env.world_size,
        peak_flops=gpu_peak_flops(torch.cuda.get_device_name(env.device) if env.is_cuda else None),
        log_every=cfg.metrics.log_every, tracking_every=cfg.tracking.log_every, console=rank0, start_step=step)
    exits.callback(metrics.close)
    metrics.log(step, {
        "event": "start", "world_size": env.world_size, "restart_count": env.restart_count,
        "resumed_from": resumed_from, "global_batch": global_batch, "grad_accum": accum,
        "layout": dict(zip(MESH_DIMS, layout.shape, strict=True)),
        "params": n_params, "non_embedding_params": n_nonemb})
    if rank0:
        log.info("model %.2fM params (%.2fM non-embedding), world %d, global batch %d x %d tokens, %d micro "
                 "batches of %d per rank, %s, %s", n_params / 1e6, n_nonemb / 1e6, env.world_size,
                 global_batch, cfg.model.context, accum, tc.micro_batch_size,
                 layout_text(layout, tc.pp_schedule), "bf16" if dtype else "fp32")
    watchdog = Watchdog(cfg.watchdog, rank=env.rank, local_rank=env.local_rank, dump_dir=run_dir / "watchdog")
    exits.callback(watchdog.stop)
    return RunSinks(tracker=tracker, metrics=metrics, watchdog=watchdog, clock=StepClock(env.device))
