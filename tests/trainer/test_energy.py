"""Measured energy at the end of a run: two workers, each reading a stand-in GPU energy counter
(tests/trainer/energy_counter.py, through trainer/energy.py's counter interface), add up their GPUs' energy, convert it
with the region's factors, and put it in the summary, the printed summary and MLflow; without counters the run
says it did not measure.

Run: .venv/bin/pytest tests/trainer/test_energy.py -q
"""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from tests.trainer.energy_counter import STEP_MJ
from tests.trainer.launch import SMALL, run_trainer, summary

# Starts torchrun and trainer processes.
pytestmark = pytest.mark.integration


def test_two_workers_report_their_summed_energy_and_emissions(tmp_path):
    run_dir = tmp_path / "runs" / "energy"
    counters = tmp_path / "counters"
    counters.mkdir()
    overrides = [o for o in SMALL if not o.startswith("tracking.")] + ["train.steps=3", "tracking.enabled=true"]
    env = {"TRAINER_ENERGY_COUNTER": "tests.trainer.energy_counter", "TRAINER_TEST_ENERGY_DIR": str(counters),
           "GPU_TRAIN_CLOUD": "aws", "GPU_TRAIN_REGION": "eu-north-1"}
    res = run_trainer(run_dir, 2, overrides, env=env)
    assert res.returncode == 0, res.output[-4000:]
    # Each of the 2 ranks read its counter twice: 36,000,000 mJ apart = 10 Wh = 0.01 kWh; together 0.02 kWh.
    # Emissions: 0.02 kWh x PUE 1.15 (AWS 2024) x 8.8 gCO2e/kWh (eu-north-1) = 0.2024 g = 0.0002024 kg.
    assert STEP_MJ == 36_000_000
    result = summary(run_dir)
    assert result["energy_kwh"] == pytest.approx(0.02)
    assert result["co2e_kg"] == pytest.approx(0.0002024)
    assert result["energy_region"] == "aws/eu-north-1"
    assert "energy          0.0200 kWh at the GPUs, 0.0002 kg CO2e (aws/eu-north-1, x PUE)" in res.output
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.metrics["energy_kwh"] == pytest.approx(0.02)
    assert run.data.metrics["co2e_kg"] == pytest.approx(0.0002024)


def test_a_run_without_energy_counters_says_not_measured(tmp_path):
    run_dir = tmp_path / "runs" / "cpu"
    res = run_trainer(run_dir, None, [*SMALL, "train.steps=2"])
    assert res.returncode == 0, res.output[-4000:]
    assert "energy: not measured (no energy counters)" in res.output
    assert "the run is on the CPU" in res.output
    result = summary(run_dir)
    assert result["energy_kwh"] is None and result["co2e_kg"] is None
