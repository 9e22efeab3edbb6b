"""The sweep's decisions, made by Optuna through its ask-and-tell interface (no Optuna code runs in a trial).

Usage:
    policy = Policy(sweep, storage=journal_storage(sweep_dir))   # or an in-memory study, for a replay
    trial = policy.suggest(number)        # optuna.trial.Trial: its params are the trial's settings
    policy.report(number, tokens, value)  # a validation loss the trainer wrote, at `tokens`
    policy.at_rung(number, tokens)        # "promote" or "pause": ASHA at a rung (Optuna's SuccessiveHalvingPruner)
    policy.promotable(number, tokens, rung_values)   # may a paused trial go on now
    policy.median_stop(number)            # MedianPruner's verdict after the last report
    policy.finish(number, value) / policy.prune(number) / policy.fail(number)

Samplers: RandomSampler, GridSampler and TPESampler (constant liar, for parallel trials), each seeded from the
sweep's seed (random and TPE: and the trial's number) before its ask, so a suggestion depends only on the study's trials and
that seed: a restarted controller and a replay ask exactly what the first run asked.

Pause and promote. Optuna's SuccessiveHalvingPruner decides at a rung whether a trial goes on (promote: its
budget is raised and it trains on without a restart) or not. Optuna itself can only stop such a trial; here it
is paused instead (checkpoint kept, quota released), and a paused trial is promoted later, as ASHA does
(Li et al., "A System for Massively Parallel Hyperparameter Tuning", MLSys 2020, Algorithm 2), once it ranks in
the top 1/reductionFactor of every value reported at its rung. That later test is written here, since Optuna
has none. So is one more: a controller killed after Optuna recorded a rung (its `completed_rung_K` attribute)
but before the journal recorded the verdict decides again with Optuna's own rule, from the values Optuna held
then, instead of asking the pruner twice (which would skip the rung).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from gpu_train.spec.errors import SettingsError
from gpu_train.spec.sweep import Parameter, SweepSpec

log = logging.getLogger("gpu_train.sweeps")
optuna.logging.set_verbosity(optuna.logging.WARNING)
OPTUNA_JOURNAL = "optuna.journal"


def journal_storage(sweep_dir: Path) -> JournalStorage:
    """Optuna's study, in its own append-only journal file beside the sweep's."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(sweep_dir / OPTUNA_JOURNAL)))


def distribution(p: Parameter) -> BaseDistribution:
    if p.distribution == "choice":
        return CategoricalDistribution(list(p.values or []))
    log_scale = p.distribution == "logUniform"
    if p.type == "int":
        return IntDistribution(int(p.min), int(p.max), log=log_scale, step=int(p.step) if p.step else 1)
    return FloatDistribution(float(p.min), float(p.max), log=log_scale, step=p.step)


def grid_values(p: Parameter) -> list[Any]:
    """The values grid search tries for one parameter."""
    if p.distribution == "choice":
        return list(p.values or [])
    lo, hi = float(p.min), float(p.max)
    if p.points:
        values = np.geomspace(lo, hi, p.points) if p.distribution == "logUniform" else np.linspace(lo, hi, p.points)
        out = [float(v) for v in values]
    elif p.step:
        out = [lo + i * p.step for i in range(int(math.floor((hi - lo) / p.step + 1e-9)) + 1)]
    else:  # an int parameter without step or points: every whole number
        out = list(range(int(lo), int(hi) + 1))
    return sorted({int(round(v)) for v in out}) if p.type == "int" else out


def trial_seed(seed: int, number: int) -> int:
    return (seed * 1_000_003 + number) % 2**32


class Policy:
    """The sweep's Optuna study and every decision taken on it (module docstring)."""

    def __init__(self, sweep: SweepSpec, storage: Any) -> None:
        self.sweep = sweep
        self.space = {k: distribution(p) for k, p in sorted(sweep.search_space.items())}
        self.grid = {k: grid_values(p) for k, p in sorted(sweep.search_space.items())}
        if sweep.algorithm.name == "grid":
            size = math.prod(len(v) for v in self.grid.values())
            if sweep.trial_config.num_trials > size:
                raise SettingsError([f"trialConfig.numTrials {sweep.trial_config.num_trials} is more than the "
                                     f"{size} points of the searchSpace grid"], title="invalid sweep spec")
        self.study = optuna.create_study(study_name=sweep.name, storage=storage, direction="minimize",
                                         sampler=self._sampler(0), pruner=self._pruner(), load_if_exists=True)

    def _sampler(self, number: int) -> optuna.samplers.BaseSampler:
        a, seed = self.sweep.algorithm, trial_seed(self.sweep.algorithm.seed, number)
        if a.name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if a.name == "grid":
            # Optuna shuffles the grid once with its seed and gives trial N the N-th point: the sweep's own seed,
            # the same for every trial, so that no point is visited twice.
            return _AskTellGrid(self.grid, seed=a.seed)
        startup = min(10, max(1, self.sweep.trial_config.num_trials // 3))
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)

    def _pruner(self) -> optuna.pruners.BasePruner:
        e = self.sweep.early
        if e.name == "asha":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=e.min_tokens, reduction_factor=e.reduction_factor,
                                                          min_early_stopping_rate=0)
        if e.name == "median":
            startup = min(5, max(1, self.sweep.trial_config.num_trials // 2))
            return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=e.min_tokens)
        return optuna.pruners.NopPruner()

    # ------------------------------------------------------------------------------------------- trials
    def frozen(self, number: int) -> optuna.trial.FrozenTrial:
        return self.study.trials[number]

    def handle(self, number: int) -> optuna.trial.Trial:
        """The ask-and-tell handle of an existing trial (after a restart as well)."""
        return optuna.trial.Trial(self.study, self.frozen(number)._trial_id)

    def count(self) -> int:
        return len(self.study.trials)

    def suggest(self, number: int) -> dict[str, Any]:
        """Ask for trial `number` (the next one); its parameters."""
        if self.count() != number:
            raise RuntimeError(f"the study has {self.count()} trials; cannot ask for trial {number}")
        self.study.sampler = self._sampler(number)
        trial = self.study.ask(self.space)
        return {k: trial.params[k] for k in self.space}

    def complete(self, number: int) -> dict[str, Any]:
        """The parameters of a trial Optuna created before the controller was killed: any it had not sampled yet
        are sampled now, in the order ask() samples them, with the sampler seeded as for that trial."""
        frozen = self.frozen(number)
        missing = [k for k in self.space if k not in frozen.params]
        if missing:
            log.warning("trial %d was created in Optuna's journal without %s (the controller was killed while "
                        "asking): sampling them now", number, ", ".join(missing))
            self.study.sampler = self._sampler(number)
            self.study.sampler.before_trial(self.study, frozen)  # grid: its point, unless it was given one
            trial = self.handle(number)
            for key in missing:
                d = self.space[key]
                if isinstance(d, CategoricalDistribution):
                    trial.suggest_categorical(key, d.choices)
                elif isinstance(d, IntDistribution):
                    trial.suggest_int(key, d.low, d.high, step=d.step, log=d.log)
                else:
                    trial.suggest_float(key, d.low, d.high, step=d.step, log=d.log)
        return {k: self.frozen(number).params[k] for k in self.space}

    def report(self, number: int, tokens: int, value: float) -> None:
        """Record a validation loss at `tokens` (once: a step already reported is left alone)."""
        if tokens not in self.frozen(number).intermediate_values:
            self.handle(number).report(value, tokens)

    # ------------------------------------------------------------------------------------------- decisions
    def at_rung(self, number: int, tokens: int) -> str:
        """ASHA at rung `tokens`: "promote" (train on) or "pause"; Optuna's SuccessiveHalvingPruner decides."""
        key = f"completed_rung_{self.sweep.rungs().index(tokens)}"
        frozen = self.frozen(number)
        if key not in frozen.system_attrs:
            return "pause" if self.handle(number).should_prune() else "promote"
        # Recorded by Optuna but not in the journal: the controller was killed between the two. It journals each
        # verdict before asking about another trial, so every other trial at this rung arrived before this one.
        value = frozen.system_attrs[key]
        others = [t.system_attrs[key] for t in self.study.trials if t.number != number and key in t.system_attrs]
        return "promote" if _promotable_on_arrival(value, [*others, value], self.sweep.early.reduction_factor) \
            else "pause"

    def promotable(self, number: int, tokens: int, rung_values: list[float]) -> bool:
        """ASHA's promotion of a paused trial: its value at rung `tokens` is among the best
        floor(n / reductionFactor) of the n values reported there."""
        value = self.frozen(number).intermediate_values.get(tokens)
        top = len(rung_values) // self.sweep.early.reduction_factor
        return value is not None and math.isfinite(value) and top >= 1 and value <= sorted(rung_values)[top - 1]

    def median_stop(self, number: int) -> bool:
        """MedianPruner's verdict on the trial's last report."""
        return self.sweep.early.name == "median" and self.handle(number).should_prune()

    def _tell(self, number: int, **kwargs: Any) -> None:
        if self.frozen(number).state == TrialState.RUNNING:
            self.study.tell(self.frozen(number).number, **kwargs)

    def finish(self, number: int, value: float) -> None:
        self._tell(number, values=value)

    def prune(self, number: int) -> None:
        self._tell(number, state=TrialState.PRUNED)

    def fail(self, number: int) -> None:
        self._tell(number, state=TrialState.FAIL)


class _AskTellGrid(optuna.samplers.GridSampler):
    """GridSampler for ask-and-tell: its after_trial calls Study.stop() once the grid is used up, which Optuna
    allows only inside Study.optimize; here the controller itself stops after trialConfig.numTrials."""

    def after_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, state: TrialState,
                    values: Any) -> None:
        return None


def _promotable_on_arrival(value: float, competing: list[float], reduction_factor: int) -> bool:
    """Optuna 5.0's rule for a trial arriving at a rung (optuna/pruners/_successive_halving.py,
    _is_trial_promotable_to_next_rung, minimising): the best len // eta go on; the best one while fewer than eta
    have arrived."""
    if math.isnan(value):
        return False
    idx = max(len(competing) // reduction_factor - 1, 0)
    return value <= sorted(competing)[idx]
