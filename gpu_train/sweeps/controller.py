"""The sweep controller: asks Optuna for trials, runs them as ordinary jobs through a backend (local torchrun jobs,
or JobSets in the team's queue), reads their validation losses from the trainer's own status.json, pauses and
promotes them at ASHA's rungs, and writes every decision to the journal before it acts on it.

Usage:
    controller = Controller(sweep, sweep_dir, backend, tracker=SweepTracker.open(...), out=sys.stderr)
    best = controller.run()      # until every trial is finished, pruned or failed; a TrialState or None

A backend (gpu_train.sweeps.local.LocalBackend; the cluster's in gpu_train.sweeps.cluster) does what the
controller asks of a trial: `settings(trial)` (the trainer settings that tie the trial to the sweep: its budget
object, its MLflow parent), `write_budget`, `launch` (start, or resume from its checkpoint: idempotent),
`pause` (stop it, its checkpoint kept; in the cluster the same Workload suspend as `gpu-train pause`), `stop`,
`read_status` (its status.json) and `ended` (None while its job runs, else how it ended).

`on_record` is called after each journal record, before the action it records (the cluster's controllers copy
the journal to the object store there: gpu_train.sweeps.mirror); `heartbeat`, a file touched at every pass (the
in-cluster controller's liveness probe reads its age).

Restart: the journal (gpu_train.sweeps.journal) and Optuna's journal are read back; trials Optuna asked for that
the journal missed are adopted with their parameters, never asked again; every trial the journal says is running
is launched again, which resumes it from its checkpoint (a running one is left alone). Each action is keyed by
the trial id, so doing it twice does nothing more than doing it once.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

from gpu_train.spec.job import JobSpec
from gpu_train.spec.sweep import SweepSpec, trial_job, trial_name
from gpu_train.sweeps.algorithms import Policy, journal_storage
from gpu_train.sweeps.journal import ACTIVE, JOURNAL, Journal, SweepState, TrialState, read_journal

log = logging.getLogger("gpu_train.sweeps")


class SweepFailed(RuntimeError):
    """More trials failed than trialConfig.maxFailedTrials allows."""


class Backend(Protocol):
    poll_s: float

    def settings(self, trial: TrialState) -> dict[str, Any]: ...
    def write_budget(self, trial: TrialState, tokens: int) -> None: ...
    def launch(self, trial: TrialState, job: JobSpec) -> None: ...
    def pause(self, trial: TrialState) -> None: ...
    def stop(self, trial: TrialState) -> None: ...
    def read_status(self, trial: TrialState) -> dict[str, Any] | None: ...
    def ended(self, trial: TrialState) -> str | None: ...


class Controller:
    def __init__(self, sweep: SweepSpec, sweep_dir: Path, backend: Backend, *, tracker: Any = None,
                 out: TextIO | None = None, on_record: Callable[[], None] | None = None,
                 heartbeat: Path | None = None) -> None:
        self.sweep, self.dir, self.backend, self.tracker = sweep, Path(sweep_dir), backend, tracker
        self.out = out or sys.stderr
        self.on_record, self.heartbeat = on_record, heartbeat
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state = SweepState.replay(read_journal(self.dir / JOURNAL))
        self.journal = Journal(self.dir / JOURNAL)
        self.policy = Policy(sweep, journal_storage(self.dir))
        self.stopping = threading.Event()
        self._begin()

    # ------------------------------------------------------------------------------------------- journal
    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Journal first (fsync'd), then apply to the state: an action follows its record, never precedes it."""
        r = self.journal.append(event, **fields)
        self.state.apply(r)
        if self.on_record:
            self.on_record()
        return r

    def say(self, text: str) -> None:
        print(f"sweep {self.sweep.name}: {text}", file=self.out, flush=True)

    def _begin(self) -> None:
        if self.state.start is None:
            parent = self.tracker.start(self.sweep) if self.tracker else None
            self.record("start", sweep=self.sweep.name, algorithm=self.sweep.algorithm.name,
                        early_stopping=self.sweep.early.name, seed=self.sweep.algorithm.seed,
                        rungs=self.sweep.rungs(), max_tokens=self.sweep.max_tokens, mlflow_parent_run_id=parent)
        else:
            if self.state.start.get("sweep") != self.sweep.name:
                raise ValueError(f"{self.dir / JOURNAL} belongs to sweep {self.state.start.get('sweep')!r}, "
                                 f"not {self.sweep.name!r}")
            self.say(f"resuming from its journal ({self.journal.seq} records, {len(self.state.trials)} trials)")
            if self.tracker:
                self.tracker.resume(self.state.start.get("mlflow_parent_run_id"))
        # Asked for by Optuna, never journaled (killed in between): adopted, not asked again.
        for number in range(len(self.state.trials), self.policy.count()):
            self.record("suggest", trial=trial_name(self.sweep, number), number=number,
                        params=self.policy.complete(number), adopted=True)

    @property
    def parent_run_id(self) -> str | None:
        return (self.state.start or {}).get("mlflow_parent_run_id")

    # ------------------------------------------------------------------------------------------- actions
    def job_of(self, t: TrialState) -> JobSpec:
        return trial_job(self.sweep, t.id, t.params, self.backend.settings(t))

    def next_budget(self, tokens: int) -> int:
        """The rung after `tokens`, or the whole budget."""
        return next((r for r in self.sweep.rungs() if r > tokens), self.sweep.max_tokens)

    def launch(self, t: TrialState) -> None:
        self.record("launch", trial=t.id, budget=t.budget or self.next_budget(0))
        self.backend.write_budget(t, t.budget)
        self.backend.launch(t, self.job_of(t))

    def start_trial(self) -> None:
        number = len(self.state.trials)
        params = self.policy.suggest(number)
        t = self.state.trials.get(trial_name(self.sweep, number))
        if t is None:
            self.record("suggest", trial=trial_name(self.sweep, number), number=number, params=params)
            t = self.state.trials[trial_name(self.sweep, number)]
        self.say(f"{t.id} suggested: " + ", ".join(f"{k}={_fmt(v)}" for k, v in params.items()))
        self.launch(t)

    # ------------------------------------------------------------------------------------------- one pass
    def observe(self, t: TrialState) -> None:
        """Read a running trial's status.json: new validation losses, a hold at a rung, the end."""
        status = self.backend.read_status(t) or {}
        for ev in sorted(status.get("evals") or [], key=lambda e: e["tokens"]):
            tokens, value = int(ev["tokens"]), float(ev["val_loss"])
            if tokens in t.reports or tokens > t.budget:
                continue
            self.policy.report(t.number, tokens, value)
            self.record("report", trial=t.id, tokens=tokens, value=value, world_size=status.get("world_size"))
            if self.sweep.early.name == "median" and tokens < self.sweep.max_tokens and \
                    self.policy.median_stop(t.number):
                self.prune(t, tokens, "below the median of the other trials at this point")
                return
        state, tokens = status.get("state"), int(status.get("tokens") or 0)
        if state == "held" and tokens == t.budget and tokens in self.sweep.rungs() and tokens not in t.decided:
            self.decide(t, tokens)
        elif state == "stopped_early" or (state == "completed" and tokens >= t.budget):  # its own patience, or done
            self.finish(t, status)
        elif (why := self.backend.ended(t)) is not None and self.state.trials[t.id].state in ACTIVE:
            self.ended(t, why, status)

    def decide(self, t: TrialState, tokens: int) -> None:
        value = t.reports.get(tokens)
        if value is None:
            self.fail(t, f"held at {tokens} tokens without a validation loss there (set eval.every_steps)")
            return
        verdict = self.policy.at_rung(t.number, tokens)
        if verdict == "promote":
            budget = self.next_budget(tokens)
            self.record("promote", trial=t.id, tokens=tokens, budget=budget, value=value)
            self.backend.write_budget(t, budget)
            self.say(f"{t.id} at {tokens:,} tokens: val_loss {value:.4f}, promoted to {budget:,} tokens (trains on)")
        else:
            self.record("pause", trial=t.id, tokens=tokens, value=value)
            self.backend.pause(t)
            self.say(f"{t.id} at {tokens:,} tokens: val_loss {value:.4f}, paused (checkpoint kept, slot released)")

    def finish(self, t: TrialState, status: dict[str, Any]) -> None:
        value = status.get("val_loss")
        if value is None or not math.isfinite(float(value)):
            self.fail(t, "finished without a validation loss")
            return
        self.policy.finish(t.number, float(value))
        self.record("finish", trial=t.id, value=float(value), tokens=int(status.get("tokens") or 0),
                    params_sha256=status.get("params_sha256"))
        self.say(f"{t.id} finished: val_loss {float(value):.4f} at {int(status.get('tokens') or 0):,} tokens")

    def prune(self, t: TrialState, tokens: int, why: str) -> None:
        self.policy.prune(t.number)
        self.record("prune", trial=t.id, tokens=tokens, why=why)
        self.backend.stop(t)
        self.say(f"{t.id} pruned at {tokens:,} tokens: {why}")

    def fail(self, t: TrialState, why: str) -> None:
        self.policy.fail(t.number)
        self.record("fail", trial=t.id, why=why)
        self.backend.stop(t)
        self.say(f"{t.id} failed: {why}")
        failed = len(self.state.by_state("failed"))
        if failed > self.sweep.trial_config.max_failed_trials:
            raise SweepFailed(f"{failed} trials failed, more than trialConfig.maxFailedTrials "
                              f"({self.sweep.trial_config.max_failed_trials}); the last: {t.id}: {why}")

    def ended(self, t: TrialState, why: str, status: dict[str, Any]) -> None:
        """Its job ended without finishing: stopped from outside (launched again: it resumes), or failed."""
        if why == "preempted":
            self.say(f"{t.id} was stopped from outside at {int(status.get('tokens') or 0):,} tokens: launching it "
                     "again from its checkpoint")
            self.launch(t)
        else:
            self.fail(t, why)

    def promotions(self, slots: int) -> int:
        """Paused trials that rank in the top 1/eta of their rung, highest rung first, launched again."""
        started = 0
        for rung in reversed(self.sweep.rungs()):
            values = [x.reports[rung] for x in self.state.trials.values() if rung in x.reports]
            paused = sorted((x for x in self.state.by_state("paused") if max(x.decided, default=-1) == rung),
                            key=lambda x: (x.reports[rung], x.number))
            for t in paused:
                if started >= slots or not self.policy.promotable(t.number, rung, values):
                    continue
                budget = self.next_budget(rung)
                self.record("promote", trial=t.id, tokens=rung, budget=budget, value=t.reports[rung], resume=True)
                self.say(f"{t.id} promoted from its pause at {rung:,} tokens to {budget:,} tokens (resumes from its "
                         "checkpoint)")
                self.launch(t)
                started += 1
        return started

    def step(self) -> bool:
        """One pass over every trial; False once the sweep is over."""
        for t in list(self.state.by_state(*ACTIVE)):
            self.observe(t)
        slots = self.sweep.trial_config.parallel_trials - len(self.state.by_state(*ACTIVE))
        slots -= self.promotions(slots)
        while slots > 0 and len(self.state.trials) < self.sweep.trial_config.num_trials:
            self.start_trial()
            slots -= 1
        if self.state.by_state(*ACTIVE) or len(self.state.trials) < self.sweep.trial_config.num_trials:
            return True
        for t in self.state.by_state("paused"):  # nothing left that could move them up
            self.prune(t, max(t.decided), "not promoted: below the top 1/reductionFactor at its rung")
        return False

    def resume_active(self) -> None:
        """After a restart: every trial the journal says is running or held runs (launched again if needed)."""
        for t in self.state.by_state(*ACTIVE):
            if self.backend.ended(t) is not None:
                self.backend.write_budget(t, t.budget)
                self.backend.launch(t, self.job_of(t))

    def run(self) -> TrialState | None:
        if self.state.done is not None:
            self.say("already done")
            return self.state.best()
        self.resume_active()
        while self.step():
            if self.heartbeat:
                self.heartbeat.touch()
            if self.stopping.wait(self.backend.poll_s):
                raise KeyboardInterrupt
        best = self.state.best()
        self.record("done", best=best.id if best else None, value=best.value if best else None,
                    params=best.params if best else None)
        if best:
            self.say(f"best trial {best.id}: val_loss {best.value:.4f} with " +
                     ", ".join(f"{k}={_fmt(v)}" for k, v in best.params.items()))
        return best


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
