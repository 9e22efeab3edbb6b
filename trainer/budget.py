"""A token budget for a run: train up to the tokens a budget object allows, then hold there (checkpoint saved, no
GPU work) until the budget is raised or the run is stopped. This is how a sweep pauses and promotes its trials.

Usage (trainer/train.py does this when `train.budget_uri` is set):
    budget = TokenBudget.open(cfg.train.budget_uri, endpoint_url=cfg.checkpoint.endpoint_url or None,
                              rank=env.rank, world_size=env.world_size, device=env.device)
    budget.limit()                    # tokens the run may train to, agreed by every rank (collective); None = none
    budget.write_status({...})        # rank 0: status.json beside the budget object

The budget object (`file://`, `s3://` or `gs://`, read with the trainer's storage layer) is JSON
`{"tokens": N}`, written by whoever controls the run (gpu_train.sweeps). Beside it the trainer writes
`status.json` (rank 0): its state (`running`, `held`, `completed`, `stopped_early`, `preempted`), step and
tokens, the world size, every validation loss so far (each one all-reduced, so all ranks hold the same
number; trainer/evaluate.py reduce_eval) and, at the end, the final weights' hash. The controller reads that
file and nothing else of the run: no log is parsed.

Holding: at the first step boundary where the tokens seen reach the limit, the trainer evaluates (unless it
just did at this step), saves a checkpoint synchronously, writes `held`, and polls the budget every
`POLL_S` seconds with one small all-reduce, so every rank takes the same decision: a raised limit continues
at once, in the same processes (same data position, RNG, optimizer and schedule, which runs over
train.steps, never over the budget); SIGTERM or SIGINT stops the run as preempted, the checkpoint already
written. A missing budget object holds too (one line says so): a run given a budget never trains past what
it was allowed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gpu_train.spec.trainer_config import Config
from gpu_train.storage import ObjectNotFoundError, StorageError, open_store
from trainer.distributed import DistEnv
from trainer.evaluate import EvalState

log = logging.getLogger("trainer")

POLL_S = 0.5
STATUS_NAME = "status.json"


def split_uri(uri: str) -> tuple[str, str]:
    """(directory URI, object name) of a budget URI: `s3://b/sweeps/t1/budget.json` -> (`s3://b/sweeps/t1`,
    `budget.json`)."""
    parsed = urlparse(uri)
    head, _, name = parsed.path.rstrip("/").rpartition("/")
    if not name:
        raise ValueError(f"train.budget_uri {uri!r} names no object")
    return f"{parsed.scheme}://{parsed.netloc}{head}", name


@dataclass
class TokenBudget:
    """The budget of one run on this rank; every method but `write_status` is called on every rank."""

    uri: str
    store: Any  # gpu_train.storage.Store rooted at the budget's directory
    name: str
    rank: int
    world_size: int
    device: torch.device
    _missing_said: bool = False

    @classmethod
    def open(cls, uri: str, *, endpoint_url: str | None, rank: int, world_size: int,
             device: torch.device) -> TokenBudget:
        directory, name = split_uri(uri)
        return cls(uri=uri, store=open_store(directory, endpoint_url), name=name, rank=rank,
                   world_size=world_size, device=device)

    def _read(self) -> int | None:
        """Rank 0's reading of the budget: its tokens, or None when the object is missing or unreadable."""
        try:
            doc = json.loads(self.store.get_bytes(self.name))
        except ObjectNotFoundError:
            if not self._missing_said:
                log.warning("train.budget_uri %s does not exist (yet): holding until it does", self.uri)
                self._missing_said = True
            return None
        except (StorageError, ValueError) as exc:
            log.warning("train.budget_uri %s could not be read (%s): holding", self.uri, exc)
            return None
        tokens = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            log.warning("train.budget_uri %s holds no whole number of tokens (%r): holding", self.uri, doc)
            return None
        return tokens

    def limit(self, stop: float = 0.0, sigint: float = 0.0) -> tuple[int, bool, bool]:
        """(the tokens every rank may train to: rank 0's reading, 0 when it has none; whether any rank got a stop
        signal; whether that was SIGINT). Collective: one all-reduce."""
        tokens = (self._read() or 0) if self.rank == 0 else 0
        flags = torch.tensor([float(tokens), stop, sigint], dtype=torch.float64, device=self.device)
        dist.all_reduce(flags)
        values = flags.tolist()
        return int(values[0]), values[1] > 0, values[2] > 0

    def write_status(self, status: dict[str, Any]) -> None:
        """status.json beside the budget (rank 0 only; a failed write is a warning: the controller reads again)."""
        if self.rank != 0:
            return
        doc = {**status, "world_size": self.world_size, "written_unix": time.time()}
        try:
            self.store.put_bytes(STATUS_NAME, (json.dumps(doc, indent=1) + "\n").encode())
        except StorageError as exc:
            log.warning("could not write %s beside train.budget_uri %s: %s", STATUS_NAME, self.uri, exc)


class TrialBudget:
    """A sweep trial's token budget for any loop: the library piece the bundled trainer's hold (BudgetHold, below)
    is built on too.

    Usage (examples/plain-loop/train.py; the trial's command gets the URI from the sweep as ${trial.budgetUri}):
        trial = TrialBudget.open(uri, rank=env.rank, world_size=env.world_size, device=env.device)
        ... after each step, with `tokens` trained in all:
        if trial.reached(tokens):
            trial.report(step, tokens, val_loss)         # evaluate where it holds (every rank, the same value)
            save a checkpoint of this step, blocking
            if trial.hold(step, tokens, preemption):     # a stop signal came: the checkpoint is the trial's
                exit 75
        ... at the end: trial.report(...); trial.finish(step, tokens, params_sha256)

    status.json beside the budget object is what the sweep controller reads (module docstring). Every method is
    called on every rank; only rank 0 reads the budget and writes the status."""

    def __init__(self, budget: TokenBudget) -> None:
        self.budget = budget
        self.evals: list[dict[str, Any]] = []  # this launch's validation losses, for status.json
        self.allowed, _, _ = budget.limit()  # collective, once per launch: steps train freely below it

    @classmethod
    def open(cls, uri: str, *, rank: int, world_size: int, device: torch.device,
             endpoint_url: str | None = None) -> TrialBudget:
        return cls(TokenBudget.open(uri, endpoint_url=endpoint_url, rank=rank, world_size=world_size,
                                    device=device))

    def status(self, state: str, step: int, tokens: int, **extra: Any) -> None:
        self.budget.write_status({"state": state, "step": step, "tokens": tokens, "budget_tokens": self.allowed,
                                  "val_loss": self.evals[-1]["val_loss"] if self.evals else None,
                                  "evals": self.evals, **extra})

    def record(self, step: int, tokens: int, val_loss: float) -> None:
        """A validation loss at `tokens` (the same on every rank: all-reduce it first), kept for status.json."""
        if not self.evals or self.evals[-1]["tokens"] != tokens:
            self.evals.append({"step": step, "tokens": tokens, "val_loss": float(val_loss)})

    def report(self, step: int, tokens: int, val_loss: float) -> None:
        """record(), then status.json says so."""
        self.record(step, tokens, val_loss)
        self.status("running", step, tokens)

    def reached(self, tokens: int) -> bool:
        return tokens >= self.allowed

    def refresh(self, flags: Callable[[], Sequence[float]]) -> tuple[bool, bool]:
        """Read the budget again: (stopped, by SIGINT). `flags()` gives this rank's (stop, sigint) as numbers.
        Collective."""
        self.allowed, stop, sigint = self.budget.limit(*flags())
        return stop, sigint

    def wait(self, tokens: int, flags: Callable[[], Sequence[float]]) -> tuple[bool, bool]:
        """Poll the budget while it allows no more than `tokens`: (stopped, by SIGINT). Collective."""
        stop = sigint = False
        while not stop and tokens >= self.allowed:
            time.sleep(POLL_S)
            stop, sigint = self.refresh(flags)
        return stop, sigint

    def hold(self, step: int, tokens: int, preemption: Any) -> bool:
        """At a step with the budget used up and its checkpoint saved: write `held` and wait for a raised budget
        (False: train on) or a stop signal (True). Collective."""
        def flags() -> tuple[float, float]:
            return float(preemption.preempted()), float(preemption.signal_name == "SIGINT")

        stop, _ = self.refresh(flags)
        if stop or tokens < self.allowed:
            return stop
        self.status("held", step, tokens)
        if self.budget.rank == 0:
            log.info("holding at step %d (%d tokens, budget %d): waiting for a raised budget or a stop", step, tokens,
                     self.allowed)
        stop, _ = self.wait(tokens, flags)
        if not stop:
            self.status("running", step, tokens)
        return stop

    def finish(self, step: int, tokens: int, params_sha256: str | None, state: str = "completed") -> None:
        self.status(state, step, tokens, params_sha256=params_sha256)


class HeldRun(Protocol):
    """What a BudgetHold reads and asks of the loop it holds (the bundled Trainer, trainer/train.py, is one); each
    method is called on every rank at the same point."""

    @property
    def step(self) -> int: ...  # optimizer steps done

    @property
    def tokens_seen(self) -> int: ...

    @property
    def evals(self) -> EvalState: ...  # validation losses so far (the same on every rank)

    def stop_flags(self) -> list[float]:
        """This rank's (whether it got a stop signal, whether that was SIGINT), as numbers for an all-reduce."""

    def evaluate(self) -> float:
        """The validation loss at this step, recorded (and noted back through `note_eval`)."""

    def save_checkpoint(self, *, block: bool) -> float:
        """Checkpoint this step."""

    def saved_here(self) -> bool:
        """A checkpoint of this very step exists: saved by this launch, or the one this launch resumed from."""

    def quiesce(self) -> None:
        """Wait for the checkpoint saves in flight and disarm the watchdog: nothing runs while held."""


class BudgetHold:
    """The bundled trainer's side of a token budget, on its TrialBudget: when to hold (evaluating and checkpointing
    first) and what it writes besides (its schedule's steps, where its last validation loss came from); a stop
    while held is returned to the loop, which reports it (module docstring).

    steps: the run's train.steps, written in status.json.
    evaluates: whether the run evaluates (eval.every_steps): then it evaluates where it holds."""

    def __init__(self, budget: TokenBudget, run: HeldRun, *, steps: int, evaluates: bool) -> None:
        self.trial, self.run = TrialBudget(budget), run
        self.steps, self.evaluates = steps, evaluates

    def status(self, state: str, **extra: Any) -> None:
        run = self.run
        self.trial.status(state, run.step, run.tokens_seen, steps=self.steps, val_loss=run.evals.last,
                          val_step=run.evals.last_step,
                          val_loss_reduce=f"all_reduce over {self.trial.budget.world_size} ranks", **extra)

    def note_eval(self, val_loss: float) -> None:
        self.trial.record(self.run.step, self.run.tokens_seen, val_loss)
        self.status("running")

    def reached(self) -> bool:
        return self.trial.reached(self.run.tokens_seen)

    def hold(self) -> str | None:
        """At a step boundary with the budget used up: evaluate and checkpoint at this step, write `held`, then wait
        for a raised budget (None: train on) or a stop signal: its name ("SIGTERM" or "SIGINT"; the run stops as
        preempted, the checkpoint of this step saved)."""
        run, trial = self.run, self.trial
        stop, sigint = trial.refresh(run.stop_flags)
        if not stop and not trial.reached(run.tokens_seen):
            return None
        if not stop and self.evaluates and run.evals.last_step != run.step:
            run.evaluate()
        if not run.saved_here():
            run.save_checkpoint(block=True)
        run.quiesce()
        if not stop:
            self.status("held")
            if trial.budget.rank == 0:
                log.info("holding at step %d (%d tokens, budget %d): checkpoint saved, waiting for a raised budget "
                         "or a stop", run.step, run.tokens_seen, trial.allowed)
            stop, sigint = trial.wait(run.tokens_seen, run.stop_flags)
        if stop:
            return "SIGINT" if sigint else "SIGTERM"
        if trial.budget.rank == 0:
            log.info("budget raised to %d tokens: training on from step %d", trial.allowed, run.step)
        self.status("running")
        return None


def hold_for(cfg: Config, env: DistEnv, run: HeldRun) -> BudgetHold:
    """The budget of a run whose train.budget_uri is set (collective: reads the budget once)."""
    endpoint = cfg.checkpoint.endpoint_url or None
    return BudgetHold(TokenBudget.open(cfg.train.budget_uri, endpoint_url=endpoint, rank=env.rank,
                                       world_size=env.world_size, device=env.device), run,
                      steps=cfg.train.steps, evaluates=bool(cfg.eval.every_steps))
