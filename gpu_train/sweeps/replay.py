"""Replay a sweep's journal decision by decision: a fresh in-memory Optuna study with the same sampler seed and
pruner is fed the journal's inputs (each trial's reports, in the order the controller read them) and asked for
every decision the journal records; any answer that differs is reported.

Usage:
    checked, differences = replay(sweep, read_journal(sweep_dir / "journal.jsonl"))
    `gpu-train sweep replay SPEC` prints them and exits 1 on any difference.

What is checked: every suggestion (the parameters, exactly), every verdict at a rung (promote or pause, from
Optuna's SuccessiveHalvingPruner), every promotion of a paused trial (ASHA's top 1/eta), every prune (the median
rule, or a paused trial that could no longer be promoted) and the best trial.
"""

from __future__ import annotations

from typing import Any

import optuna

from gpu_train.spec.sweep import SweepSpec
from gpu_train.sweeps.algorithms import Policy
from gpu_train.sweeps.journal import SweepState


def _rung_values(state: SweepState, tokens: int) -> list[float]:
    return [t.reports[tokens] for t in state.trials.values() if tokens in t.reports]


def check(policy: Policy, state: SweepState, r: dict[str, Any]) -> str | None:
    """The difference between record `r` and what the policy decides now; None when they agree. Feeds the
    policy the record's input (a report, a finish) as the live controller did."""
    ev, number = r["event"], state.trials[r["trial"]].number if r.get("trial") in state.trials else None
    if ev == "suggest":
        params = policy.suggest(r["number"])
        return None if params == r["params"] else f"suggest {r['trial']}: journal {r['params']}, replay {params}"
    if ev == "report":
        policy.report(number, int(r["tokens"]), float(r["value"]))
    elif ev == "pause" or (ev == "promote" and not r.get("resume")):
        verdict = policy.at_rung(number, int(r["tokens"]))
        if verdict != ev:
            return f"{r['trial']} at {r['tokens']} tokens: journal {ev}, replay {verdict}"
    elif ev == "promote":
        if not policy.promotable(number, int(r["tokens"]), _rung_values(state, int(r["tokens"]))):
            return f"{r['trial']} promoted from its pause at {r['tokens']} tokens: replay would not promote it"
    elif ev == "prune":
        if state.trials[r["trial"]].state == "paused":
            if policy.promotable(number, int(r["tokens"]), _rung_values(state, int(r["tokens"]))):
                return f"{r['trial']} pruned at {r['tokens']} tokens: replay would promote it"
        elif not policy.median_stop(number):
            return f"{r['trial']} pruned at {r['tokens']} tokens: replay would not stop it"
        policy.prune(number)
    elif ev == "finish":
        policy.finish(number, float(r["value"]))
    elif ev == "fail":
        policy.fail(number)
    elif ev == "done":
        best = state.best()
        if (best.id if best else None) != r.get("best"):
            return f"best trial: journal {r.get('best')}, replay {best.id if best else None}"
    return None


DECISIONS = ("suggest", "promote", "pause", "prune", "done")


def replay(sweep: SweepSpec, records: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """(decisions checked, differences)."""
    policy = Policy(sweep, optuna.storages.InMemoryStorage())
    state = SweepState()
    checked, differences = 0, []
    for r in records:
        if r["event"] != "start":
            problem = check(policy, state, r)
            checked += r["event"] in DECISIONS
            if problem:
                differences.append(f"record {r['seq']}: {problem}")
        state.apply(r)
    return checked, differences
