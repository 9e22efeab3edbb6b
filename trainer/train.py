"""The bundled GPT trainer: a Trainer that builds everything once, then trains step by step (torchtitan's shape),
on the library's public parts only (the names trainer/__init__.py lists, imported from the modules that define
them: CheckpointManager, open_dataset + GlobalSampler, Tracker, Watchdog, Preemption), as a team's own loop would
use them.

Usage (normally through `python -m trainer`, see trainer/__main__.py):
    summary = train(build_config("tiny", overrides=["train.steps=20"]), run_dir=Path("runs/dev"))
    summary["status"]      # "completed", "stopped_early" or "preempted"; bad input raises BadInput, a
                           # retryable failure TrainingFailed (trainer/errors.py)
or, inside a process group, what `train` does:
    with Trainer(cfg, run_dir, env, step_callbacks=[...]) as trainer:
        summary = trainer.finish(trainer.train())

`__init__` checks the inputs on every rank and agrees on the verdict, builds the model (trainer.parallelize) and
the library parts, resumes from the newest checkpoint every rank can load (trainer/resume.py) and opens the run's
outputs (trainer/run.py); both return what they made, and the Trainer keeps it: no other module sets its
attributes. `train()` repeats `advance()`: `train_step()` (data, `forward_backward_step()`, the step's all-reduce,
the optimizer), then evaluation, checkpoint and metrics, until train.steps, SIGTERM, SIGINT or early stopping
(bench/interleaved.py times `advance()` beside the bare loop); `finish()`
writes the outputs. The step's one all-reduce carries the loss and whether any rank got SIGTERM or SIGINT (and
which), bad data or a storage failure; whether the step is applied is decided on the device, and the host reads
the flags one step later (trainer/step_flags.py; `settle()` reads them at once before an evaluation or a
checkpoint), so every rank takes the same decision at the same point: stop after a synchronous checkpoint
("preempted", exit 75, or 130 for Ctrl-C in one process), BadInput (bad data, or a non-finite loss or gradient
norm: the step was skipped and nothing is saved, since a restart would replay the same step) or TrainingFailed (a
storage outage). docs/trainer.md.

Over 400 lines because the step, the late reading of its flags and the loop that orders evaluations and
checkpoints after that reading are one protocol, easier to check in one place; and because the Trainer declares,
builds and ends all of its own state here (the stop report included), rather than other modules setting it.

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
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_train.jobs.launch import nccl_env
from gpu_train.sizing.layout import batch_layout
from gpu_train.spec import env as job_env
from gpu_train.spec.trainer_config import Config, to_dict
from trainer import evaluate as evaluation
from trainer.budget import BudgetHold, hold_for
from trainer.checkpoint.manager import CheckpointManager
from trainer.data import read_step
from trainer.data.dataset import Dataset
from trainer.data.errors import DataError, is_transient
from trainer.data.sampler import GlobalSampler
from trainer.distributed import (
    DistEnv,
    agree,
    init_distributed,
    raise_agreed,
    seed_everything,
    setup_logging,
    shutdown,
)
from trainer.energy import Counter, EnergyMeter
from trainer.errors import BadInput, TrainingFailed, one_line, record_stop
from trainer.evaluate import reduce_eval
from trainer.export import TOKENIZER
from trainer.metrics import StepClock, batch_hash
from trainer.outputs import RunOutputs, dataset_tokenizer, run_summary, state_sha256, write_outputs
from trainer.parallelize import build_model, build_optimizer, build_scheduler, resolve_dtype, sized_config
from trainer.preemption import Preemption
from trainer.preflight import check_inputs, checkpoint_dir_of, open_checked_dataset
from trainer.resume import LoopState, resume
from trainer.run import open_outputs
from trainer.step_flags import PendingValues, StepFlags
from trainer.watchdog import checkpoint_timeout_s, collective_timeout_s, nccl_heartbeat_s

log = logging.getLogger("trainer")


@dataclass
class PendingStep:
    """A step whose flags are on their way to the host, with what its record needs once they are read."""

    step: int  # 1-based
    values: PendingValues
    fault: tuple[str, str] | None  # this rank's data failure in that step
    clock: StepClock  # a copy taken after the step's all-reduce
    optimizer_s: float
    lr: float  # the step's learning rate
    record: dict[str, Any] | None = None  # the step record, without the loss, until it is written
    split: dict[str, float] = field(default_factory=dict)

StepCallback = Callable[["Trainer", str, int], None]


def train(cfg: Config, run_dir: Path, *, step_callbacks: Iterable[StepCallback] = (),
          energy_counter: Counter | None = None) -> dict[str, Any]:
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
                 step_callbacks: Iterable[StepCallback] = (), energy_counter: Counter | None = None) -> None:
        self.cfg, self.run_dir, self.env = cfg, Path(run_dir), env
        self.energy_counter = energy_counter  # this rank's GPU energy counter; None: NVML's (trainer/energy.py)
        self.step_callbacks: list[StepCallback] = list(step_callbacks)
        self.status = "failed"  # what the MLflow run is closed with unless train()/finish() say otherwise
        self.first: tuple[int, float] | None = None  # (step, loss) of this launch's first step
        self.start_step, self.elapsed, self._reported_saves = 0, 0.0, 0
        self.energy: EnergyMeter | None = None  # the GPUs' energy counters, from train() to finish()
        # The newest step whose flags the host has not read yet, and the last one it read (trainer/step_flags.py).
        self.pending: PendingStep | None = None
        self._settled: PendingStep | None = None
        self.flags = StepFlags(env.device, env.world_size)
        self.exits = contextlib.ExitStack()  # everything opened so far, closed in reverse by close()
        try:
            setup_logging(env)
            # `kill -USR1 <pid>` prints every thread's stack: the first thing to look at in a hung collective.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            self.cfg = cfg = sized_config(cfg, env)  # train.micro_batch_size=auto made a number
            budget = os.environ.get(job_env.SHUTDOWN, "")
            # SIGTERM (torchrun, the kubelet) and SIGINT (Ctrl-C) both stop after a final checkpoint; a second
            # SIGINT stops at once.
            self.preemption = self.exits.enter_context(Preemption(
                sigint=True, second_sigint_exits=True,
                shutdown_timeout_s=float(budget) if budget.isdigit() else None))
            self.stop_signal: str | None = None  # "SIGTERM" or "SIGINT" once a stop was agreed on
            self.ds, self.val, self.tokenizer = self._open_inputs()
            self.global_batch, self.accum = batch_layout(cfg, env.world_size)
            seed_everything(cfg.train.seed, cfg.train.deterministic)
            self.dtype = resolve_dtype(cfg, env)
            self.build_model()
            self.checkpointer = CheckpointManager(
                checkpoint_dir_of(cfg, self.run_dir), cfg.checkpoint.remote_uri, keep=cfg.checkpoint.keep, env=env,
                async_save=cfg.checkpoint.async_save, endpoint_url=cfg.checkpoint.endpoint_url or None,
                timeout_s=checkpoint_timeout_s(cfg.watchdog))
            self.exits.callback(self.checkpointer.close)
            loop = resume(cfg, self.checkpointer, self.model, self.optimizer, self.scheduler,
                          new_sampler=self.new_sampler, manifest_sha256=self.ds.manifest_sha256, rank=env.rank)
            if loop.resumed_from is None and self.checkpointer.model_touched:
                self.build_model()  # a load that failed part-way may have changed parameters
            self.step, self.tokens_seen, self.loss_value, self.evals = (loop.step, loop.tokens_seen,
                                                                        loop.loss_value, loop.evals)
            if loop.sampler is not None:
                self.sampler = loop.sampler
            # Names this job's MLflow run in every checkpoint, even before MLflow answers (trainer/run.py).
            self.run_key = loop.run_key or uuid.uuid4().hex
            sinks = open_outputs(
                cfg, env, self.run_dir, self.exits, status=lambda: self.status, run_id=loop.run_id,
                run_key=self.run_key, carried=loop.mlflow_unsent, resumed_from=loop.resumed_from, step=self.step,
                val_loss=self.evals.last, manifest_sha256=self.ds.manifest_sha256, global_batch=self.global_batch,
                accum=self.accum, layout=self.runner.layout, dtype=self.dtype)
            self.tracker, self.metrics, self.watchdog, self.clock = (sinks.tracker, sinks.metrics, sinks.watchdog,
                                                                     sinks.clock)
            # A gradient hook on the token embedding's output marks the end of this rank's own backward work
            # (trainer/metrics.py); hooks inside a compiled region break torch.compile's graph, so not there.
            if not cfg.train.compile and self.model.tok_emb is not None:  # a middle pipeline stage has none
                self.exits.callback(self.model.tok_emb.register_forward_hook(self.on_embedding).remove)
            # A sweep trial's rungs (collective: reads the budget once).
            self.budget: BudgetHold | None = hold_for(cfg, env, self) if cfg.train.budget_uri else None
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
    def _open_inputs(self) -> tuple[Dataset, Dataset | None, Any]:
        """(the dataset, the validation split when evaluating, rank 0's tokenizer): checked on every rank, the
        verdict agreed on before anything is written."""
        cfg, env = self.cfg, self.env
        ds = val = tokenizer = problem = None
        try:
            ds = check_inputs(cfg, self.run_dir, world_sizes=[env.world_size], local_world_size=env.local_world_size)
            self.exits.callback(ds.close)
            if cfg.eval.every_steps:
                val = open_checked_dataset(cfg, split="val")
                self.exits.callback(val.close)
            if env.rank == 0:  # saved in every checkpoint, so that sampling and export never need the dataset
                tokenizer = dataset_tokenizer(cfg)
        except BadInput as exc:
            problem = str(exc)
        problem = agree(problem, env.world_size)
        if problem:
            raise BadInput(problem)
        return ds, val, tokenizer

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
        t = self.cfg.train
        self.start_step, t0 = self.step, time.perf_counter()
        self.energy = EnergyMeter.start(self.env, self.energy_counter)  # read again in finish()
        self.watchdog.start()
        status = self._nothing_to_train()
        if status is None:
            status = "completed"
            self.runner.train()
        while status == "completed" and self.step < t.steps:
            status = self.advance()
        self.settle()
        self.watchdog.disarm()
        self.checkpointer.wait()
        self._report_saves()
        self.elapsed = time.perf_counter() - t0
        self.status = status
        return status

    def advance(self) -> str:
        """One iteration of train()'s loop: the step, then its evaluation and checkpoint when due; returns the status
        after it ("completed" while training goes on). A budget hold before the step may end the run instead."""
        t, patience = self.cfg.train, self.cfg.eval.early_stopping_patience
        held_stop = self.budget.hold() if self.budget is not None and self.budget.reached() else None
        if held_stop is not None:  # stopped while held at its budget, the checkpoint of this step saved
            self._record_stop(held_stop, saved=self.saved_here())
            return "preempted"
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
            self._record_stop(self.stop_signal or "SIGTERM", saved=self.saved_here())
            return "preempted"
        if early:
            if self.env.rank == 0:
                log.warning("early stopping at step %d: %s", self.step, self.evals.why_stopped(patience))
            return "stopped_early"
        return "completed"

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
        flags = torch.tensor(self.stop_flags(), device=self.env.device)
        dist.all_reduce(flags)
        if flags[0].item() > 0 and self.step < self.cfg.train.steps:
            self._record_stop("SIGINT" if flags[1].item() > 0 else "SIGTERM", saved=None)
            return "preempted"
        return None

    def stop_flags(self) -> list[float]:
        """(whether this rank got a stop signal, whether that was SIGINT) for the step's all-reduce."""
        return [float(self.preemption.preempted()), float(self.preemption.signal_name == "SIGINT")]

    def _record_stop(self, signal_name: str, *, saved: bool | None) -> None:
        """The stop report, the one place it is written: every rank agreed to stop on `signal_name` at self.step,
        with this step's checkpoint saved (True), not saved (False), or without a new one (None: stopped before
        the first step). Logs it (with how much of the shutdown timeout the final save used) and, once per node,
        tells the launcher (trainer/errors.py record_stop)."""
        self.stop_signal = signal_name
        if saved is None:
            log.warning("%s before the first step: stopping at step %d without a new checkpoint", signal_name,
                        self.step)
        else:
            self.preemption.report(self.step, saved=saved, elsewhere=signal_name)
        if self.env.local_rank == 0:
            record_stop(self.step, saved=saved, signal=signal_name)

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
        stop, sigint = self.stop_flags()
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
                                   t_opt - t_sync, lr)
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
            loop = LoopState(step=self.step, tokens_seen=self.tokens_seen, loss_value=self.loss_value,
                             evals=self.evals, sampler=self.sampler, run_id=self.tracker.run_id, run_key=self.run_key,
                             mlflow_unsent=self.tracker.unsent(self.step, self._latest_points()))
            state = loop.to_dict(self.scheduler, world_size=self.env.world_size, data_uri=self.cfg.data.uri,
                                 manifest_sha256=self.ds.manifest_sha256)
            tok = self.tokenizer  # rank 0's; the checkpoint manager keeps rank 0's meta and files
            return self.checkpointer.save(
                self.step, self.model, self.optimizer, state, to_dict(self.cfg), block=block,
                meta={"tokenizer": tok.describe()} if tok is not None else None,
                files={TOKENIZER: tok.json.encode()} if tok is not None and tok.json is not None else None)

    def _latest_points(self) -> dict[str, float] | None:
        """What MLflow gets of this step before its record, which is logged after the checkpoint: a relaunch from
        the checkpoint sends them if the run lacks them (Tracker.unsent)."""
        done = self._settled
        if done is None or done.step != self.step or not self.metrics.tracked(self.step):
            return None
        return {"loss": self.loss_value, "lr": done.lr, "tokens": self.tokens_seen}

    def saved_here(self) -> bool:
        """A checkpoint of this very step exists: saved by this launch, or the one this launch resumed from."""
        saved = self.checkpointer.saved
        return bool(saved and saved[-1].step == self.step) or (self.step == self.start_step and self.step > 0)

    def quiesce(self) -> None:
        """Wait for the checkpoint saves in flight and disarm the watchdog: nothing runs while the run is held at
        its token budget (trainer/budget.py)."""
        self.checkpointer.wait()
        self.watchdog.disarm()

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
        """Wait for the last save, then the summary and (rank 0) the outputs; returns the summary. Collective."""
        tc, env, ckpt = self.cfg.train, self.env, self.checkpointer
        with self.watchdog.allowance("finish", self.cfg.watchdog.checkpoint_s, "watchdog.checkpoint_s, end of run"):
            ckpt.wait()
            if status != "preempted" and ckpt.failed and ckpt.failed[-1].step == self.step and (
                    not ckpt.saved or ckpt.saved[-1].step < self.step):
                raise TrainingFailed(f"the final checkpoint (step {self.step}) was not saved: {ckpt.failed[-1].error}")
            tokens_per_s = ((self.step - self.start_step) * tc.global_batch_tokens / self.elapsed
                            if self.step > self.start_step else 0.0)  # this launch's throughput
            full = self.runner.full_state_dict()  # collective (shards and stages gathered): rank 0 gets it all
            summary = run_summary(
                status=status, step=self.step, tokens=self.tokens_seen, loss=self.loss_value, evals=self.evals,
                params_sha256=state_sha256(full) if env.rank == 0 else None, restarts=env.restart_count,
                tokens_per_s=tokens_per_s, mfu=self.metrics.mfu(tokens_per_s), device=env.device,
                signal=self.stop_signal if status == "preempted" else None)
            if self.energy is not None:  # started by train()
                summary.update(self.energy.finish(env, self.tracker, self.step))  # collective: all GPUs' energy
            if self.budget is not None:  # a sweep trial: the controller reads how it ended
                self.budget.status(status, params_sha256=summary["params_sha256"])
            if env.rank == 0:
                write_outputs(RunOutputs(
                    cfg=self.cfg, run_dir=self.run_dir, tokenizer=self.tokenizer, tracker=self.tracker,
                    checkpointer=ckpt, evals=self.evals, first=self.first, manifest_sha256=self.ds.manifest_sha256,
                    device=env.device), full, summary)
        return summary
