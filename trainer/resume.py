"""The bundled trainer's own state in every checkpoint, and its resume: what the GPT loop adds to the library's
CheckpointManager (which saves and verifies model, optimizer and this state, and falls back past damaged
checkpoints).

Usage (trainer/train.py):
    state = loop_state(trainer)                   # JSON: step, tokens, loss, sampler, schedule, run id and key, evals
    run_id, resumed_from = resume(trainer)        # collective; (None, None) when there is nothing to resume

A checkpoint the current settings cannot continue (another model shape, another dataset) is refused with one line
naming the setting before anything is fetched or written (trainer.preflight.compatibility_problem). The learning
rate schedule is a pure function of (step, the current settings), so a changed train.lr, min_lr, warmup_steps or
steps takes effect from the resumed step on, with one warning saying so.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from trainer import BadInput, CheckpointInvalid
from trainer.evaluate import EvalState
from trainer.parallelize import continue_schedule, schedule_change
from trainer.preflight import compatibility_problem

if TYPE_CHECKING:
    from trainer.train import Trainer

log = logging.getLogger("trainer")


def loop_state(t: Trainer) -> dict[str, Any]:
    """The loop's own state, saved in every checkpoint (JSON)."""
    return {"step": t.step, "tokens": t.tokens_seen, "loss": t.loss_value,
            "sampler": t.sampler.state_dict(), "scheduler": t.scheduler.state_dict(),
            "mlflow_run_id": t.tracker.run_id, "mlflow_run_key": t.run_key, "world_size": t.env.world_size,
            "dataset": {"uri": t.cfg.data.uri, "manifest_sha256": t.ds.manifest_sha256},
            "eval": t.evals.to_dict()}


def _manifest_run_id(manifest: dict[str, Any] | None) -> str | None:
    """The run id in the manifest's copy of the trainer state (rank 0 reads the manifest rank 0 wrote): what a
    checkpoint written before every rank saved rank 0's state holds where its DCP copy may not."""
    state = (manifest or {}).get("trainer")
    run_id = state.get("mlflow_run_id") if isinstance(state, dict) else None
    return run_id if isinstance(run_id, str) and run_id else None


def resume(t: Trainer) -> tuple[str | None, str | None]:
    """Load the newest checkpoint every rank can load (refusing an incompatible one before anything is written)
    into the trainer; returns (its MLflow run id, its path), or (None, None) to start from step 0."""
    restored: dict[str, Any] = {}
    seen: dict[str, Any] = {}

    def check(manifest: dict[str, Any], where: str) -> None:
        reason = compatibility_problem(t.cfg, manifest, where, t.ds.manifest_sha256)
        if reason:
            raise BadInput(reason)
        seen["manifest"] = manifest

    def apply(state: dict[str, Any]) -> None:
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise CheckpointInvalid(f"trainer state step {step!r} is not a whole number")
        sampler = t.new_sampler()
        sampler.load_state_dict(state["sampler"])
        t.scheduler.load_state_dict(state["scheduler"])
        continue_schedule(t.optimizer, t.scheduler, t.cfg, step)
        if sampler.next_step != step:
            raise CheckpointInvalid(f"sampler is at step {sampler.next_step} but the checkpoint is at step {step}")
        restored.update(sampler=sampler, step=step, tokens_seen=int(state["tokens"]),
                        loss_value=float(state.get("loss", math.nan)), evals=EvalState.from_dict(state.get("eval")),
                        run_id=state.get("mlflow_run_id") or _manifest_run_id(seen.get("manifest")),
                        run_key=state.get("mlflow_run_key") or None)

    found = t.checkpointer.resume(t.model, t.optimizer, check=check, apply=apply, report=False)  # said below
    if found is None:
        if t.checkpointer.model_touched:  # a load that failed part-way may have changed parameters
            t.build_model()
        return None, None
    run_id = restored.pop("run_id")
    for key, value in restored.items():
        setattr(t, key, value)
    log.info("resumed from %s at step %d (%d tokens seen)", found, t.step, t.tokens_seen)
    old_train = ((seen.get("manifest") or {}).get("config") or {}).get("train")
    change = schedule_change(old_train, t.cfg, t.step) if isinstance(old_train, dict) else None
    if change and t.env.rank == 0:
        log.warning("%s", change)
    return run_id, str(found)
