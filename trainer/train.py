"""The bundled GPT trainer: a Trainer that builds everything once, then trains step by step (torchtitan's shape),
on the library's public parts only (trainer/__init__.py: CheckpointManager, open_dataset + GlobalSampler,
Tracker, Watchdog, Preemption), as a team's own loop would use them.

Usage (normally through `python -m trainer`, see trainer/__main__.py):
    summary = train(build_config("tiny", overrides=["train.steps=20"]), run_dir=Path("runs/dev"))
    summary["status"]      # "completed", "stopped_early" or "preempted"; bad input raises BadInput, a
                           # retryable failure TrainingFailed (trainer/errors.py)
or, inside a process group, what `train` does:
    with Trainer(cfg, run_dir, env, step_callbacks=[...]) as trainer:
        summary = trainer.finish(trainer.train())

`__init__` checks the inputs on every rank and agrees on the verdict, builds the model (trainer.parallelize) and
the library parts, and resumes from the newest checkpoint every rank can load (trainer/resume.py). `train()`
repeats `train_step()` (data, `forward_backward_step()`, the step's all-reduce, the optimizer), evaluation,
checkpoint and metrics until train.steps, SIGTERM, SIGINT or early stopping; `finish()` writes the outputs. The
step's one all-reduce carries the loss and whether any rank got SIGTERM or SIGINT (and which), bad data or a
storage failure; whether the step is applied is decided on the device, and the host reads the flags one step later
(trainer/step_flags.py; `settle()` reads them at once before an evaluation or a checkpoint), so every rank takes
the same decision at the same point: stop after a synchronous checkpoint ("preempted", exit 75, or 130 for Ctrl-C
in one process), BadInput (bad data, or a non-finite loss or gradient norm: the step was skipped and nothing is
saved, since a restart would replay the same step) or TrainingFailed (a storage outage). docs/trainer.md.

Over 400 lines because the step, the late reading of its flags and the loop that orders evaluations and
checkpoints after that reading are one protocol, easier to check in one place.

Step callbacks, `callback(trainer, point, step)` for the 0-based step being trained (none in production; tests
inject a killed, hung or slow rank through them, bench/faults.py): "after_forward" (the last micro batch's
loss computed, its backward not yet run; under pipeline parallelism, whose schedule interleaves them, once the
step's schedule has run) and "before_sync" (every backward done, the step's all-reduce not yet
joined: the watchdog is in its "collective" phase and the other ranks wait in the all-reduce).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_train.jobs.launch import SHUTDOWN_ENV, nccl_env
from gpu_train.spec.trainer_config import Config, batch_layout, to_dict
from trainer import (
    BadInput,
    CheckpointManager,
    DataError,
    DistEnv,
    GlobalSampler,
    Preemption,
    agree,
    checkpoint_timeout_s,
    collective_timeout_s,
    energy,
    init_distributed,
    is_transient,
    nccl_heartbeat_s,
    outputs,
    raise_agreed,
    read_step,
    record_stop,
    run,
    seed_everything,
    setup_logging,
    shutdown,
)
from trainer import evaluate as evaluation
from trainer.budget import hold_for
from trainer.errors import one_line
from trainer.evaluate import EvalState, reduce_eval
from trainer.export import TOKENIZER
from trainer.metrics import StepClock, batch_hash
from trainer.parallelize import build_model, build_optimizer, build_scheduler, resolve_dtype
from trainer.preflight import check_inputs, checkpoint_dir_of, open_checked_dataset
from trainer.resume import loop_state, resume
from trainer.step_flags import PendingValues, StepFlags

log = logging.getLogger("trainer")


@dataclass
class PendingStep:
    """A step whose flags are on their way to the host, with what its record needs once they are read."""

    step: int  # 1-based
    values: PendingValues
    fault: tuple[str, str] | None  # this rank's data failure in that step
    clock: StepClock  # a copy taken after the step's all-reduce
    optimizer_s: float
    record: dict[str, Any] | None = None  # the step record, without the loss, until it is written
    split: dict[str, float] = field(default_factory=dict)

StepCallback = Callable[["Trainer", str, int], None]


def train(cfg: Config, run_dir: Path, *, step_callbacks: Iterable[StepCallback] = (),
          energy_counter: energy.Counter | None = None) -> dict[str, Any]:
    """Join the process group, train, write the outputs; returns the summary (also in RUN_DIR/summary.json)."""
    wd = cfg.watchdog
    nccl = {**nccl_env(), "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(nccl_heartbeat_s(wd))}
    env = init_distributed(timeout_s=collective_timeout_s(wd), nccl_env=nccl)
    try:
        with Trainer(cfg, Path(run_dir), env, step_callbacks=step_callbacks, energy_counter=energy_counter) as trainer:
            return trainer.finish(trainer.train())
    finally:
        shutdown()


class Trainer(contextlib.AbstractContextManager["Trainer"]):
    """One training run on this rank; see the module docstring. Every method is called on every rank."""

    def __init__(self, cfg: Config, run_dir: Path, env: DistEnv, *,
                 step_callbacks: Iterable[StepCallback] = (), energy_counter: energy.Counter | None = None) -> None:
        self.cfg, self.run_dir, self.env = cfg, Path(run_dir), env
        self.energy_counter = energy_counter  # this rank's GPU energy counter; None: NVML's (trainer/energy.py)
        self.step_callbacks: list[StepCallback] = list(step_callbacks)
        self.status = "failed"  # what the MLflow run is closed with unless train()/finish() say otherwise
        self.step, self.tokens_seen, self.loss_value, self.evals = 0, 0, math.nan, EvalState()  # resumed below
        self.first: tuple[int, float] | None = None  # (step, loss) of this launch's first step
        self.start_step, self.elapsed, self._reported_saves = 0, 0.0, 0
        # The newest step whose flags the host has not read yet, and the last one it read (trainer/step_flags.py).
        self.pending: PendingStep | None = None
        self._settled: PendingStep | None = None
        self.flags = StepFlags(env.device, env.world_size)
        self.run_key: str | None = None  # names this job's MLflow run in every checkpoint (trainer/run.py)
        self.exits = contextlib.ExitStack()  # everything opened so far, closed in reverse by close()
        try:
            setup_logging(env)
            # `kill -USR1 <pid>` prints every thread's stack: the first thing to look at in a hung collective.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            budget = os.environ.get(SHUTDOWN_ENV, "")
            # SIGTERM (torchrun, the kubelet) and SIGINT (Ctrl-C) both stop after a final checkpoint; a second
            # SIGINT stops at once.
            self.preemption = self.exits.enter_context(Preemption(
                sigint=True, second_sigint_exits=True,
                shutdown_timeout_s=float(budget) if budget.isdigit() else None))
            self.stop_signal: str | None = None  # "SIGTERM" or "SIGINT" once a stop was agreed on
            self._open_inputs()
            self.global_batch, self.accum = batch_layout(cfg, env.world_size)
            seed_everything(cfg.train.seed, cfg.train.deterministic)
            self.dtype = resolve_dtype(cfg, env)
            self.build_model()
            self.checkpointer = CheckpointManager(
                checkpoint_dir_of(cfg, self.run_dir), cfg.checkpoint.remote_uri, keep=cfg.checkpoint.keep, env=env,
                async_save=cfg.checkpoint.async_save, endpoint_url=cfg.checkpoint.endpoint_url or None,
                timeout_s=checkpoint_timeout_s(cfg.watchdog))
            self.exits.callback(self.checkpointer.close)
            run_id, resumed_from = resume(self)
            run.open_outputs(self, run_id, resumed_from)
            self.budget = hold_for(self) if cfg.train.budget_uri else None  # a sweep trial's rungs
        except BaseException:
            self.exits.close()
            raise

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self.status = "failed"
        self.close()

    def close(self) -> None:
        """Stop the watchdog, close the tracker (FINISHED, KILLED or FAILED), metrics, checkpoints and data."""
        self.exits.close()

    # ---------------------------------------------------------------------------------------------- building
    def _open_inputs(self) -> None:
        """Check the inputs on every rank and agree on the verdict before anything is written."""
        cfg, env = self.cfg, self.env
        self.val = self.tokenizer = problem = None
        try:
            self.ds = check_inputs(cfg, self.run_dir, world_sizes=[env.world_size],
                                   local_world_size=env.local_world_size)
            self.exits.callback(self.ds.close)
            if cfg.eval.every_steps:
                self.val = open_checked_dataset(cfg, split="val")
                self.exits.callback(self.val.close)
            if env.rank == 0:  # saved in every checkpoint, so that sampling and export never need the dataset
                self.tokenizer = outputs.dataset_tokenizer(cfg)
        except BadInput as exc:
            problem = str(exc)
        problem = agree(problem, env.world_size)
        if problem:
            raise BadInput(problem)

    def build_model(self) -> None:
        """Fresh weights from train.seed, optimizer, schedule and sampler (again after a failed partial load)."""
        # The runner (trainer/runner.py, trainer/pipeline.py) runs a step under the layout: DDP, FSDP2, tensor and
        # pipeline parallelism.
        self.model, self.runner = build_model(self.cfg, self.env, self.dtype)
        self.optimizer = build_optimizer(self.model, self.cfg, self.env.device)
        self.scheduler = build_scheduler(self.optimizer, self.cfg)
        self.sampler = self.new_sampler()

    def new_sampler(self) -> GlobalSampler:
        return GlobalSampler(self.ds.num_windows, global_batch=self.global_batch, seed=self.cfg.train.seed,
                             shard_windows=self.ds.shard_windows, block_shards=self.cfg.data.block_shards)

    def on_embedding(self, _module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda _grad: self.clock.grads_ready())

    # ---------------------------------------------------------------------------------------------- the loop
    def train(self) -> str:
        """Train from self.step to train.steps, or until SIGTERM, SIGINT or early stopping; returns the status."""
        t, patience = self.cfg.train, self.cfg.eval.early_stopping_patience
        self.start_step, t0 = self.step, time.perf_counter()
        self.energy = energy.EnergyMeter.start(self.env, self.energy_counter)  # read again in finish()
        self.watchdog.start()
        status = self._nothing_to_train()
        if status is None:
            status = "completed"
            self.runner.train()
        while status == "completed" and self.step < t.steps:
            if self.budget is not None and self.budget.reached() and self.budget.hold():
                status = "preempted"  # stopped while held at its budget, the checkpoint of this step saved
                break
            timings, stop = self.train_step()
            every, evals = self.cfg.checkpoint.every_steps, self.cfg.eval.every_steps
            evaluate = bool(evals) and (self.step % evals == 0 or self.step == t.steps)
            save = stop or self.step == t.steps or bool(every and self.step % every == 0)
            if evaluate or save:  # this step's flags first: a diverged step is never evaluated nor saved
                self.settle()
                stop = self.stop_signal is not None
            t_eval = time.perf_counter()
            if evaluate:
                self.evaluate()
            eval_s = time.perf_counter() - t_eval
            early = self.evals.exhausted(patience) and self.step < t.steps
            final = stop or early or self.step == t.steps
            ckpt_s = self.save_checkpoint(block=final) if final or save else 0.0
            self._log_step(timings, eval_s, ckpt_s)
            if stop:
                status, saved = "preempted", self.checkpointer.saved
                done = bool(saved) and saved[-1].step == self.step
                self.preemption.report(self.step, saved=done, elsewhere=self.stop_signal or "SIGTERM")
                if self.env.local_rank == 0:
                    record_stop(self.step, saved=done, signal=self.stop_signal or "SIGTERM")
            elif early:
                status = "stopped_early"
                if self.env.rank == 0:
                    log.warning("early stopping at step %d: %s", self.step, self.evals.why_stopped(patience))
        self.settle()
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
            log.info("the run stopped early at step %d (%s): nothing to train", self.step,
                     self.evals.why_stopped(patience))
            return "stopped_early"
        if self.step >= self.cfg.train.steps:
            log.info("the checkpoint is already at train.steps=%d: nothing to train", self.cfg.train.steps)
        # SIGTERM or SIGINT while starting (loading, resuming): stop before training, nothing new to save.
        flags = torch.tensor(self._stop_flags(), device=self.env.device)
        dist.all_reduce(flags)
        if flags[0].item() > 0 and self.step < self.cfg.train.steps:
            self.stop_signal = "SIGINT" if flags[1].item() > 0 else "SIGTERM"
            log.warning("%s before the first step: stopping at step %d without a new checkpoint", self.stop_signal,
                        self.step)
            if self.env.local_rank == 0:
                record_stop(self.step, saved=None, signal=self.stop_signal)
            return "preempted"
        return None

    def _stop_flags(self) -> list[float]:
        """(whether this rank got a stop signal, whether that was SIGINT) for the step's all-reduce."""
        return [float(self.preemption.preempted()), float(self.preemption.signal_name == "SIGINT")]

    def train_step(self) -> tuple[dict[str, Any], bool]:
        """One optimizer step on global batch self.step, with no host read of a device tensor; returns (its
        timings, whether the ranks agreed to stop: a stop signal any rank had by the previous step, whose flags the
        host reads during this one; self.stop_signal says which)."""
        env, wd, step = self.env, self.watchdog, self.step
        wd.begin_step(step + 1)
        t0 = time.perf_counter()
        windows, indices, fault = self._load_batch(step)
        t_data = time.perf_counter()
        wd.phase("forward_backward")
        self.clock.start()
        loss_sum = self.forward_backward_step(windows)
        t_fb = time.perf_counter()
        wd.phase("collective")
        # The previous step's flags, copied to the host while this step's work was queued (trainer/step_flags.py):
        # a diverged or bad previous step, skipped on the device, raises here; a stop signal ends after this step.
        self.settle()
        for callback in self.step_callbacks:
            callback(self, "before_sync", step)
        # One all-reduce: the loss, whether any rank got SIGTERM or SIGINT (and which), bad data or a storage failure.
        stop, sigint = self._stop_flags()
        reduced = self.flags.reduce(loss_sum, stop=stop > 0, sigint=sigint > 0,
                                    bad=fault is not None and fault[0] == "bad",
                                    failed=fault is not None and fault[0] == "failed")
        self.clock.synced()
        t_sync = time.perf_counter()
        wd.phase("optimizer")
        norm = self.runner.clip_grad_norm_(self.cfg.train.grad_clip) if self.cfg.train.grad_clip > 0 else None
        # 1.0 leaves this step out on the device: parameters, moments and step counters unchanged.
        self.optimizer.found_inf = self.flags.skip(reduced, norm)
        lr = self.optimizer.param_groups[0]["lr"]  # this step's learning rate (the scheduler moves on below)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        t_opt = time.perf_counter()
        self.pending = PendingStep(step + 1, self.flags.send(reduced, norm), fault, copy.copy(self.clock),
                                   t_opt - t_sync)
        wd.end_step(t_opt - t0)
        self.step = step + 1
        self.tokens_seen += self.cfg.train.global_batch_tokens
        timings = {"start": t0, "lr": lr, "data_wait_s": t_data - t0, "forward_backward_s": t_fb - t_data,
                   "optimizer_s": t_opt - t_sync}
        if self.cfg.metrics.batch_hash:
            gathered: list[list[int] | None] = [None] * env.world_size
            dist.all_gather_object(gathered, indices)
            timings["batch_sha256"] = batch_hash([i for r in self.runner.data_ranks for i in gathered[r]])
        return timings, self.stop_signal is not None

    def settle(self) -> None:
        """Read the newest step's flags now if the host has not yet (waiting for their copy only): a step is never
        evaluated, checkpointed or logged before the host has seen that it was applied. Collective when a rank
        had bad data or a storage failure in that step (every rank raises the same)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        values = pending.values.values()
        if values.bad or values.failed:
            raise_agreed(pending.fault, self.env.world_size)
        what = values.diverged()
        if what is not None:
            raise BadInput(self._diverged(pending.step, what))
        self.loss_value = values.loss
        self.first = self.first or (pending.step, values.loss)
        if values.stop:
            self.stop_signal = "SIGINT" if values.sigint else "SIGTERM"
        compute, wait = pending.clock.split()
        pending.split = {"compute_s": compute + pending.optimizer_s, "collective_wait_s": wait}
        self._settled = pending
        if pending.record is not None:
            self._write_step(pending)

    def forward_backward_step(self, windows: torch.Tensor) -> torch.Tensor:
        """Forward and backward over this rank's micro batches, gradients synced on the last one, through the
        layout's runner; returns this rank's share of the step's loss (summed over the ranks and divided by the
        world size in the step's all-reduce)."""
        return self.runner.forward_backward(windows, self.accum, lambda: [
            callback(self, "after_forward", self.step) for callback in self.step_callbacks])

    def _load_batch(self, step: int) -> tuple[torch.Tensor, list[int], tuple[str, str] | None]:
        """This rank's windows of global batch `step` on the device, and the shards of the next two blocks
        fetched in the background. A data failure is returned, with zeros that keep the collectives in step."""
        try:
            rows, indices = read_step(self.ds, self.sampler, step, self.runner.data_rank, self.runner.data_world,
                                      end_step=self.cfg.train.steps)
            windows, fault = torch.from_numpy(rows), None
        except DataError as exc:
            kind = "failed" if is_transient(exc) else "bad"
            fault = (kind, one_line(f"rank {self.env.rank}, step {step + 1}: data.uri: {exc}"))
            windows = torch.zeros((self.global_batch // self.runner.data_world, self.cfg.model.context + 1),
                                  dtype=torch.int64)
            indices = []
        return windows.to(self.env.device, non_blocking=True), indices, fault

    def evaluate(self) -> float:
        """Validation loss at self.step on every rank (the same value everywhere), recorded and logged."""
        self.settle()
        cfg, env = self.cfg, self.env
        micro = cfg.eval.micro_batch_size or cfg.train.micro_batch_size
        t0 = time.perf_counter()
        with self.watchdog.allowance("eval", cfg.watchdog.eval_s):
            # The raw model: under DDP every rank holds all weights, so evaluating needs no collective per
            # forward (DDP would broadcast buffers) and a compiled wrapper is not recompiled for eval mode;
            # under FSDP2 `model` is the sharded module itself and gathers its parameters in each forward.
            part = evaluation.evaluate(self.model, self.val, batches=cfg.eval.batches, micro_batch_size=micro,
                                       rank=self.runner.data_rank, world=self.runner.data_world, device=env.device,
                                       window_losses=self.runner.window_losses)
            val_loss = reduce_eval(part, device=env.device)
        self.metrics.log(self.step, {**self.evals.record(self.step, val_loss), "eval_s": time.perf_counter() - t0,
                                     "windows": cfg.eval.batches * micro})
        if self.budget is not None:
            self.budget.note_eval(val_loss)
        return val_loss

    def save_checkpoint(self, *, block: bool) -> float:
        """Checkpoint self.step (in the background unless `block`); returns the seconds training was blocked. Never
        before the host has read that step's flags (settle): a skipped, diverged step is not saved."""
        self.settle()
        with self.watchdog.allowance("checkpoint", self.cfg.watchdog.checkpoint_s):
            tok = self.tokenizer  # rank 0's; the checkpoint manager keeps rank 0's meta and files
            return self.checkpointer.save(
                self.step, self.model, self.optimizer, loop_state(self), to_dict(self.cfg), block=block,
                meta={"tokenizer": tok.describe()} if tok is not None else None,
                files={TOKENIZER: tok.json.encode()} if tok is not None and tok.json is not None else None)

    def _log_step(self, timings: dict[str, Any], eval_s: float, ckpt_s: float) -> None:
        """The step record of self.step, written now if its flags were read, else once they are (its loss)."""
        self._report_saves()
        last_saved = self.checkpointer.last_success_unix
        record = {
            "lr": timings.pop("lr"), "tokens": self.tokens_seen,
            # A step runs from its data to the end of its checkpoint save, without an evaluation.
            "step_s": time.perf_counter() - timings.pop("start") - eval_s, **timings, "checkpoint_block_s": ckpt_s,
            "checkpoint_age_s": time.time() - last_saved if last_saved else None, "time": time.time()}
        done = self.pending if self.pending is not None else self._settled
        if done is None or done.step != self.step:
            return
        done.record = record
        if done is self._settled:
            self._write_step(done)

    def _write_step(self, done: PendingStep) -> None:
        self.metrics.log(done.step, {"loss": self.loss_value, **(done.record or {}), **done.split})
        done.record = None

    def _report_saves(self) -> None:
        """Publish checkpoints that finished (in the background) since the last call."""
        for rec in self.checkpointer.saved[self._reported_saves:]:
            self.metrics.log_checkpoint(rec.step, rec.remote_uri or str(rec.path), rec.duration_s or 0.0,
                                        rec.finished_unix or time.time())
        self._reported_saves = len(self.checkpointer.saved)

    def _diverged(self, step: int, what: str) -> str:
        saved, t = self.checkpointer.saved, self.cfg.train
        where = f"the newest checkpoint is step {saved[-1].step}" if saved else "no checkpoint was saved by this launch"
        return (f"non-finite {what} at step {step}: training diverged, the step was not applied and nothing was saved "
                f"({where}); lower train.lr (now {t.lr}) or set train.grad_clip (now {t.grad_clip})")

    # ---------------------------------------------------------------------------------------------- the end
    def finish(self, status: str) -> dict[str, Any]:
        """Wait for the last save, then the summary and (rank 0) the outputs; returns the summary."""
        return run.finish(self, status)
