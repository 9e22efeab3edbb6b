"""The sweep controller on a simulated trainer: trials whose status.json follows a known loss curve, held at the
budget they are given exactly as trainer/budget.py holds. What is checked: ASHA pauses and promotes, the best trial
is the one the curve says, a controller killed mid-sweep (at any pass, or between Optuna's ask and the journal)
continues with no trial lost or run twice and takes the decisions an unbroken run takes, and a replay of the
journal takes every decision again.

Integration lane: each sweep here is a second or two, most of it the journals' fsync calls.

Run: .venv/bin/pytest tests/gpu_train/sweeps/test_controller.py -q
"""

from __future__ import annotations

import io
import math
from collections import Counter

import pytest

from gpu_train.spec.sweep import parse_sweep
from gpu_train.sweeps.controller import Controller
from gpu_train.sweeps.journal import read_journal
from gpu_train.sweeps.replay import replay
from tests.gpu_train.spec.test_sweep import raw

pytestmark = pytest.mark.integration
DECISIONS = ("suggest", "promote", "pause", "prune", "finish", "done")


def sweep_spec(num_trials: int = 8, parallel: int = 2, algorithm: str = "random"):
    doc = raw()
    doc["algorithm"]["name"] = algorithm
    if algorithm == "grid":  # 4 x 2 points
        doc["searchSpace"]["train.lr"] = {"distribution": "choice", "values": [0.03, 0.01, 0.003, 0.001]}
    doc["trialConfig"].update(numTrials=num_trials, parallelTrials=parallel)
    return parse_sweep(doc, "s.yaml")


def loss(params, tokens: int) -> float:
    """A learning curve: the further lr is from 3e-3 (in decades), the higher; every curve falls with tokens."""
    return abs(math.log10(params["train.lr"] / 3e-3)) + (0.2 if params["model.norm"] == "layernorm" else 0.0) \
        + 20480 / tokens


class SimBackend:
    """Trials that train instantly up to their budget (evaluating at the budget, as a hold does, and at the end)
    and keep their position across stops, as a checkpoint does."""

    poll_s = 0.0

    def __init__(self, sweep):
        self.sweep = sweep
        self.every = int(sweep.template.overrides.get("eval.every_steps") or 0) * sweep.batch_tokens
        self.budget, self.position, self.evals, self.params = {}, {}, {}, {}
        self.running: set[str] = set()
        self.launches: Counter = Counter()
        self.trained = 0

    def settings(self, t):
        return {"train.budget_uri": f"file:///sim/{t.id}/budget.json"}

    def write_budget(self, t, tokens):
        self.budget[t.id] = tokens

    def launch(self, t, job):
        assert t.id not in self.running, f"{t.id} launched while it runs"
        assert job.overrides["train.budget_uri"] == f"file:///sim/{t.id}/budget.json"
        self.running.add(t.id)
        self.launches[t.id] += 1
        self.params[t.id] = {k: job.overrides[k] for k in self.sweep.search_space}
        self.position.setdefault(t.id, 0)
        self.evals[t.id] = []  # status.json lists this launch's evaluations

    def pause(self, t):
        self.running.discard(t.id)

    stop = pause

    def read_status(self, t):
        if t.id not in self.running:
            return None
        pos, budget, batch = self.position[t.id], self.budget[t.id], self.sweep.batch_tokens
        while pos < budget:
            pos += batch
            self.trained += batch
            if pos == budget or pos == self.sweep.max_tokens or (self.every and pos % self.every == 0):
                self.evals[t.id].append({"tokens": pos, "val_loss": loss(self.params[t.id], pos)})
        self.position[t.id] = pos
        done = pos >= self.sweep.max_tokens
        return {"state": "completed" if done else "held", "tokens": pos, "evals": self.evals[t.id],
                "val_loss": loss(self.params[t.id], pos), "params_sha256": f"sha-{t.id}" if done else None}

    def ended(self, t):
        return None if t.id in self.running else "preempted"


def decisions(records):
    return [(r["event"], r.get("trial"), r.get("tokens")) for r in records if r["event"] in DECISIONS]


def run_through(tmp_path, sweep):
    backend = SimBackend(sweep)
    best = Controller(sweep, tmp_path / "a", backend, out=io.StringIO()).run()
    return best, backend, read_journal(tmp_path / "a" / "journal.jsonl")


def test_asha_pauses_promotes_and_picks_the_best(tmp_path):
    sweep = sweep_spec()
    best, backend, records = run_through(tmp_path, sweep)
    events = Counter(r["event"] for r in records)
    assert events["suggest"] == 8
    assert events["pause"] >= 1
    resumed = [r for r in records if r["event"] == "promote" and r.get("resume")]
    assert resumed, "no paused trial was promoted"
    for r in resumed:  # a resumed trial was paused at that rung first, and launched again after
        t = r["trial"]
        seqs = [x["seq"] for x in records if x.get("trial") == t and x["event"] == "pause" and x["tokens"] == r["tokens"]]
        assert seqs and seqs[0] < r["seq"]
        assert backend.launches[t] >= 2
    finished = {r["trial"]: r["value"] for r in records if r["event"] == "finish"}
    suggested = {r["trial"]: r["params"] for r in records if r["event"] == "suggest"}
    # the best is the finished trial with the lowest loss at the full budget, by the curve itself
    expected = min(finished, key=lambda t: loss(suggested[t], sweep.max_tokens))
    assert best.id == expected and best.value == pytest.approx(loss(suggested[expected], sweep.max_tokens))
    # every trial ends finished or pruned, and less is trained than running all eight to the end
    assert events["finish"] + events["prune"] == 8
    assert backend.trained < 8 * sweep.max_tokens


@pytest.mark.parametrize("kill_after", [2, 6])
def test_a_controller_killed_between_passes_continues_the_same_sweep(tmp_path, kill_after):
    sweep = sweep_spec()
    _, _, straight = run_through(tmp_path, sweep)
    backend = SimBackend(sweep)
    first = Controller(sweep, tmp_path / "b", backend, out=io.StringIO())
    first.resume_active()
    for _ in range(kill_after):
        assert first.step()
    # killed: its launchers died with it (PR_SET_PDEATHSIG), their checkpoints stay
    backend.running.clear()
    out = io.StringIO()
    second = Controller(sweep, tmp_path / "b", backend, out=out)
    second.run()
    assert "resuming from its journal" in out.getvalue()
    records = read_journal(tmp_path / "b" / "journal.jsonl")
    assert decisions(records) == decisions(straight)
    assert sorted(r["number"] for r in records if r["event"] == "suggest") == list(range(8))
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_a_controller_killed_after_optunas_ask_adopts_that_trial(tmp_path):
    sweep = sweep_spec()
    backend = SimBackend(sweep)
    first = Controller(sweep, tmp_path / "c", backend, out=io.StringIO())
    asked = first.policy.suggest(0)  # Optuna has the trial; the journal does not (killed in between)
    second = Controller(sweep, tmp_path / "c", SimBackend(sweep), out=io.StringIO())
    (suggest,) = [r for r in read_journal(tmp_path / "c" / "journal.jsonl") if r["event"] == "suggest"]
    assert suggest["params"] == asked and suggest["adopted"] is True
    second.run()
    numbers = [r["number"] for r in read_journal(tmp_path / "c" / "journal.jsonl") if r["event"] == "suggest"]
    assert numbers == list(range(8))


@pytest.mark.parametrize("algorithm", ["random", "tpe"])
def test_replaying_the_journal_takes_every_decision_again(tmp_path, algorithm):
    sweep = sweep_spec(algorithm=algorithm)
    _, _, records = run_through(tmp_path, sweep)
    checked, differences = replay(sweep, records)
    assert differences == []
    assert checked == sum(r["event"] in ("suggest", "promote", "pause", "prune", "done") for r in records)


def test_a_replay_names_a_decision_that_differs(tmp_path):
    sweep = sweep_spec()
    _, _, records = run_through(tmp_path, sweep)
    i = next(i for i, r in enumerate(records) if r["event"] == "pause")
    records[i] = {**records[i], "event": "promote", "budget": 40960}
    _, differences = replay(sweep, records)
    assert differences[0] == f"record {records[i]['seq']}: {records[i]['trial']} at 20480 tokens: journal promote, " \
                             "replay pause"


@pytest.mark.parametrize("algorithm", ["random", "grid"])
def test_a_trial_optuna_created_without_its_parameters_gets_the_ones_a_replay_asks_for(tmp_path, algorithm):
    """Killed inside Optuna's ask: the trial is in Optuna's journal, its parameters are not. The restarted
    controller samples them as that ask would have, so the sweep and its replay agree."""
    import optuna

    from gpu_train.sweeps.algorithms import Policy

    sweep = sweep_spec(algorithm=algorithm)
    first = Controller(sweep, tmp_path / "d", SimBackend(sweep), out=io.StringIO())
    first.policy.study.ask()  # a trial with no parameters yet
    Controller(sweep, tmp_path / "d", SimBackend(sweep), out=io.StringIO())
    (suggest,) = [r for r in read_journal(tmp_path / "d" / "journal.jsonl") if r["event"] == "suggest"]
    assert suggest["params"] == Policy(sweep, optuna.storages.InMemoryStorage()).suggest(0)


def test_a_trial_that_stops_early_on_its_own_patience_is_finished_there(tmp_path):
    """eval.early_stopping_patience in the template: the trainer ends the trial before its budget, and that is a
    finished trial with its last validation loss, not a failure."""
    sweep = sweep_spec(num_trials=1, parallel=1)

    class Patient(SimBackend):
        def read_status(self, t):
            self.budget[t.id] = min(self.budget[t.id], 12288)  # it stops at 3 steps, below the first rung
            status = super().read_status(t)
            return status and {**status, "state": "stopped_early", "params_sha256": "sha"}

    controller = Controller(sweep, tmp_path / "e", Patient(sweep), out=io.StringIO())
    for _ in range(3):
        if not controller.step():
            break
    records = read_journal(tmp_path / "e" / "journal.jsonl")
    (finish,) = [r for r in records if r["event"] == "finish"]
    assert finish["tokens"] == 12288 and controller.state.best().id == finish["trial"]


def test_the_median_rule_stops_a_trial_worse_than_the_median_of_the_finished_ones(tmp_path):
    """Optuna's MedianPruner, worked out by hand on the curve: after n_startup_trials (3 of 6) trials finished,
    a trial is stopped at its first evaluation past minTokens when its loss there is above the median of the
    finished trials' losses at the same point; one at a time, so the finished set is known at each trial."""
    import statistics

    doc = raw()
    doc["algorithm"] = {"name": "random", "seed": 3, "earlyStopping": {"name": "median", "minTokens": 40960}}
    doc["trialTemplate"]["overrides"]["eval.every_steps"] = 5  # every 20,480 tokens
    doc["trialConfig"].update(numTrials=6, parallelTrials=1)
    sweep = parse_sweep(doc, "s.yaml")
    _, _, records = run_through(tmp_path, sweep)
    suggested = [r["params"] for r in records if r["event"] == "suggest"]
    assert len(suggested) == 6
    finished: list[dict] = []
    expected = []
    for number, params in enumerate(suggested):
        at = 40960  # the first evaluation the pruner may act on (its warm-up is minTokens)
        if len(finished) >= 3 and loss(params, at) > statistics.median(loss(p, at) for p in finished):
            expected.append(("prune", f"{sweep.name}-t{number:03d}", at))
        else:
            finished.append(params)
            expected.append(("finish", f"{sweep.name}-t{number:03d}", None))
    got = [(r["event"], r["trial"], r.get("tokens") if r["event"] == "prune" else None)
           for r in records if r["event"] in ("prune", "finish")]
    assert got == expected
    assert any(e == "prune" for e, _, _ in expected), "this seed should stop at least one trial"
