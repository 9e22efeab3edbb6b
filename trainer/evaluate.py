"""Validation loss over a fixed set of held-out windows: a pure function of the weights and the data.

Use (every rank calls it; the caller reduces)::

    from trainer.data import open_dataset
    from trainer.evaluate import evaluate, reduce_eval
    val = open_dataset(cfg.data.uri, context=T, split="val", cache_dir=..., endpoint_url=...)
    part = evaluate(wrapped, val, batches=cfg.eval.batches, micro_batch_size=cfg.train.micro_batch_size,
                    rank=env.rank, world=env.world_size, device=env.device, autocast=autocast_ctx)
    val_loss = reduce_eval(part, device=env.device)     # all-reduce of (sum, count); same on every rank
    evals = EvalState(); evals.record(step, val_loss); evals.exhausted(patience)   # early stopping

Which windows: ``batches * micro_batch_size`` windows spread evenly over the split
(``eval_windows``), chosen without any randomness or world size, so the loss of a checkpoint is the same
number whether one rank or sixteen compute it, and two evaluations of a run are comparable. Each rank
takes a contiguous share; shares differ by at most one window and every rank runs the same number of
forward passes (a short share is padded with a window whose loss is not counted), because an FSDP model
gathers its parameters in each forward and a rank that stopped early would hang the others.

The loss of a window is the mean cross-entropy of its ``context`` next-token predictions (what training
reports); the result is the mean over windows, i.e. over tokens, since every window has the same length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class EvalResult:
    """One rank's part: the sum of its windows' losses and how many windows that is."""

    loss_sum: float
    windows: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.windows if self.windows else math.nan


def eval_windows(num_windows: int, count: int) -> np.ndarray:
    """``min(count, num_windows)`` distinct window indices spread evenly over ``[0, num_windows)``."""
    if num_windows < 1 or count < 1:
        raise ValueError(f"need >= 1 window and count >= 1 (got {num_windows}, {count})")
    n = min(count, num_windows)
    return (np.arange(n, dtype=np.int64) * num_windows) // n


def rank_share(n: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of rank ``rank``'s contiguous share of ``n`` items; sizes differ by at most one."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of size {world}")
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def evaluate(
    model: torch.nn.Module,
    dataset: Any,  # trainer.data.Dataset: num_windows, batch(indices)
    *,
    batches: int,
    micro_batch_size: int,
    rank: int = 0,
    world: int = 1,
    device: torch.device | str = "cpu",
    autocast: AbstractContextManager[Any] | Callable[[], AbstractContextManager[Any]] | None = None,
    window_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None,
) -> EvalResult:
    """This rank's part of the validation loss (see the module docstring); restores the model's mode.

    ``model(x)`` must return ``(logits, ...)`` as ``trainer.model.GPT`` (raw, DDP- or FSDP-wrapped) does.
    ``autocast`` is a context manager (or a factory of one) entered around each forward pass.
    ``window_losses(x, y)``, when given, computes each window's mean loss instead of ``model`` (a tensor or
    pipeline parallel model: trainer.parallelize.StepRunner.window_losses), or None on a rank that computes none
    (a pipeline stage other than the last): that rank's part counts no windows. ``rank`` and ``world`` are then
    the data-parallel rank and degree: the ranks that share a part (tensor parallel, pipeline stages) compute it
    together.
    """
    if batches < 1 or micro_batch_size < 1:
        raise ValueError(f"batches and micro_batch_size must be >= 1 (got {batches}, {micro_batch_size})")
    windows = eval_windows(dataset.num_windows, batches * micro_batch_size)
    per_rank = -(-windows.size // world)
    steps = -(-per_rank // micro_batch_size)
    lo, hi = rank_share(windows.size, rank, world)
    mine = windows[lo:hi]
    total = torch.zeros((), dtype=torch.float64)
    counted = True  # whether this rank computed its windows' losses
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step in range(steps):
                idx = mine[step * micro_batch_size : (step + 1) * micro_batch_size]
                real = idx.size
                if real == 0:  # padding pass: keeps every rank's forward count equal
                    idx = windows[:1]
                xy = torch.from_numpy(dataset.batch(idx.tolist())).to(device)
                x, y = xy[:, :-1], xy[:, 1:]
                if window_losses is not None:
                    per_window = window_losses(x, y)
                    if per_window is None:
                        counted = False
                        continue
                else:
                    ctx = autocast() if callable(autocast) else (autocast or contextlib.nullcontext())
                    with ctx:
                        logits = model(x)[0]
                    per_token = F.cross_entropy(
                        logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none"
                    )
                    per_window = per_token.view(y.shape).mean(dim=1)
                total += per_window[:real].sum().double().cpu()
    finally:
        model.train(was_training)
    return EvalResult(float(total), int(mine.size) if counted else 0)


def reduce_eval(part: EvalResult, device: torch.device | str = "cpu", group: Any = None) -> float:
    """Mean loss over every rank's windows: an all-reduce of (sum, count) when a process group is up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return part.loss
    t = torch.tensor([part.loss_sum, float(part.windows)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t[0] / t[1]) if t[1] > 0 else math.nan


@dataclass
class EvalState:
    """What a run knows about its validation loss, kept in every checkpoint (`to_dict`/`from_dict`) so that
    early stopping survives restarts (an evaluation at a checkpoint's step runs before that checkpoint)."""

    last: float | None = None
    last_step: int | None = None
    best: float | None = None
    best_step: int | None = None
    bad: int = 0  # evaluations in a row without a new best

    def record(self, step: int, val_loss: float) -> dict[str, Any]:
        """Note an evaluation; returns it as a metrics record (trainer.metrics.MetricsProcessor.log)."""
        self.last, self.last_step = val_loss, step
        if math.isfinite(val_loss) and (self.best is None or val_loss < self.best):
            self.best, self.best_step, self.bad = val_loss, step, 0
        else:
            self.bad += 1
        return {"event": "eval", "val_loss": val_loss, "best_val_loss": self.best, "best_val_step": self.best_step,
                "evals_without_improvement": self.bad}

    def exhausted(self, patience: int) -> bool:
        """Early stopping is due: `patience` evaluations in a row brought no new best."""
        return patience > 0 and self.bad >= patience

    def why_stopped(self, patience: int) -> str:
        best = math.nan if self.best is None else self.best
        return (f"no new best validation loss in {self.bad} evaluations (eval.early_stopping_patience={patience}); "
                f"best {best:.4f} at step {self.best_step}")

    def to_dict(self) -> dict[str, Any]:
        return {"last": self.last, "last_step": self.last_step, "best": self.best, "best_step": self.best_step,
                "bad": self.bad}

    @classmethod
    def from_dict(cls, data: Any) -> EvalState:
        if not isinstance(data, dict):
            return cls()
        return cls(last=data.get("last"), last_step=data.get("last_step"), best=data.get("best"),
                   best_step=data.get("best_step"), bad=int(data.get("bad") or 0))
