"""The sweep spec: a job spec template, a search space over its trainer settings, an objective, an algorithm with
an early-stopping rule, and a budget. Field names follow Kubeflow's OptimizationJob (KEP-46 of the Kubeflow SDK:
`searchSpace`, `objectives`, `algorithm`, `trialConfig` with `numTrials` and `parallelTrials`, `trialTemplate`),
so a later move to it is a rename.

Usage:
    sweep = load_sweep("examples/sweep-tiny.yaml")     # SweepSpec; SettingsError naming the file and field
    sweep.template                                     # the trial template: the one JobSpec (gpu_train.spec.job)
    sweep.rungs()                                      # ASHA's rungs in tokens, below trialConfig.maxTokensPerTrial
    trial_job(sweep, "t003", {"train.lr": 3e-3}, {...})  # one trial's JobSpec

The template is a job spec read exactly as `gpu-train submit` reads one (a mapping of the job settings, possibly
under `job:`), inline or a file path relative to the sweep spec. A trial is that job with its sampled settings
added to `overrides`, its name `<sweep>-<trial>`, `steps` = maxTokensPerTrial / globalBatchTokens (so every trial's
learning-rate schedule runs over its whole budget, never over a rung) and the sweep's priority class. A template
with its own command (a team's loop on the trainer library's TrialBudget) gets its parameters and budget object as
${trialParameters.<name>} and ${trial.budgetUri} in that command, and counts its steps in trialConfig.tokensPerStep.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from gpu_train.spec import yamlfile
from gpu_train.spec.errors import SettingsError, validation_problems
from gpu_train.spec.job import MANAGED_OVERRIDES, JobSpec, command_problems, read_job, read_job_file

SWEEP_PRIORITY = "sweep"
NAME = re.compile(r"^[a-z]([-a-z0-9]{0,22}[a-z0-9])?$")  # leaves room for "-t000" in a 32-character job name


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


class Parameter(_Model):
    """One dimension of the search space: a trainer setting and where its values come from."""

    distribution: Literal["uniform", "logUniform", "choice"] = Field(
        description="uniform or logUniform between min and max, or choice among values")
    type: Literal["float", "int"] = Field("float", description="uniform and logUniform: float or int values")
    min: float | None = Field(None, description="lower bound (inclusive)")
    max: float | None = Field(None, description="upper bound (inclusive)")
    step: float | None = Field(None, gt=0, description="uniform: spacing of the values (grid search needs it or "
                                                       "points)")
    points: int | None = Field(None, ge=2, description="grid search: how many values between min and max "
                                                       "(log-spaced for logUniform)")
    values: list[str | int | float | bool] | None = Field(None, description="choice: the values")

    @model_validator(mode="after")
    def _shape(self) -> Parameter:
        problems = []
        if self.distribution == "choice":
            if not self.values:
                problems.append("values: choice needs at least one value")
            problems += [f"{name}: not used by choice (give values)"
                         for name in ("min", "max", "step", "points") if getattr(self, name) is not None]
        else:
            if self.values is not None:
                problems.append(f"values: {self.distribution} takes min and max, not values")
            if self.min is None or self.max is None:
                problems.append(f"min: {self.distribution} needs min and max")
            elif not (math.isfinite(self.min) and math.isfinite(self.max)) or self.min > self.max:
                problems.append(f"min: must be finite and <= max (got {self.min} > {self.max})")
            elif self.distribution == "logUniform" and self.min <= 0:
                problems.append(f"min: logUniform needs min > 0 (got {self.min})")
            if self.type == "int" and self.min is not None and self.max is not None and (
                    self.min != int(self.min) or self.max != int(self.max)):
                problems.append("min: int parameters need whole-number bounds")
            if self.step is not None and self.distribution == "logUniform":
                problems.append("step: only for uniform")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class Objective(_Model):
    metric: Literal["val_loss"] = Field("val_loss", description="what the trainer reports: the validation loss")
    direction: Literal["minimize"] = Field("minimize", description="the validation loss is minimised")


class EarlyStopping(_Model):
    name: Literal["none", "median", "asha"] = Field("none", description="none, median (stop below the median) or "
                                                                        "asha (successive halving: pause, promote)")
    min_tokens: int = Field(0, ge=0, description="asha: the first rung in tokens; median: tokens before any stop")
    reduction_factor: int = Field(3, ge=2, description="asha: a rung keeps the best 1/reductionFactor")


class Algorithm(_Model):
    name: Literal["random", "grid", "tpe"] = Field("tpe", description="the sampler: random, grid or tpe")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="the sampler's seed (replays reproduce every decision)")
    early_stopping: EarlyStopping = Field(default_factory=EarlyStopping)


class TrialConfig(_Model):
    num_trials: int = Field(ge=1, le=10000, description="trials in all")
    parallel_trials: int = Field(1, ge=1, le=1000, description="trials asked for at once (Kueue still decides "
                                                              "admission within the team's quota)")
    max_failed_trials: int = Field(0, ge=0, description="failed trials tolerated before the sweep stops")
    max_tokens_per_trial: int = Field(0, ge=0, description="tokens each trial trains to (0: the template's steps x "
                                                           "globalBatchTokens); a multiple of globalBatchTokens")
    tokens_per_step: int = Field(0, ge=0, description="a template with its own command: the tokens one step of its "
                                                      "loop trains on, over all ranks (the bundled trainer's is "
                                                      "globalBatchTokens)")


class SweepSpec(_Model):
    name: str = Field(description="DNS label of at most 24 characters: trial jobs are <name>-t<NNN>")
    trial_template: JobSpec = Field(description="the job spec each trial is (a file path or inline settings)")
    search_space: dict[str, Parameter] = Field(description="trainer setting -> its distribution")
    objectives: list[Objective] = Field(default_factory=lambda: [Objective()])
    algorithm: Algorithm = Field(default_factory=Algorithm)
    trial_config: TrialConfig

    @property
    def template(self) -> JobSpec:
        return self.trial_template

    @property
    def batch_tokens(self) -> int:
        """The tokens of one step: a rung is a step boundary."""
        if self.trial_template.bundled:
            return self.trial_template.global_batch_tokens
        return self.trial_config.tokens_per_step

    @property
    def max_tokens(self) -> int:
        if not self.trial_template.bundled:
            return self.trial_config.max_tokens_per_trial
        return self.trial_config.max_tokens_per_trial or self.trial_template.steps * self.batch_tokens

    @property
    def early(self) -> EarlyStopping:
        return self.algorithm.early_stopping

    def rungs(self) -> list[int]:
        """ASHA's rungs in tokens: minTokens x reductionFactor^k below maxTokensPerTrial (none without asha)."""
        e = self.early
        if e.name != "asha":
            return []
        out, tokens = [], e.min_tokens
        while tokens < self.max_tokens:
            out.append(tokens)
            tokens *= e.reduction_factor
        return out

    def parameters(self) -> list[str]:
        return sorted(self.search_space)


def _problems(s: SweepSpec) -> list[str]:
    """What the types alone do not say: names, keys, the budget against the batch, the rungs, the grid."""
    p = []
    if not NAME.match(s.name):
        p.append(f"name {s.name!r} must be a lowercase DNS label of at most 24 characters")
    own = not s.template.bundled
    if not s.search_space:
        p.append("searchSpace must name at least one " + ("parameter" if own else "trainer setting"))
    if own:
        p += _command_problems(s)
    for key in [] if own else s.search_space:
        if not re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", key):
            p.append(f"searchSpace.{key} must be a dotted trainer key like 'train.lr'")
        elif key in MANAGED_OVERRIDES or key in ("train.budget_uri", "tracking.parent_run_id"):
            p.append(f"searchSpace.{key} is set for every trial by the sweep itself and cannot be searched")
        else:
            p += _trainer_key_problems(s, key)
    if not own and s.trial_config.tokens_per_step:
        p.append("trialConfig.tokensPerStep is for a template with its own command; the bundled trainer's step is "
                 "trialTemplate.globalBatchTokens")
    if len(s.objectives) != 1:
        p.append(f"objectives must hold exactly one objective (got {len(s.objectives)})")
    b, tc = s.batch_tokens, s.trial_config
    step = "globalBatchTokens" if not own else "step (trialConfig.tokensPerStep)"
    if b and tc.max_tokens_per_trial and tc.max_tokens_per_trial % b:
        p.append(f"trialConfig.maxTokensPerTrial {tc.max_tokens_per_trial} must be a multiple of the template's "
                 f"{step} ({b})")
    e = s.early
    if e.name == "asha" and b and s.max_tokens:
        if e.min_tokens < b or e.min_tokens % b:
            p.append(f"algorithm.earlyStopping.minTokens {e.min_tokens} must be a positive multiple of the template's "
                     f"{step} ({b}): a rung is a step boundary")
        elif e.min_tokens >= s.max_tokens:
            p.append(f"algorithm.earlyStopping.minTokens {e.min_tokens} must be below maxTokensPerTrial "
                     f"({s.max_tokens}): no rung would stop anything")
    if e.name == "median" and not own and not s.template.overrides.get("eval.every_steps"):
        p.append("algorithm.earlyStopping median compares validation losses along the way: set "
                 "trialTemplate.overrides.eval.every_steps")
    if s.algorithm.name == "grid":
        for key, par in s.search_space.items():
            if par.distribution != "choice" and par.step is None and par.points is None and par.type != "int":
                p.append(f"searchSpace.{key}: grid search needs step or points for a {par.distribution} float")
    if tc.parallel_trials > tc.num_trials:
        p.append(f"trialConfig.parallelTrials {tc.parallel_trials} is more than numTrials {tc.num_trials}")
    return p


def _trainer_key_problems(s: SweepSpec, key: str) -> list[str]:
    """A searched key of the bundled trainer: one of its settings (its own schema, gpu_train.spec.trainer_config),
    and each of the space's bounds and choices a value it takes, on the template's preset."""
    from gpu_train.spec.job import override_text
    from gpu_train.spec.trainer_config import ConfigError, build_config, reference

    known = [name for name, _, _ in reference()]
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        return [f"searchSpace.{key} is not a setting of the trainer" +
                (f" (did you mean {close[0]!r}?)" if close else f" (settings: {', '.join(known)})")]
    for value in dict.fromkeys(trial[key] for trial in bound_trials(s)):
        try:
            build_config(s.template.preset, overrides=[override_text(key, value)])
        except ConfigError as exc:
            if str(exc).startswith(key):  # the template's own problems are named under trialTemplate
                return [f"searchSpace.{key}: the trainer refuses {value!r}: {exc}"]
    return []


PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")
# What a trial's own command may name besides its parameters (${trialParameters.<name>}): its budget object (which
# the trainer library's TrialBudget holds at), its job name, and its MLflow parent run and tracking URI.
TRIAL_FIELDS = {"trial.budgetUri": "train.budget_uri", "trial.name": "", "trial.parentRunId": "tracking.parent_run_id",
                "trial.trackingUri": "tracking.uri"}


def _command_problems(s: SweepSpec) -> list[str]:
    """A template with its own command: its step in tokens, its whole budget, and the placeholders that hand a
    trial its parameters and its budget (Katib's ${trialParameters.<name>} form)."""
    p, tc = command_problems(s.template, "trialTemplate"), s.trial_config
    if not tc.tokens_per_step:
        p.append("trialConfig.tokensPerStep must be set for a template with its own command: the tokens one step of "
                 "its loop trains on, over all ranks (a rung is a step boundary)")
    if not tc.max_tokens_per_trial:
        p.append("trialConfig.maxTokensPerTrial must be set for a template with its own command (its loop's steps "
                 "times tokensPerStep)")
    named = {m for arg in s.template.command or [] for m in PLACEHOLDER.findall(arg)}
    for name in sorted(named):
        key = name.removeprefix("trialParameters.")
        if name not in TRIAL_FIELDS and (key == name or key not in s.search_space):
            p.append(f"trialTemplate.command names ${{{name}}}: a command may name ${{trialParameters.<a searchSpace "
                     f"key>}} and {', '.join('${' + f + '}' for f in TRIAL_FIELDS)}")
    for key in s.search_space:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            p.append(f"searchSpace.{key} must be a name (letters, digits, _) that the command takes as "
                     f"${{trialParameters.{key}}}")
        elif f"trialParameters.{key}" not in named:
            p.append(f"searchSpace.{key} is not in trialTemplate.command: pass it as ${{trialParameters.{key}}}")
    if "trial.budgetUri" not in named:
        p.append("trialTemplate.command must pass ${trial.budgetUri} to the loop, whose TrialBudget holds there at each "
                 "rung and reports its validation losses (docs/sweeps.md)")
    return p


def load_sweep(path: str | Path) -> SweepSpec:
    """The sweep spec in `path`, every problem named with the file and the field."""
    path = Path(path)
    try:
        raw = yamlfile.load(path.read_text())
    except OSError as exc:
        raise SettingsError([f"{path}: {exc.strerror}"], title="invalid sweep spec") from None
    except yaml.YAMLError as exc:
        raise SettingsError([f"{path}: not valid YAML: {str(exc).splitlines()[0]}"], title="invalid sweep spec") \
            from None
    return parse_sweep(raw, str(path), base=path.parent)


def parse_sweep(raw: Any, source: str, base: Path = Path(".")) -> SweepSpec:
    if not isinstance(raw, dict):
        raise SettingsError([f"{source}: a sweep spec is a mapping (name, trialTemplate, searchSpace, ...)"],
                            title="invalid sweep spec")
    raw = dict(raw)
    template = raw.get("trialTemplate")
    if isinstance(template, str):
        template_path = (base / template) if not Path(template).is_absolute() else Path(template)
        try:
            raw["trialTemplate"] = read_job_file(template_path)
        except SettingsError as exc:
            raise SettingsError([f"{source}: trialTemplate: {p}" for p in exc.problems],
                                title="invalid sweep spec") from None
    if isinstance(raw.get("trialTemplate"), dict):
        try:
            # What the spec sets, as the job reader typed it (a template with its own command must set none of the
            # bundled trainer's settings: their defaults stay unset).
            raw["trialTemplate"] = read_job(raw["trialTemplate"], key="trialTemplate").model_dump(
                by_alias=True, mode="json", exclude_unset=True)
        except SettingsError as exc:
            raise SettingsError([f"{source}: {p}" for p in exc.problems], title="invalid sweep spec") from None
    try:
        sweep = SweepSpec.model_validate_json(json.dumps(raw))
    except ValidationError as exc:
        problems = validation_problems(exc, prefix="", root=SweepSpec, raw=raw)
        raise SettingsError([f"{source}: {p.lstrip('.')}" for p in problems], title="invalid sweep spec") from None
    problems = _problems(sweep)
    if problems:
        raise SettingsError([f"{source}: {p}" for p in problems], title="invalid sweep spec")
    return sweep


def trial_name(sweep: SweepSpec, number: int) -> str:
    return f"{sweep.name}-t{number:03d}"


def trial_job(sweep: SweepSpec, name: str, params: dict[str, Any], extra: dict[str, Any]) -> JobSpec:
    """A trial's JobSpec: the template with the sampled settings and the sweep's own (`extra`: budget, parent run).
    Without eval.every_steps in the template the trial is evaluated where the sweep needs it only: at each rung
    (the hold evaluates) and at its last step. A template with its own command gets them in its command instead:
    its ${trialParameters.<name>} and ${trial.<field>} placeholders replaced (TRIAL_FIELDS)."""
    t = sweep.template
    if not t.bundled:
        values = {f"trialParameters.{k}": str(v) for k, v in params.items()}
        values.update({f: (name if key == "" else str(extra.get(key, ""))) for f, key in TRIAL_FIELDS.items()})
        command = [PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in t.command or []]
        return t.model_copy(update={"name": name, "priority_class": SWEEP_PRIORITY, "command": command})
    steps = sweep.max_tokens // sweep.batch_tokens
    evals = {} if "eval.every_steps" in t.overrides else {"eval.every_steps": steps}
    return t.model_copy(update={
        "name": name, "steps": steps, "priority_class": SWEEP_PRIORITY,
        "overrides": {**t.overrides, **evals, **params, **extra}})


def bound_trials(sweep: SweepSpec) -> list[dict[str, Any]]:
    """Parameter sets that reach every bound and every choice of the search space (the others at their lower
    bound or first choice): what the submit-time checks run on."""
    def low(p: Parameter) -> Any:
        return (p.values or [None])[0] if p.distribution == "choice" else _typed(p, p.min)

    base = {k: low(p) for k, p in sweep.search_space.items()}
    out = [base]
    for k, p in sweep.search_space.items():
        others = p.values[1:] if p.distribution == "choice" and p.values else [_typed(p, p.max)]
        out.extend({**base, k: v} for v in others)
    return out


def _typed(p: Parameter, v: float | None) -> Any:
    return int(v) if p.type == "int" and v is not None else v
