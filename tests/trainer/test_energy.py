"""Measured energy at the end of a run: the meter reads the counter it is given; two workers, each handed a
stand-in GPU energy counter (tests/trainer/energy_counter.py, through tests/trainer/faults.py), add up their GPUs'
energy, convert it with the region's factors, and put it in the summary, the printed summary and MLflow; without
counters the run says it did not measure.

Run: .venv/bin/pytest tests/trainer/test_energy.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mlflow import MlflowClient

from tests.trainer.energy_counter import STEP_MJ
from tests.trainer.launch import FAULTS, SMALL, run_trainer, summary
from trainer.distributed import DistEnv, free_port
from trainer.energy import EnergyMeter


class _Counter:
    """A GPU that used 10 Wh between its two readings."""

    def __init__(self) -> None:
        self.readings = iter([5_000.0, 5_000.0 + STEP_MJ])

    def read_mj(self) -> float:
        return next(self.readings)


def test_the_meter_reads_the_counter_it_is_given_even_on_the_cpu(monkeypatch):
    monkeypatch.setenv("GPU_TRAIN_CLOUD", "aws")
    monkeypatch.setenv("GPU_TRAIN_REGION", "eu-north-1")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), restart_count=0)
    assert EnergyMeter.start(env).why == "the run is on the CPU"  # without one: the GPU's, and there is none
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        meter = EnergyMeter.start(env, _Counter())
        assert (meter.first_mj, meter.why) == (5_000.0, "")
        fields = meter.finish(env)
    finally:
        dist.destroy_process_group()
    # 10 Wh x PUE 1.15 (AWS 2024) x 8.8 gCO2e/kWh (eu-north-1) = 0.1012 g.
    assert fields["energy_kwh"] == pytest.approx(0.01)
    assert fields["co2e_kg"] == pytest.approx(0.0001012)
    assert fields["energy_region"] == "aws/eu-north-1"


@pytest.mark.integration  # starts torchrun and trainer processes
def test_two_workers_report_their_summed_energy_and_emissions(tmp_path):
    run_dir = tmp_path / "runs" / "energy"
    counters = tmp_path / "counters"
    counters.mkdir()
    overrides = [o for o in SMALL if not o.startswith("tracking.")] + ["train.steps=3", "tracking.enabled=true"]
    env = {"TRAINER_TEST_ENERGY_DIR": str(counters), "GPU_TRAIN_CLOUD": "aws", "GPU_TRAIN_REGION": "eu-north-1"}
    res = run_trainer(run_dir, 2, overrides, env=env, module=FAULTS)
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


@pytest.mark.integration
def test_a_run_without_energy_counters_says_not_measured(tmp_path):
    run_dir = tmp_path / "runs" / "cpu"
    res = run_trainer(run_dir, None, [*SMALL, "train.steps=2"])
    assert res.returncode == 0, res.output[-4000:]
    assert "energy: not measured (no energy counters)" in res.output
    assert "the run is on the CPU" in res.output
    result = summary(run_dir)
    assert result["energy_kwh"] is None and result["co2e_kg"] is None
