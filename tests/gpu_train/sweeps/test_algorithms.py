"""The sweep's decisions through Optuna's ask-and-tell interface: search-space mapping, grid values, ASHA's verdict
at a rung (Optuna's SuccessiveHalvingPruner) and the promotion of a paused trial, with expectations worked out by
hand from ASHA's rule (the best floor(n / eta) of the n values at a rung go on).

Run: .venv/bin/pytest tests/gpu_train/sweeps/test_algorithms.py -q
"""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from gpu_train.spec.errors import SettingsError
from gpu_train.spec.sweep import Parameter, parse_sweep
from gpu_train.sweeps.algorithms import Policy, distribution, grid_values
from tests.gpu_train.spec.test_sweep import raw


def sweep(**algorithm):
    doc = raw()
    doc["algorithm"].update(algorithm)
    return parse_sweep(doc, "s.yaml")


def test_each_parameter_becomes_its_optuna_distribution():
    assert distribution(Parameter(distribution="logUniform", min=1e-4, max=1e-2)) == \
        FloatDistribution(1e-4, 1e-2, log=True)
    assert distribution(Parameter(distribution="uniform", type="int", min=2, max=8, step=2)) == \
        IntDistribution(2, 8, step=2)
    assert distribution(Parameter(distribution="choice", values=["a", "b"])) == CategoricalDistribution(["a", "b"])


def test_grid_values():
    assert grid_values(Parameter(distribution="logUniform", min=1e-4, max=1e-2, points=3)) == \
        pytest.approx([1e-4, 1e-3, 1e-2])
    assert grid_values(Parameter(distribution="uniform", min=0.0, max=0.3, step=0.1)) == pytest.approx([0, .1, .2, .3])
    assert grid_values(Parameter(distribution="uniform", type="int", min=1, max=4)) == [1, 2, 3, 4]


def test_grid_search_cannot_have_more_trials_than_points():
    doc = raw()
    doc["algorithm"]["name"] = "grid"
    doc["searchSpace"]["train.lr"]["points"] = 3  # 3 x 2 norms = 6 points < 8 trials
    with pytest.raises(SettingsError, match="trialConfig.numTrials 8 is more than the 6 points"):
        Policy(parse_sweep(doc, "s.yaml"), optuna.storages.InMemoryStorage())


def test_suggestions_depend_only_on_the_seed_and_the_study():
    a = Policy(sweep(name="random", seed=3), optuna.storages.InMemoryStorage())
    b = Policy(sweep(name="random", seed=3), optuna.storages.InMemoryStorage())
    c = Policy(sweep(name="random", seed=4), optuna.storages.InMemoryStorage())
    first = [a.suggest(n) for n in range(4)]
    assert first == [b.suggest(n) for n in range(4)]
    assert first != [c.suggest(n) for n in range(4)]
    for params in first:
        assert 3e-4 <= params["train.lr"] <= 3e-2 and params["model.norm"] in ("layernorm", "rmsnorm")


def test_asha_at_a_rung_and_the_promotion_of_a_paused_trial():
    policy = Policy(sweep(name="random"), optuna.storages.InMemoryStorage())  # reductionFactor 2, rung 20,480
    for n in range(4):
        policy.suggest(n)
    verdicts = []
    for n, loss in enumerate([5.0, 6.0, 4.0, 4.5]):
        policy.report(n, 20480, loss)
        verdicts.append(policy.at_rung(n, 20480))
    # Arrivals at the rung: [5.0] -> the only one goes on; [5, 6]: the best 2 // 2 = 1 is 5.0, so 6.0 pauses;
    # [5, 6, 4]: the best 1 is 4.0 -> on; [5, 6, 4, 4.5]: the best 2 are 4.0 and 4.5 -> on.
    assert verdicts == ["promote", "pause", "promote", "promote"]
    values = [5.0, 6.0, 4.0, 4.5]
    assert not policy.promotable(1, 20480, values)  # 6.0 is not among the best 2 of 4
    assert policy.promotable(0, 20480, [*values, 7.0, 8.0])  # 5.0 is the 3rd of 6, and 6 // 2 = 3


def test_a_verdict_asked_again_after_a_kill_is_the_same():
    """Optuna records a rung when it is asked; a controller killed before journaling the verdict asks again and
    gets the verdict Optuna gave, without the pruner counting the trial twice."""
    policy = Policy(sweep(name="random"), optuna.storages.InMemoryStorage())
    for n, loss in enumerate([5.0, 6.0]):
        policy.suggest(n)
        policy.report(n, 20480, loss)
    assert [policy.at_rung(0, 20480), policy.at_rung(1, 20480)] == ["promote", "pause"]
    assert [policy.at_rung(0, 20480), policy.at_rung(1, 20480)] == ["promote", "pause"]


def test_grid_search_visits_every_point_once():
    doc = raw()
    doc["algorithm"]["name"] = "grid"
    doc["searchSpace"]["train.lr"] = {"distribution": "choice", "values": [0.03, 0.01, 0.003, 0.001]}
    doc["trialConfig"].update(numTrials=8, parallelTrials=2)  # 4 rates x 2 norms = 8 points
    policy = Policy(parse_sweep(doc, "s.yaml"), optuna.storages.InMemoryStorage())
    points = {tuple(sorted(policy.suggest(n).items())) for n in range(8)}
    assert len(points) == 8
    for n in range(7):
        policy.finish(n, 1.0 + n)
    policy.prune(7)  # the last point told: the grid is used up, and the sweep, not Optuna, ends it
    assert [t.state.name for t in policy.study.trials] == ["COMPLETE"] * 7 + ["PRUNED"]
