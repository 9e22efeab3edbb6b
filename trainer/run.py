"""What the bundled trainer opens once its inputs are checked and its checkpoint resumed, and what it writes when
it stops: config.json, the MLflow run, the metrics sinks and the watchdog; the summary and the run's outputs.

Usage (trainer/train.py):
    open_outputs(trainer, run_id, resumed_from)   # on every rank, after resume; closed by trainer.close()
    summary = finish(trainer, status)             # collective: the final save, the weights' hash, the outputs

Opened only after the checks and the resume, so that a refused launch changes nothing on disk or in MLflow.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

import torch

from gpu_train.spec.layout import MESH_DIMS, Layout
from gpu_train.spec.trainer_config import flatten, to_dict
from trainer import Tracker, TrainingFailed, Watchdog, flops, outputs, state_sha256
from trainer.metrics import JsonlLog, MetricsProcessor, StepClock, TrainerMetrics
from trainer.parallelize import model_params

if TYPE_CHECKING:
    from trainer.train import Trainer

log = logging.getLogger("trainer")
MLFLOW_STATUS = {"completed": "FINISHED", "stopped_early": "FINISHED", "preempted": "KILLED"}


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


def open_outputs(t: Trainer, run_id: str | None, resumed_from: str | None) -> None:
    """config.json, tracking, metrics and the watchdog, each closed (in reverse) by the trainer's close()."""
    cfg, env, tc = t.cfg, t.env, t.cfg.train
    rank0 = env.rank == 0
    if rank0:
        (t.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    # The run key goes into every checkpoint from the first one on, before MLflow may have answered with the run
    # id: a relaunch from a checkpoint that holds no run id finds the run by its key (trainer/tracking.py).
    t.run_key = t.run_key or uuid.uuid4().hex
    t.tracker = Tracker.create(cfg.tracking, run_dir=t.run_dir, resume_run_id=run_id, run_key=t.run_key,
                               enabled=rank0)
    t.exits.callback(lambda: t.tracker.close(status=MLFLOW_STATUS.get(t.status, "FAILED")))
    t.tracker.log_params(flatten(cfg))
    t.tracker.log_dataset(cfg.data.uri, t.ds.manifest_sha256)
    prometheus = TrainerMetrics(port=cfg.metrics.port + env.local_rank if cfg.metrics.port else 0, rank=env.rank,
                                restarts=env.restart_count, val_loss=t.evals.last)
    n_params, n_nonemb = model_params(cfg.model)  # the whole model's, whatever part of it this rank holds
    t.metrics = MetricsProcessor(
        prometheus=prometheus, jsonl=JsonlLog(t.run_dir / "metrics.jsonl") if rank0 else None,
        tracker=t.tracker, total_steps=tc.steps, tokens_per_step=tc.global_batch_tokens,
        flops_per_token=flops.model_flops_per_token(cfg.model, n_nonemb), world_size=env.world_size,
        peak_flops=flops.gpu_peak_flops(torch.cuda.get_device_name(env.device) if env.is_cuda else None),
        log_every=cfg.metrics.log_every, tracking_every=cfg.tracking.log_every, console=rank0, start_step=t.step)
    t.exits.callback(t.metrics.close)
    t.metrics.log(t.step, {
        "event": "start", "world_size": env.world_size, "restart_count": env.restart_count,
        "resumed_from": resumed_from, "global_batch": t.global_batch, "grad_accum": t.accum,
        "layout": dict(zip(MESH_DIMS, t.runner.layout.shape, strict=True)),
        "params": n_params, "non_embedding_params": n_nonemb})
    if rank0:
        log.info("model %.2fM params (%.2fM non-embedding), world %d, global batch %d x %d tokens, %d micro "
                 "batches of %d per rank, %s, %s", n_params / 1e6, n_nonemb / 1e6, env.world_size,
                 t.global_batch, cfg.model.context, t.accum, tc.micro_batch_size,
                 layout_text(t.runner.layout, tc.pp_schedule), "bf16" if t.dtype else "fp32")
    t.watchdog = Watchdog(cfg.watchdog, rank=env.rank, local_rank=env.local_rank, dump_dir=t.run_dir / "watchdog")
    t.exits.callback(t.watchdog.stop)
    t.clock = StepClock(env.device)
    # A gradient hook on the token embedding's output marks the end of this rank's own backward work
    # (trainer/metrics.py); hooks inside a compiled region break torch.compile's graph, so not there.
    if not tc.compile and t.model.tok_emb is not None:  # a middle pipeline stage has no embedding
        t.exits.callback(t.model.tok_emb.register_forward_hook(t.on_embedding).remove)


def finish(t: Trainer, status: str) -> dict[str, Any]:
    """Wait for the last save, then the summary and (rank 0) the outputs; returns the summary. Collective."""
    tc, env, ckpt = t.cfg.train, t.env, t.checkpointer
    with t.watchdog.allowance("finish", t.cfg.watchdog.checkpoint_s, "watchdog.checkpoint_s, end of run"):
        ckpt.wait()
        if status != "preempted" and ckpt.failed and ckpt.failed[-1].step == t.step and (
                not ckpt.saved or ckpt.saved[-1].step < t.step):
            raise TrainingFailed(f"the final checkpoint (step {t.step}) was not saved: {ckpt.failed[-1].error}")
        tokens_per_s = ((t.step - t.start_step) * tc.global_batch_tokens / t.elapsed
                        if t.step > t.start_step else 0.0)  # this launch's throughput
        full = t.runner.full_state_dict()  # collective (shards and stages gathered): rank 0 gets it all
        summary = outputs.run_summary(
            status=status, step=t.step, tokens=t.tokens_seen, loss=t.loss_value, evals=t.evals,
            params_sha256=state_sha256(full) if env.rank == 0 else None, restarts=env.restart_count,
            tokens_per_s=tokens_per_s, mfu=t.metrics.mfu(tokens_per_s), device=env.device,
            signal=t.stop_signal if status == "preempted" else None)
        summary.update(t.energy.finish(env, t.tracker, t.step))  # collective: all GPUs' energy
        if t.budget is not None:  # a sweep trial: the controller reads how it ended
            t.budget.status(status, params_sha256=summary["params_sha256"])
        if env.rank == 0:
            outputs.write_outputs(outputs.RunOutputs(
                cfg=t.cfg, run_dir=t.run_dir, tokenizer=t.tokenizer, tracker=t.tracker, checkpointer=ckpt,
                evals=t.evals, first=t.first, manifest_sha256=t.ds.manifest_sha256, device=env.device), full, summary)
    return summary
