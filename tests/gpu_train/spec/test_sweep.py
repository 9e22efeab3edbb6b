"""The sweep spec: the example loads with the rungs worked out by hand, and every mistake is named with the file and
the field it is in.

Run: .venv/bin/pytest tests/gpu_train/spec/test_sweep.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpu_train.spec.errors import SettingsError
from gpu_train.spec.sweep import bound_trials, load_sweep, parse_sweep, trial_job

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "sweep-tiny.yaml"


def raw() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def problems(change, base: Path = Path(".")) -> list[str]:
    doc = raw()
    change(doc)
    with pytest.raises(SettingsError) as exc:
        parse_sweep(doc, "s.yaml", base=base)
    return exc.value.problems


def test_the_example_sweep_and_its_rungs():
    sweep = load_sweep(EXAMPLE)
    # minTokens 20,480 x 2^k below maxTokensPerTrial 163,840: 20,480, 40,960, 81,920.
    assert sweep.rungs() == [20480, 40960, 81920]
    assert sweep.max_tokens == 163840 and sweep.batch_tokens == 4096
    assert sweep.parameters() == ["model.norm", "train.lr"]


def test_a_trial_is_the_template_with_its_settings_and_the_sweep_priority():
    sweep = load_sweep(EXAMPLE)
    job = trial_job(sweep, "sweep-tiny-t004", {"train.lr": 0.001, "model.norm": "rmsnorm"},
                    {"train.budget_uri": "file:///b/budget.json"})
    assert job.name == "sweep-tiny-t004"
    assert job.priority_class == "sweep"
    assert job.steps == 163840 // 4096 == 40
    assert job.overrides["train.lr"] == 0.001 and job.overrides["model.norm"] == "rmsnorm"
    assert job.overrides["train.budget_uri"] == "file:///b/budget.json"
    assert job.overrides["eval.batches"] == 4  # the template's own overrides stay
    # no eval.every_steps in the template: evaluated at the end (and at each rung, where it holds)
    assert job.overrides["eval.every_steps"] == 40


def test_bound_trials_reach_every_bound_and_choice():
    sweep = load_sweep(EXAMPLE)
    trials = bound_trials(sweep)
    assert {t["train.lr"] for t in trials} == {3.0e-4, 3.0e-2}
    assert {t["model.norm"] for t in trials} == {"layernorm", "rmsnorm"}


def test_the_template_may_be_a_file_beside_the_spec(tmp_path):
    doc = raw()
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"job": doc["trialTemplate"]}))
    doc["trialTemplate"] = "job.yaml"
    assert parse_sweep(doc, "s.yaml", base=tmp_path).template.preset == "tiny"


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d["searchSpace"]["train.lr"].update(min=1.0),
     "s.yaml: searchSpace.train.lr.min: must be finite and <= max (got 1.0 > 0.03)"),
    (lambda d: d["searchSpace"]["train.lr"].update(distribution="loguniform"),
     "s.yaml: searchSpace.train.lr.distribution must be one of"),
    (lambda d: d["searchSpace"]["train.lr"].update(min=0.0, distribution="logUniform"),
     "s.yaml: searchSpace.train.lr.min: logUniform needs min > 0"),
    (lambda d: d["searchSpace"]["model.norm"].update(min=1),
     "s.yaml: searchSpace.model.norm.min: not used by choice"),
    (lambda d: d["searchSpace"].update({"train.steps": {"distribution": "choice", "values": [1]}}),
     "s.yaml: searchSpace.train.steps is set for every trial by the sweep itself"),
    (lambda d: d["searchSpace"].update({"lr": {"distribution": "choice", "values": [1]}}),
     "s.yaml: searchSpace.lr must be a dotted trainer key"),
    (lambda d: d["searchSpace"].update({"train.lrr": d["searchSpace"].pop("train.lr")}),
     "s.yaml: searchSpace.train.lrr is not a setting of the trainer (did you mean 'train.lr'?)"),
    (lambda d: d["searchSpace"]["model.norm"].update(values=["layernorm", "batchnorm"]),
     "s.yaml: searchSpace.model.norm: the trainer refuses 'batchnorm': model.norm: must be one of"),
    (lambda d: d["algorithm"]["earlyStopping"].update(minTokens=1000),
     "s.yaml: algorithm.earlyStopping.minTokens 1000 must be a positive multiple of the template's "
     "globalBatchTokens (4096)"),
    (lambda d: d["algorithm"]["earlyStopping"].update(minTokens=163840),
     "s.yaml: algorithm.earlyStopping.minTokens 163840 must be below maxTokensPerTrial (163840)"),
    (lambda d: d["algorithm"].update(name="bayes"), "s.yaml: algorithm.name must be one of"),
    (lambda d: d["trialConfig"].update(numTrials=0), "s.yaml: trialConfig.numTrials must be >= 1 (got 0)"),
    (lambda d: d["trialConfig"].update(parallel=3), "s.yaml: trialConfig.parallel is not a known setting (did you "
                                                    "mean 'parallelTrials'?)"),
    (lambda d: d["trialConfig"].update(maxTokensPerTrial=5000),
     "s.yaml: trialConfig.maxTokensPerTrial 5000 must be a multiple of the template's globalBatchTokens (4096)"),
    (lambda d: d["trialConfig"].update(parallelTrials=9), "s.yaml: trialConfig.parallelTrials 9 is more than "
                                                          "numTrials 8"),
    (lambda d: d["trialTemplate"].update(steps="x"), "s.yaml: trialTemplate.steps must be a whole number"),
    (lambda d: d["trialTemplate"].update(command=["python", "train.py"]),
     "s.yaml: trialTemplate.preset is a setting of the bundled trainer, and trialTemplate.command runs your own"),
    (lambda d: d.update(name="Sweep_1"), "s.yaml: name 'Sweep_1' must be a lowercase DNS label"),
    (lambda d: d.update(objectives=[{"metric": "accuracy"}]), "s.yaml: objectives[0].metric must be"),
])
def test_each_mistake_names_its_field(change, expected):
    found = problems(change)
    assert any(p.startswith(expected) for p in found), found


def test_a_missing_template_file_is_named(tmp_path):
    assert problems(lambda d: d.update(trialTemplate="nope.yaml"), base=tmp_path) == [
        f"s.yaml: trialTemplate: {tmp_path / 'nope.yaml'}: no such job spec file"]


def test_grid_search_needs_a_spacing_for_a_float():
    found = problems(lambda d: d["algorithm"].update(name="grid"))
    assert found == ["s.yaml: searchSpace.train.lr: grid search needs step or points for a logUniform float"]


def test_median_needs_evaluations_along_the_way():
    found = problems(lambda d: d["algorithm"]["earlyStopping"].update(name="median"))
    assert found == ["s.yaml: algorithm.earlyStopping median compares validation losses along the way: set "
                     "trialTemplate.overrides.eval.every_steps"]


def test_a_minimal_spec_takes_the_defaults():
    doc = raw()
    for key in ("objectives", "algorithm"):
        del doc[key]
    doc["trialConfig"] = {"numTrials": 3}
    sweep = parse_sweep(doc, "s.yaml")
    assert (sweep.algorithm.name, sweep.early.name, sweep.trial_config.parallel_trials) == ("tpe", "none", 1)
    assert sweep.rungs() == [] and sweep.max_tokens == 40 * 4096
    assert (sweep.objectives[0].metric, sweep.objectives[0].direction) == ("val_loss", "minimize")


OWN = Path(__file__).resolve().parents[3] / "examples" / "plain-loop" / "sweep.yaml"


def own(change=None):
    doc = yaml.safe_load(OWN.read_text())
    if change:
        change(doc)
    return doc


def test_a_trial_of_a_teams_own_loop_gets_its_parameters_and_budget_in_its_command():
    sweep = parse_sweep(own(), "s.yaml")
    assert (sweep.batch_tokens, sweep.max_tokens, sweep.rungs()) == (256, 6144, [1536, 3072])
    job = trial_job(sweep, "plain-sweep-t004", {"lr": 0.0042, "width": 64},
                    {"train.budget_uri": "file:///runs/plain-sweep/t4/budget.json", "tracking.experiment": "x"})
    assert job.command == ["python", "train.py", "--steps", "24", "--lr", "0.0042", "--width", "64", "--val-batches",
                           "2", "--checkpoint-every", "1000", "--budget-uri", "file:///runs/plain-sweep/t4/budget.json"]
    assert (job.name, job.priority_class, job.overrides) == ("plain-sweep-t004", "sweep", {})
    assert "steps" not in job.model_fields_set  # the bundled trainer's settings stay unset


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d["trialConfig"].pop("tokensPerStep"), "s.yaml: trialConfig.tokensPerStep must be set for a template "
                                                       "with its own command"),
    (lambda d: d["trialConfig"].pop("maxTokensPerTrial"), "s.yaml: trialConfig.maxTokensPerTrial must be set"),
    (lambda d: d["trialTemplate"]["command"].extend(["--seed", "${trialParameters.seed}"]),
     "s.yaml: trialTemplate.command names ${trialParameters.seed}: a command may name"),
    (lambda d: d["trialTemplate"]["command"].append("${trial.budget}"),
     "s.yaml: trialTemplate.command names ${trial.budget}: a command may name"),
    (lambda d: d["searchSpace"].update(dropout={"distribution": "uniform", "min": 0.0, "max": 0.2}),
     "s.yaml: searchSpace.dropout is not in trialTemplate.command: pass it as ${trialParameters.dropout}"),
    (lambda d: d["trialTemplate"]["command"].remove("${trial.budgetUri}"),
     "s.yaml: trialTemplate.command must pass ${trial.budgetUri} to the loop"),
    (lambda d: d["trialConfig"].update(maxTokensPerTrial=6000),
     "s.yaml: trialConfig.maxTokensPerTrial 6000 must be a multiple of the template's step "
     "(trialConfig.tokensPerStep) (256)"),
])
def test_each_mistake_of_an_own_loops_sweep_names_its_field(change, expected):
    with pytest.raises(SettingsError) as exc:
        parse_sweep(own(change), "s.yaml")
    assert any(p.startswith(expected) for p in exc.value.problems), exc.value.problems
