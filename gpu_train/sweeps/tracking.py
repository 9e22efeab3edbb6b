"""The sweep's MLflow parent run: its trials' runs are its children (each trial's trainer is given
tracking.parent_run_id, which it sets as the tag mlflow.parentRunId; trainer/tracking.py).

Usage:
    tracker = SweepTracker.open(tracking_uri)            # None, with one line, when MLflow cannot be used here
    run_id = tracker.start(sweep)                        # the experiment <sweep name>, the parent run
    tracker.resume(run_id)                               # a restarted controller
    tracker.finish(state, plot=Path(...), journal=Path(...))   # best trial, its parameters, the plot and journal

Where: the tracking URI given (the platform's MLflow in the cluster), else MLFLOW_TRACKING_URI, else the same
embedded SQLite store a local run uses (runs/<sweep>/mlflow.db beside the trials' run directories). The experiment
keeps its artifacts beside a SQLite store, as the trainer's tracker does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from gpu_train.spec.sweep import SweepSpec
from gpu_train.sweeps.journal import SweepState

log = logging.getLogger("gpu_train.sweeps")
TAG_SWEEP = "gpu_train.sweep"


def default_tracking_uri(sweep_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, else the embedded store of the trials' run directories (sweep_dir/mlflow.db)."""
    return os.environ.get("MLFLOW_TRACKING_URI", "").strip() or f"sqlite:///{Path(sweep_dir).resolve() / 'mlflow.db'}"


class SweepTracker:
    def __init__(self, client: Any, tracking_uri: str) -> None:
        self.client, self.tracking_uri = client, tracking_uri
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    @classmethod
    def open(cls, tracking_uri: str) -> SweepTracker | None:
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=tracking_uri)
            client.search_experiments(max_results=1)  # a store that cannot be opened fails here, not later
        except Exception as exc:  # an optional output: say why, keep sweeping
            print(f"gpu-train: MLflow tracking off for this sweep ({tracking_uri}): {str(exc).splitlines()[0]}",
                  flush=True)
            return None
        return cls(client, tracking_uri)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if self.tracking_uri.startswith("sqlite:///"):
            location = (Path(self.tracking_uri[len("sqlite:///"):]).parent / "mlartifacts" / name).as_uri()
        return self.client.create_experiment(name, location)

    def start(self, sweep: SweepSpec) -> str:
        self.experiment_id = self._experiment(sweep.name)
        run = self.client.create_run(self.experiment_id, run_name=sweep.name, tags={TAG_SWEEP: sweep.name})
        self.run_id = run.info.run_id
        params = {"algorithm": sweep.algorithm.name, "seed": sweep.algorithm.seed, "early_stopping": sweep.early.name,
                  "num_trials": sweep.trial_config.num_trials, "parallel_trials": sweep.trial_config.parallel_trials,
                  "max_tokens_per_trial": sweep.max_tokens, "rungs": ",".join(map(str, sweep.rungs())) or "-",
                  **{f"space.{k}": p.model_dump_json(exclude_none=True) for k, p in sweep.search_space.items()}}
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        return self.run_id

    def resume(self, run_id: str | None) -> None:
        self.run_id = run_id

    def finish(self, state: SweepState, *, plot: Path | None, journal: Path) -> None:
        if not self.run_id:
            return
        try:
            best = state.best()
            if best is not None:
                self.client.log_metric(self.run_id, "best_val_loss", best.value)
                self.client.set_tag(self.run_id, "best_trial", best.id)
                for k, v in best.params.items():
                    self.client.set_tag(self.run_id, f"best.{k}", str(v))
            counts = {s: len(state.by_state(s)) for s in ("completed", "pruned", "failed")}
            for k, v in counts.items():
                self.client.log_metric(self.run_id, f"trials_{k}", v)
            self.client.log_metric(self.run_id, "tokens_trained", sum(t.tokens for t in state.trials.values()))
            for path in (plot, journal):
                if path is not None and path.exists():
                    self.client.log_artifact(self.run_id, str(path))
            self.client.set_terminated(self.run_id, status="FINISHED")
        except Exception as exc:  # the sweep is done; its record in MLflow is a courtesy
            log.warning("MLflow: the sweep's run %s was not completed: %s", self.run_id, str(exc).splitlines()[0])
