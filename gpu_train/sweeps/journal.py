"""The sweep's journal: every decision and every input it was made from, one JSON object per line, appended and
fsync'd before the action it records is taken, next to Optuna's own journal (optuna.journal).

Usage:
    journal = Journal(sweep_dir / "journal.jsonl")
    journal.append("suggest", trial="t000", number=0, params={"train.lr": 0.003})
    records = read_journal(sweep_dir / "journal.jsonl")     # a torn last line (a killed writer) is left out
    state = SweepState.replay(records)                      # each trial's parameters, reports, budget, state

Events: `start` (the sweep's name, algorithm, seed, MLflow parent run), `suggest` (trial, Optuna number, params),
`launch` (trial, budget tokens), `report` (trial, tokens, value: a validation loss the trainer wrote), `promote`
(trial, budget tokens; `resume` true when it was paused), `pause` (trial, tokens), `prune` (trial, tokens, why),
`finish` (trial, value, params_sha256), `fail` (trial, why), `done` (the best trial). A killed controller rebuilds
its state from these lines, and `gpu-train sweep replay` walks them to check every decision.

Hand-written, not Optuna's JournalStorage: Optuna's journal holds the study (trials, parameters, intermediate
values) but not the actions a pause-and-promote sweep takes on jobs (pause, promote, launch), nor the order in
which trial outputs were read, which are what a restart and a replay need.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gpu_train.sweeps")

JOURNAL = "journal.jsonl"  # its file in the sweep's directory
CONTROLLER_PID = "controller.pid"  # the running controller's pid, beside it (`gpu-train sweep stop`)
ACTIVE = ("running", "held")  # states that hold a trial slot (and, in the cluster, quota)
TERMINAL = ("completed", "pruned", "failed")


class Journal:
    """Append-only JSON lines, each flushed and fsync'd before append() returns."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = len(read_journal(self.path))

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"seq": self.seq, "event": event, **fields, "at": round(time.time(), 3)}
        line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.seq += 1
        return record


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every complete record; a last line cut short by a killed writer is dropped with one log line."""
    if not Path(path).exists():
        return []
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                log.warning("%s: the last line was cut short (a killed writer); it is left out", path)
                break
            raise ValueError(f"{path}:{i + 1}: not a journal record: {line[:80]!r}") from None
    return records


@dataclass
class TrialState:
    """One trial as the journal tells it."""

    id: str
    number: int
    params: dict[str, Any]
    state: str = "pending"  # pending | running | held | paused | completed | pruned | failed
    budget: int = 0  # tokens it may train to
    reports: dict[int, float] = field(default_factory=dict)  # tokens -> validation loss
    decided: set[int] = field(default_factory=set)  # rung tokens decided (promoted or paused there)
    value: float | None = None  # the final validation loss
    params_sha256: str | None = None
    launches: int = 0

    @property
    def best(self) -> float | None:
        return min(self.reports.values()) if self.reports else self.value

    @property
    def tokens(self) -> int:
        return max(self.reports, default=0)


@dataclass
class SweepState:
    """The sweep as its journal tells it: the start record and each trial, in the order they were suggested."""

    start: dict[str, Any] | None = None
    trials: dict[str, TrialState] = field(default_factory=dict)
    done: dict[str, Any] | None = None

    def apply(self, r: dict[str, Any]) -> None:
        """Update from one record (the same function a live controller and a replay use)."""
        ev = r["event"]
        if ev == "start":
            self.start = r
            return
        if ev == "done":
            self.done = r
            return
        if ev == "suggest":
            self.trials[r["trial"]] = TrialState(id=r["trial"], number=r["number"], params=r["params"])
            return
        t = self.trials[r["trial"]]
        if ev == "launch":
            t.state, t.budget, t.launches = "running", r["budget"], t.launches + 1
        elif ev == "report":
            t.reports[int(r["tokens"])] = float(r["value"])
        elif ev == "promote":
            t.budget = r["budget"]
            t.decided.add(int(r["tokens"]))
            t.state = "paused" if r.get("resume") else "running"  # a paused one runs once launched again
        elif ev == "pause":
            t.state = "paused"
            t.decided.add(int(r["tokens"]))
        elif ev == "hold":
            t.state = "held"
        elif ev == "prune":
            t.state = "pruned"
        elif ev == "finish":
            t.state, t.value, t.params_sha256 = "completed", r["value"], r.get("params_sha256")
        elif ev == "fail":
            t.state = "failed"

    @classmethod
    def replay(cls, records: list[dict[str, Any]]) -> SweepState:
        state = cls()
        for r in records:
            state.apply(r)
        return state

    def by_state(self, *states: str) -> list[TrialState]:
        return [t for t in self.trials.values() if t.state in states]

    def best(self) -> TrialState | None:
        done = [t for t in self.trials.values() if t.state == "completed" and t.value is not None]
        return min(done, key=lambda t: (t.value, t.number)) if done else None
