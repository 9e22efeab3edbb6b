"""The bundled trainer's own state in every checkpoint, and its resume: what the GPT loop adds to the library's
CheckpointManager (which saves and verifies model, optimizer and this state, and falls back past damaged
checkpoints).

Usage (trainer/train.py):
    loop = resume(cfg, checkpointer, model, optimizer, scheduler, new_sampler=..., manifest_sha256=..., rank=...)
    # collective; LoopState() (step 0, no run id) when there is nothing to resume; the Trainer keeps its fields
    state = LoopState(step=..., ...).to_dict(scheduler, world_size=..., data_uri=..., manifest_sha256=...)
    # JSON: step, tokens, loss, sampler, schedule, run id and key, unsent MLflow points, evals, for every checkpoint

A checkpoint the current settings cannot continue (another model shape, another dataset) is refused with one line
naming the setting before anything is fetched or written (trainer.preflight.compatibility_problem). The learning
rate schedule is a pure function of (step, the current settings), so a changed train.lr, min_lr, warmup_steps or
steps takes effect from the resumed step on, with one warning saying so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_train.spec.trainer_config import Config
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.manifest import CheckpointInvalid
from trainer.data.sampler import GlobalSampler
from trainer.errors import BadInput
from trainer.evaluate import EvalState
from trainer.parallelize import continue_schedule, schedule_change
from trainer.preflight import compatibility_problem

log = logging.getLogger("trainer")


@dataclass(frozen=True, kw_only=True)
class LoopState:
    """The loop's own position: what every checkpoint saves beside the model and optimizer, and what `resume`
    returns (these defaults when there is nothing to resume: a fresh run from step 0)."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0
    loss_value: float = math.nan  # the last step's loss
    evals: EvalState = field(default_factory=EvalState)  # validation losses so far (early stopping)
    sampler: GlobalSampler | None = None  # at `step`; None: the fresh run keeps the sampler it built
    run_id: str | None = None  # the MLflow run to continue
    run_key: str | None = None  # names the run in MLflow when the checkpoint holds no run id (trainer/tracking.py)
    mlflow_unsent: list[list[Any]] = field(default_factory=list)  # metric points not known stored (Tracker.unsent)
    resumed_from: str | None = None  # the checkpoint's path; None when nothing was resumed

    def to_dict(self, scheduler: torch.optim.lr_scheduler.LRScheduler, *, world_size: int, data_uri: str,
                manifest_sha256: str) -> dict[str, Any]:
        """The JSON saved in every checkpoint (what `resume` reads back)."""
        if self.sampler is None:
            raise ValueError("the loop state of a checkpoint needs the sampler's position")
        return {"step": self.step, "tokens": self.tokens_seen, "loss": self.loss_value,
                "sampler": self.sampler.state_dict(), "scheduler": scheduler.state_dict(),
                "mlflow_run_id": self.run_id, "mlflow_run_key": self.run_key, "mlflow_unsent": self.mlflow_unsent,
                "world_size": world_size,
                "dataset": {"uri": data_uri, "manifest_sha256": manifest_sha256},
                "eval": self.evals.to_dict()}


def _manifest_run_id(manifest: dict[str, Any] | None) -> str | None:
    """The run id in the manifest's copy of the trainer state (rank 0 reads the manifest rank 0 wrote): what a
    checkpoint written before every rank saved rank 0's state holds where its DCP copy may not."""
    state = (manifest or {}).get("trainer")
    run_id = state.get("mlflow_run_id") if isinstance(state, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def resume(cfg: Config, checkpointer: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, *, new_sampler: Callable[[], GlobalSampler],
           manifest_sha256: str, rank: int) -> LoopState:
    """Load the newest checkpoint every rank can load (refusing an incompatible one before anything is written)
    into the model, optimizer and schedule; returns the loop's state there, or LoopState() to start from step 0
    (then `checkpointer.model_touched` says whether a load that failed part-way may have changed parameters)."""
    restored: dict[str, Any] = {}
    seen: dict[str, Any] = {}

    def check(manifest: dict[str, Any], where: str) -> None:
        reason = compatibility_problem(cfg, manifest, where, manifest_sha256)
        if reason:
            raise BadInput(reason)
        seen["manifest"] = manifest

    def apply(state: dict[str, Any]) -> None:
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise CheckpointInvalid(f"trainer state step {step!r} is not a whole number")
        sampler = new_sampler()
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        continue_schedule(optimizer, scheduler, cfg, step)
        if sampler.next_step != step:
            raise CheckpointInvalid(f"sampler is at step {sampler.next_step} but the checkpoint is at step {step}")
        restored.update(sampler=sampler, step=step, tokens_seen=int(state["tokens"]),
                        loss_value=float(state.get("loss", math.nan)), evals=EvalState.from_dict(state.get("eval")),
                        run_id=state.get("mlflow_run_id") or _manifest_run_id(seen.get("manifest")),
                        run_key=state.get("mlflow_run_key") or None, mlflow_unsent=state.get("mlflow_unsent") or [])

    found = checkpointer.resume(model, optimizer, check=check, apply=apply, report=False)  # said below
    if found is None:
        return LoopState()
    loop = LoopState(**restored, resumed_from=str(found))
    log.info("resumed from %s at step %d (%d tokens seen)", found, loop.step, loop.tokens_seen)
    old_train = ((seen.get("manifest") or {}).get("config") or {}).get("train")
    change = schedule_change(old_train, cfg, loop.step) if isinstance(old_train, dict) else None
    if change and rank == 0:
        log.warning("%s", change)
    return loop
