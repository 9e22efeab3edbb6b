"""The training loop: a Trainer that builds everything once, then trains step by step.

Usage (normally through `python -m trainer`, see trainer/__main__.py):
    from trainer.config import build_config
    from trainer.train import train
    summary = train(build_config("tiny", overrides=["train.steps=20"]), run_dir=Path("runs/dev"))
    summary["status"]      # "completed", "stopped_early" (eval.early_stopping_patience) or "preempted"; bad
                           # input raises BadInput, a retryable failure TrainingFailed (trainer/errors.py)

or with the Trainer itself, inside a process group (`train` does exactly this):
    env = init_distributed(timeout_s=collective_timeout_s(cfg.watchdog))
    with Trainer(cfg, run_dir, env, step_callbacks=[my_callback]) as trainer:
        summary = trainer.finish(trainer.train())

The Trainer is built from the trainer's library parts, each usable alone: trainer.data (dataset and
GlobalSampler), trainer.parallelize (model, DDP/FSDP2, optimizer, schedule), trainer.checkpoint
(CheckpointManager), trainer.tracking (Tracker), trainer.metrics (MetricsProcessor), trainer.watchdog
(Watchdog) and trainer.preemption (Preemption). `__init__` checks the inputs on every rank, agrees on the
verdict, builds the model and resumes from the newest checkpoint every rank can load; `train()` runs
`train_step()` (data, `forward_backward_step()`, the step's all-reduce, the optimizer) until train.steps, then
evaluates, checkpoints and logs; `finish()` writes the outputs.

Step s (0-based) trains on global batch s of the GlobalSampler (the block shuffle over the dataset's shards);
each rank takes its contiguous slice and splits it into micro batches, so the global batch and the sample
order never depend on the number of workers. Decisions every rank must take together go through
collectives: after each step's backward pass one all-reduce carries the loss, "some rank got SIGTERM", "some
rank hit bad data" and "some rank hit a storage failure", before the optimizer step. Then:
- SIGTERM anywhere: every rank finishes the step, saves a checkpoint synchronously and returns "preempted";
- a non-finite loss (or gradient norm): the step is not applied, nothing is saved, BadInput (exit 2), since
  a restart would replay the same step from the same checkpoint;
- a data error: BadInput for a missing or corrupt shard, TrainingFailed for a storage outage.
The evaluation of a step runs before that step's checkpoint, which records it, so a resumed run stops
early exactly where an uninterrupted one would. docs/trainer.md has the rest.

Step callbacks: `step_callbacks` (empty in production) are called as `callback(trainer, point, step)` at two
points of every step, `step` being the 0-based step being trained:
- "after_forward": the last micro batch's loss is computed, its backward pass not yet run;
- "before_sync": every backward pass is done, the step's all-reduce not yet joined (the watchdog is in its
  "collective" phase, and the other ranks wait in the all-reduce).
Tests inject faults through them (tests/trainer/faults.py: a killed, hung or slow rank).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainer import evaluate as evaluation
from trainer import flops
from trainer.checkpoint import CheckpointInvalid, CheckpointManager
from trainer.config import Config, batch_layout, flatten, to_dict
from trainer.data import DataError, GlobalSampler
from trainer.distributed import DistEnv, agree, init_distributed, seed_everything, shutdown
from trainer.errors import BadInput, TrainingFailed, one_line
from trainer.evaluate import EvalState, reduce_eval
from trainer.metrics import JsonlLog, MetricsProcessor, StepClock, TrainerMetrics, batch_hash
from trainer.outputs import RunOutputs, dataset_tokenizer, full_state_dict, state_sha256, write_outputs
from trainer.parallelize import build_model, build_optimizer, build_scheduler, resolve_dtype
from trainer.preemption import Preemption
from trainer.preflight import check_inputs, checkpoint_dir_of, compatibility_problem, open_checked_dataset
from trainer.tracking import TAG_DATASET_MANIFEST, TAG_DATASET_URI, Tracker
from trainer.watchdog import Watchdog, checkpoint_timeout_s, collective_timeout_s, nccl_env, nccl_heartbeat_s

log = logging.getLogger("trainer")

StepCallback = Callable[["Trainer", str, int], None]
MLFLOW_STATUS = {"completed": "FINISHED", "stopped_early": "FINISHED", "preempted": "KILLED"}


def train(cfg: Config, run_dir: Path, *, step_callbacks: Iterable[StepCallback] = ()) -> dict[str, Any]:
    """Join the process group, train, write the outputs; returns the summary (also in RUN_DIR/summary.json)."""
    wd = cfg.watchdog
    nccl = {**nccl_env(), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(nccl_heartbeat_s(wd))}
    env = init_distributed(timeout_s=collective_timeout_s(wd), nccl_env=nccl)
    try:
        with Trainer(cfg, Path(run_dir), env, step_callbacks=step_callbacks) as trainer:
            return trainer.finish(trainer.train())
    finally:
        shutdown()


class Trainer:
    """One training run on this rank; see the module docstring. Every method is called on every rank."""

    def __init__(self, cfg: Config, run_dir: Path, env: DistEnv, *,
                 step_callbacks: Iterable[StepCallback] = ()) -> None:
        self.cfg, self.run_dir, self.env = cfg, Path(run_dir), env
        self.step_callbacks: list[StepCallback] = list(step_callbacks)
        self.status = "failed"  # what the MLflow run is closed with unless train()/finish() say otherwise
        self.step, self.tokens_seen, self.loss_value = 0, 0, math.nan  # the loss of the last completed step
        self.evals = EvalState()
        self.first: tuple[int, float] | None = None  # (step, loss) of this launch's first step
        self.start_step, self.elapsed, self._reported_saves = 0, 0.0, 0
        self._exit = contextlib.ExitStack()  # everything opened so far, closed in reverse by close()
        try:
            _setup_logging(env)
            # `kill -USR1 <pid>` prints every thread's stack: the first thing to look at in a hung collective.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            budget = os.environ.get("TRAINER_SHUTDOWN_TIMEOUT_S", "")
            self.preemption = Preemption(shutdown_timeout_s=float(budget) if budget.isdigit() else None).install()
            self._exit.callback(self.preemption.uninstall)
            self._open_inputs()
            self.global_batch, self.accum = batch_layout(cfg, env.world_size)
            seed_everything(cfg.train.seed, cfg.train.deterministic)
            self.dtype = resolve_dtype(cfg, env)
            self._build_model()
            self.checkpointer = CheckpointManager(
                checkpoint_dir_of(cfg, self.run_dir), cfg.checkpoint.remote_uri, keep=cfg.checkpoint.keep, env=env,
                async_save=cfg.checkpoint.async_save, endpoint_url=cfg.checkpoint.endpoint_url or None,
                timeout_s=checkpoint_timeout_s(cfg.watchdog))
            self._exit.callback(self.checkpointer.close)
            run_id, resumed_from = self._resume()
            self._open_outputs(run_id, resumed_from)
        except BaseException:
            self._exit.close()
            raise

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.status = "failed"
        self.close()

    def close(self) -> None:
        """Stop the watchdog, close the tracker (FINISHED, KILLED or FAILED), metrics, checkpoints and data."""
        self._exit.close()

    # ---------------------------------------------------------------------------------------------- building
    def _open_inputs(self) -> None:
        """Check the inputs on every rank and agree on the verdict before anything is written."""
        cfg, env = self.cfg, self.env
        self.val = self.tokenizer = None
        problem = None
        try:
            self.ds = check_inputs(cfg, self.run_dir, world_sizes=[env.world_size],
                                   local_world_size=env.local_world_size)
            self._exit.callback(self.ds.close)
            if cfg.eval.every_steps:
                self.val = open_checked_dataset(cfg, split="val")
                self._exit.callback(self.val.close)
            if env.rank == 0 and (cfg.eval.sample_tokens or cfg.tracking.register_name):
                self.tokenizer = dataset_tokenizer(cfg)
        except BadInput as exc:
            problem = str(exc)
        problem = agree(problem, env.world_size)
        if problem:
            raise BadInput(problem)

    def _build_model(self) -> None:
        """Fresh weights from train.seed, optimizer, schedule and sampler (again after a failed partial load)."""
        self.model, self.wrapped = build_model(self.cfg, self.env, self.dtype)
        self.optimizer = build_optimizer(self.model, self.cfg, self.env.device)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        self.sampler = self._new_sampler()

    def _new_sampler(self) -> GlobalSampler:
        return GlobalSampler(self.ds.num_windows, global_batch=self.global_batch, seed=self.cfg.train.seed,
                             shard_windows=self.ds.shard_windows, block_shards=self.cfg.data.block_shards)

    def _resume(self) -> tuple[str | None, str | None]:
        """Load the newest checkpoint every rank can load (refusing an incompatible one before anything is
        written); returns (its MLflow run id, its path), or (None, None) to start from step 0."""
        restored: dict[str, Any] = {}

        def check(manifest: dict[str, Any], where: str) -> None:
            reason = compatibility_problem(self.cfg, manifest, where, self.ds.manifest_sha256)
            if reason:
                raise BadInput(reason)

        def apply(state: dict[str, Any]) -> None:
            step = state["step"]
            if not isinstance(step, int) or step < 0:
                raise CheckpointInvalid(f"trainer state step {step!r} is not a whole number")
            sampler = self._new_sampler()
            sampler.load_state_dict(state["sampler"])
            self.scheduler.load_state_dict(state["scheduler"])
            if sampler.next_step != step:
                raise CheckpointInvalid(f"sampler is at step {sampler.next_step} but the checkpoint is at step {step}")
            restored.update(sampler=sampler, step=step, tokens_seen=int(state["tokens"]),
                            loss_value=float(state.get("loss", math.nan)), evals=EvalState.from_dict(state.get("eval")),
                            run_id=state.get("mlflow_run_id"))

        found = self.checkpointer.resume(self.model, self.optimizer, check=check, apply=apply)
        if found is None:
            if self.checkpointer.model_touched:  # a load that failed part-way may have changed parameters
                self._build_model()
            return None, None
        run_id = restored.pop("run_id")
        for key, value in restored.items():
            setattr(self, key, value)
        log.info("resumed from %s at step %d (%d tokens seen)", found, self.step, self.tokens_seen)
        return run_id, str(found)

    def _open_outputs(self, run_id: str | None, resumed_from: str | None) -> None:
        """Only now, so that a refused launch changes nothing: config.json, tracking, metrics, the watchdog."""
        cfg, env, t = self.cfg, self.env, self.cfg.train
        rank0 = env.rank == 0
        if rank0:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        self.tracker = Tracker.create(cfg.tracking, run_dir=self.run_dir, resume_run_id=run_id, enabled=rank0)
        self._exit.callback(lambda: self.tracker.close(status=MLFLOW_STATUS.get(self.status, "FAILED")))
        self.tracker.log_params(flatten(cfg))
        self.tracker.set_tags({TAG_DATASET_URI: cfg.data.uri, TAG_DATASET_MANIFEST: self.ds.manifest_sha256})
        prometheus = TrainerMetrics(port=cfg.metrics.port + env.local_rank if cfg.metrics.port else 0, rank=env.rank)
        prometheus.restarts.set(env.restart_count)
        if self.evals.last is not None:
            prometheus.observe_eval(self.evals.last)
        n_params, n_nonemb = self.model.num_params(non_embedding=False), self.model.num_params(non_embedding=True)
        m = cfg.model
        self.metrics = MetricsProcessor(
            prometheus=prometheus, jsonl=JsonlLog(self.run_dir / "metrics.jsonl") if rank0 else None,
            tracker=self.tracker, total_steps=t.steps, tokens_per_step=t.global_batch_tokens,
            flops_per_token=flops.flops_per_token(n_nonemb, m.n_layer, m.n_head, m.d_model // m.n_head, m.context,
                                                  lm_head_params=m.vocab_size * m.d_model),
            peak_flops=self.peak_flops, world_size=env.world_size, log_every=cfg.metrics.log_every,
            tracking_every=cfg.tracking.log_every, console=rank0, start_step=self.step)
        self._exit.callback(self.metrics.close)
        self.metrics.log(self.step, {
            "event": "start", "world_size": env.world_size, "restart_count": env.restart_count,
            "resumed_from": resumed_from, "global_batch": self.global_batch, "grad_accum": self.accum,
            "params": n_params, "non_embedding_params": n_nonemb})
        if rank0:
            log.info("model %.2fM params (%.2fM non-embedding), world %d, global batch %d x %d tokens, %d micro "
                     "batches of %d per rank, %s, %s", n_params / 1e6, n_nonemb / 1e6, env.world_size,
                     self.global_batch, m.context, self.accum, t.micro_batch_size, t.parallel,
                     "bf16" if self.dtype else "fp32")
        self.watchdog = Watchdog(cfg.watchdog, rank=env.rank, local_rank=env.local_rank)
        self._exit.callback(self.watchdog.stop)
        self.clock = StepClock(env.device)
        # When gradients reach the token embedding's output, this rank's own backward work is done
        # (trainer/metrics.py). A gradient hook on that tensor, added by a forward hook, leaves the autograd
        # graph as it is; hooks added inside a compiled region break torch.compile's graph, so a compiled
        # model goes without.
        if not t.compile:
            self._exit.callback(self.model.tok_emb.register_forward_hook(self._on_embedding).remove)

    def _on_embedding(self, _module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda _grad: self.clock.grads_ready())

    @property
    def peak_flops(self) -> float | None:
        return flops.gpu_peak_flops(torch.cuda.get_device_name(self.env.device) if self.env.is_cuda else None)

    def state_dict(self) -> dict[str, Any]:
        """The loop's own state, saved in every checkpoint (JSON)."""
        return {"step": self.step, "tokens": self.tokens_seen, "loss": self.loss_value,
                "sampler": self.sampler.state_dict(), "scheduler": self.scheduler.state_dict(),
                "mlflow_run_id": self.tracker.run_id, "world_size": self.env.world_size,
                "dataset": {"uri": self.cfg.data.uri, "manifest_sha256": self.ds.manifest_sha256},
                "eval": self.evals.to_dict()}

    # ---------------------------------------------------------------------------------------------- the loop
    def train(self) -> str:
        """Train from self.step to train.steps, or until SIGTERM or early stopping; returns the status."""
        t, patience = self.cfg.train, self.cfg.eval.early_stopping_patience
        self.start_step, t0 = self.step, time.perf_counter()
        self.watchdog.start()
        status = self._nothing_to_train()
        if status is None:
            status = "completed"
            self.wrapped.train()
        while status == "completed" and self.step < t.steps:
            timings, stop = self.train_step()
            t_eval = time.perf_counter()
            if self.cfg.eval.every_steps and (self.step % self.cfg.eval.every_steps == 0 or self.step == t.steps):
                self.evaluate()
            eval_s = time.perf_counter() - t_eval
            early = self.evals.exhausted(patience) and self.step < t.steps
            final = stop or early or self.step == t.steps
            every = self.cfg.checkpoint.every_steps
            ckpt_s = self.save_checkpoint(block=final) if final or (every and self.step % every == 0) else 0.0
            self._log_step(timings, eval_s, ckpt_s)
            if stop:
                status = "preempted"
                saved = self.checkpointer.saved
                self.preemption.report(self.step, saved=bool(saved) and saved[-1].step == self.step)
            elif early:
                status = "stopped_early"
                if self.env.rank == 0:
                    log.warning("early stopping at step %d: no new best validation loss in %d evaluations "
                                "(eval.early_stopping_patience=%d); best %.4f at step %s", self.step,
                                self.evals.bad, patience, self.evals.best, self.evals.best_step)
        self.watchdog.disarm()
        self.checkpointer.wait()
        self._report_saves()
        self.elapsed = time.perf_counter() - t0
        self.status = status
        return status

    def _nothing_to_train(self) -> str | None:
        """The status when this launch trains no step (stopped early before, or SIGTERM while starting)."""
        patience = self.cfg.eval.early_stopping_patience
        if self.evals.exhausted(patience):
            log.info("the run stopped early at step %d (eval.early_stopping_patience=%d: no new best validation "
                     "loss in %d evaluations, best %.4f at step %s): nothing to train", self.step, patience,
                     self.evals.bad, self.evals.best, self.evals.best_step)
            return "stopped_early"
        if self.step >= self.cfg.train.steps:
            log.info("the checkpoint is already at train.steps=%d: nothing to train", self.cfg.train.steps)
        # SIGTERM that arrived while starting (loading, resuming): stop before training, nothing new to save.
        flag = torch.tensor([float(self.preemption.preempted())], device=self.env.device)
        dist.all_reduce(flag)
        if flag.item() > 0 and self.step < self.cfg.train.steps:
            log.warning("SIGTERM before the first step: stopping at step %d without a new checkpoint", self.step)
            return "preempted"
        return None

    def train_step(self) -> tuple[dict[str, Any], bool]:
        """One optimizer step on global batch self.step; returns (its timings, whether any rank got SIGTERM)."""
        env, wd, step = self.env, self.watchdog, self.step
        wd.begin_step(step + 1)
        t0 = time.perf_counter()
        windows, indices, fault = self._load_batch(step)
        t_data = time.perf_counter()
        wd.phase("forward_backward")
        self.clock.start()
        loss_sum = self.forward_backward_step(windows)
        t_fb = time.perf_counter()
        # One all-reduce: the mean loss, and whether any rank got SIGTERM, bad data or a storage failure.
        wd.phase("collective")
        self._callbacks("before_sync", step)
        flags = torch.stack([loss_sum.float(), *(torch.tensor(float(x), device=env.device) for x in (
            self.preemption.preempted(), fault is not None and fault[0] == "bad",
            fault is not None and fault[0] == "failed"))])
        dist.all_reduce(flags)
        self.clock.synced()
        values = flags.tolist()  # one copy to the host; on CUDA it waits for the step's GPU work
        t_sync = time.perf_counter()
        if values[2] > 0 or values[3] > 0:
            _raise_agreed_fault(fault, env.world_size)
        loss = values[0] / env.world_size
        if not math.isfinite(loss):
            raise BadInput(self._diverged(step + 1, f"loss {loss}"))
        wd.phase("optimizer")
        if self.cfg.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if not math.isfinite(norm):
                raise BadInput(self._diverged(step + 1, f"gradient norm {norm}"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        t_opt = time.perf_counter()
        wd.end_step(t_opt - t0)
        self.step, self.loss_value = step + 1, loss
        self.tokens_seen += self.cfg.train.global_batch_tokens
        self.first = self.first or (step + 1, loss)
        compute, wait = self.clock.split()
        timings = {"start": t0, "data_wait_s": t_data - t0, "forward_backward_s": t_fb - t_data,
                   "optimizer_s": t_opt - t_sync, "compute_s": compute + (t_opt - t_sync), "collective_wait_s": wait}
        if self.cfg.metrics.batch_hash:
            gathered: list[list[int] | None] = [None] * env.world_size
            dist.all_gather_object(gathered, indices)
            timings["batch_sha256"] = batch_hash([i for part in gathered for i in part])
        return timings, values[1] > 0

    def forward_backward_step(self, windows: torch.Tensor) -> torch.Tensor:
        """Forward and backward over this rank's micro batches, gradients synced on the last one only;
        returns the sum of the micro-batch losses, each divided by the number of micro batches."""
        t, fsdp = self.cfg.train, self.cfg.train.parallel == "fsdp"
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)  # under torch.compile, DDP is inside
        loss_sum = torch.zeros((), device=self.env.device)
        for micro in range(self.accum):
            chunk = windows[micro * t.micro_batch_size:(micro + 1) * t.micro_batch_size]
            last = micro == self.accum - 1
            if fsdp:
                self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if fsdp or last else ddp.no_sync()
            with sync, self._autocast():
                _, loss = self.wrapped(chunk[:, :-1], targets=chunk[:, 1:])
                if last:
                    self._callbacks("after_forward", self.step)
                loss = loss / self.accum
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def _load_batch(self, step: int) -> tuple[torch.Tensor, list[int], tuple[str, str] | None]:
        """This rank's windows of global batch `step` on the device, and the shards of the next two blocks
        fetched in the background. A data failure is returned, with zeros that keep the collectives in step."""
        try:
            indices = self.sampler.rank_slice(step, self.env.rank, self.env.world_size)
            horizon = 2 * max(1, self.sampler.block_shards)
            self.ds.fetch_ahead(self.sampler.upcoming_shards(step, horizon, end_step=self.cfg.train.steps))
            windows, fault = torch.from_numpy(self.ds.batch(indices)), None
        except DataError as exc:
            kind = "failed" if _transient(exc) else "bad"
            fault = (kind, one_line(f"rank {self.env.rank}, step {step + 1}: data.uri: {exc}"))
            windows = torch.zeros((self.global_batch // self.env.world_size, self.cfg.model.context + 1),
                                  dtype=torch.int64)
            indices = []
        return windows.to(self.env.device, non_blocking=True), indices, fault

    def _callbacks(self, point: str, step: int) -> None:
        for callback in self.step_callbacks:
            callback(self, point, step)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is not None and self.cfg.train.parallel == "ddp":
            return torch.autocast(self.env.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def evaluate(self) -> float:
        """Validation loss at self.step on every rank (the same value everywhere), recorded and logged."""
        cfg, env = self.cfg, self.env
        micro = cfg.eval.micro_batch_size or cfg.train.micro_batch_size
        t0 = time.perf_counter()
        with self.watchdog.allowance("eval", cfg.watchdog.eval_s):
            # The raw model: under DDP every rank holds all weights, so evaluating needs no collective per
            # forward (DDP would broadcast buffers) and a compiled wrapper is not recompiled for eval mode;
            # under FSDP2 `model` is the sharded module itself and gathers its parameters in each forward.
            part = evaluation.evaluate(self.model, self.val, batches=cfg.eval.batches, micro_batch_size=micro, rank=env.rank,
                            world=env.world_size, device=env.device, autocast=self._autocast)
            val_loss = reduce_eval(part, device=env.device)
        self.evals.record(self.step, val_loss)
        ev = self.evals
        self.metrics.log(self.step, {
            "event": "eval", "val_loss": val_loss, "best_val_loss": ev.best, "best_val_step": ev.best_step,
            "evals_without_improvement": ev.bad, "eval_s": time.perf_counter() - t0,
            "windows": cfg.eval.batches * micro})
        return val_loss

    def save_checkpoint(self, *, block: bool) -> float:
        """Checkpoint self.step (in the background unless `block`); returns the seconds training was blocked."""
        with self.watchdog.allowance("checkpoint", self.cfg.watchdog.checkpoint_s):
            return self.checkpointer.save(self.step, self.model, self.optimizer, self.state_dict(),
                                          to_dict(self.cfg), block=block)

    def _log_step(self, timings: dict[str, Any], eval_s: float, ckpt_s: float) -> None:
        self._report_saves()
        last_saved = self.checkpointer.last_success_unix
        self.metrics.log(self.step, {
            "loss": self.loss_value, "lr": self.scheduler.get_last_lr()[0], "tokens": self.tokens_seen,
            # A step runs from its data to the end of its checkpoint save, without an evaluation.
            "step_s": time.perf_counter() - timings.pop("start") - eval_s, **timings, "checkpoint_block_s": ckpt_s,
            "checkpoint_age_s": time.time() - last_saved if last_saved else None})

    def _report_saves(self) -> None:
        """Publish checkpoints that finished (in the background) since the last call."""
        for rec in self.checkpointer.saved[self._reported_saves:]:
            self.metrics.log_checkpoint(rec.step, rec.remote_uri or str(rec.path), rec.duration_s or 0.0,
                                        rec.finished_unix or time.time())
        self._reported_saves = len(self.checkpointer.saved)

    def _diverged(self, step: int, what: str) -> str:
        last = self.checkpointer.saved[-1].step if self.checkpointer.saved else None
        where = f"the newest checkpoint is step {last}" if last is not None else "no checkpoint was saved by this launch"
        return (f"non-finite {what} at step {step}: training diverged, the step was not applied and nothing was "
                f"saved ({where}); lower train.lr (now {self.cfg.train.lr}) or set train.grad_clip (now "
                f"{self.cfg.train.grad_clip})")

    # ---------------------------------------------------------------------------------------------- the end
    def finish(self, status: str) -> dict[str, Any]:
        """Wait for the last save, then the summary and (rank 0) the outputs; returns the summary."""
        t, env, ckpt = self.cfg.train, self.env, self.checkpointer
        with self.watchdog.allowance("finish", self.cfg.watchdog.checkpoint_s, "watchdog.checkpoint_s, the end of the run"):
            ckpt.wait()
            if status != "preempted" and ckpt.failed and ckpt.failed[-1].step == self.step and (
                    not ckpt.saved or ckpt.saved[-1].step < self.step):
                raise TrainingFailed(f"the final checkpoint (step {self.step}) was not saved: {ckpt.failed[-1].error}")
            trained = self.step - self.start_step
            tokens_per_s = trained * t.global_batch_tokens / self.elapsed if trained > 0 else 0.0
            full = full_state_dict(self.model)  # collective (FSDP gathers shards): rank 0 gets the full state
            summary = {
                "step": self.step, "tokens": self.tokens_seen,
                "final_loss": self.loss_value if math.isfinite(self.loss_value) else None,
                "val_loss": self.evals.last, "best_val_loss": self.evals.best, "best_val_step": self.evals.best_step,
                "params_sha256": state_sha256(full) if env.rank == 0 else None, "restarts": env.restart_count,
                "tokens_per_s": tokens_per_s, "mfu": self.metrics.mfu(tokens_per_s), "status": status,
                # Rank 0's peak GPU memory (allocated by tensors), for sizing; None on CPU.
                "peak_memory_gb": torch.cuda.max_memory_allocated(env.device) / 1e9 if env.is_cuda else None,
            }
            if env.rank == 0:
                write_outputs(RunOutputs(
                    cfg=self.cfg, run_dir=self.run_dir, tokenizer=self.tokenizer, tracker=self.tracker,
                    checkpointer=ckpt, evals=self.evals, first=self.first, manifest_sha256=self.ds.manifest_sha256,
                    device=env.device), full, summary)
        return summary


def _setup_logging(env: DistEnv) -> None:
    # INFO from one worker per node (what this node resumed from, what it downloaded), warnings from all.
    logging.basicConfig(level=logging.INFO if env.local_rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{env.rank}] %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _raise_agreed_fault(fault: tuple[str, str] | None, world_size: int) -> NoReturn:
    """Some rank hit bad data (BadInput) or a storage failure (TrainingFailed): every rank raises the same."""
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, fault)
    bad = [f[1] for f in every if f and f[0] == "bad"]
    if bad:
        raise BadInput(bad[0])
    raise TrainingFailed(next(f[1] for f in every if f))


def _transient(exc: BaseException) -> bool:
    """A storage outage rather than bad data: the data layer wraps the storage error that outlasted its
    retries (trainer/data/storage.py StorageError.transient) in a shard error; look down the cause chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "transient", False):
            return True
        seen = seen.__cause__
    return False
