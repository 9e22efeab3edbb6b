"""Measured GPU energy of a run and its emissions: each rank reads its GPU's energy counter when training starts
and when it ends, the ranks add up the differences, and the total is converted with the region's carbon factors.

Usage (trainer/train.py):
    meter = EnergyMeter.start(env, counter)    # every rank: its counter's first reading (or why there is none)
    fields = meter.finish(env, tracker, step)  # every rank (a collective): {"energy_kwh", "co2e_kg", ...}, to MLflow
    summary.update(fields); energy_line(summary)   # "energy          0.0200 kWh at the GPUs, 0.0002 kg CO2e ..."

Counters, through one interface (`read_mj()`: millijoules since some fixed point):
- NVML, through pynvml (the nvidia-ml-py package): nvmlDeviceGetTotalEnergyConsumption of this rank's GPU, the
  counter DCGM exports as DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (Volta and later). The default on a CUDA device.
- Any object with `read_mj()` handed to the meter (`EnergyMeter.start(env, counter)`, the Trainer's and
  `python -m trainer`'s `energy_counter`). Tests stand in for a GPU this way (tests/trainer/energy_counter.py).
When any rank has no counter (CPU, no NVML, an older GPU) the run says "energy: not measured (no energy counters)"
with the reason, and its summary holds None.

The conversion is the estimate's (gpu_train/carbon/estimate.py co2e_kg): GPU energy x the cloud's PUE x the
region's grid intensity, for the region in GPU_TRAIN_CLOUD / GPU_TRAIN_REGION (set on the pod by the JobSet
renderer). Only the GPUs are measured: CPUs, memory and network are not in the figure (docs/carbon.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gpu_train.spec.env import CLOUD as CLOUD_ENV
from gpu_train.spec.env import REGION as REGION_ENV

log = logging.getLogger("trainer")
MJ_PER_KWH = 3.6e9
NOT_MEASURED = "energy: not measured (no energy counters)"


class Counter(Protocol):
    def read_mj(self) -> float: ...


class NvmlCounter:
    """The GPU's total energy since the driver loaded, in millijoules (NVML)."""

    def __init__(self, index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        self.read_mj()  # an older GPU answers NVMLError_NotSupported here

    def read_mj(self) -> float:
        return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))


def open_counter(env: Any) -> tuple[Counter | None, str]:
    """This rank's GPU counter through NVML, or None and why there is none."""
    if not env.is_cuda:
        return None, "the run is on the CPU"
    try:
        return NvmlCounter(env.device.index if env.device.index is not None else env.local_rank), ""
    except ImportError:
        return None, "pynvml (nvidia-ml-py) is not installed"
    except Exception as exc:  # NVMLError: no driver library, counter not supported on this GPU
        return None, f"NVML: {exc}"


@dataclass
class EnergyMeter:
    counter: Counter | None
    why: str
    first_mj: float = 0.0

    @classmethod
    def start(cls, env: Any, counter: Counter | None = None) -> EnergyMeter:
        """Read `counter` (None: this rank's GPU counter, open_counter) for the first time."""
        counter, why = (counter, "") if counter is not None else open_counter(env)
        return cls(counter, why, counter.read_mj() if counter is not None else 0.0)

    def finish(self, env: Any, tracker: Any = None, step: int = 0) -> dict[str, Any]:
        """The run's summary fields, also logged to the tracker (rank 0's MLflow run) at `step`; a collective (every
        rank calls it). None values when not measured."""
        fields = self._measure(env)
        if tracker is not None:
            tracker.log_metrics({k: fields[k] for k in ("energy_kwh", "co2e_kg")}, step=step)
        return fields

    def _measure(self, env: Any) -> dict[str, Any]:
        used = self.counter.read_mj() - self.first_mj if self.counter is not None else 0.0
        values = torch.tensor([used, float(self.counter is None)], dtype=torch.float64,
                              device=env.device if env.is_cuda else "cpu")
        dist.all_reduce(values)
        cloud, region = os.environ.get(CLOUD_ENV, ""), os.environ.get(REGION_ENV, "")
        if values[1].item() > 0:
            if env.rank == 0:
                log.info("%s: %s", NOT_MEASURED, self.why or "another rank has none")
            return {"energy_kwh": None, "co2e_kg": None, "energy_region": None}
        kwh = values[0].item() / MJ_PER_KWH
        return {"energy_kwh": kwh, "co2e_kg": _co2e(kwh, cloud, region),
                "energy_region": f"{cloud}/{region}" if cloud and region else None}


def _co2e(kwh: float, cloud: str, region: str) -> float | None:
    from gpu_train.carbon import CarbonDataError
    from gpu_train.carbon.estimate import co2e_kg

    if not (cloud and region):
        log.info("energy: no emissions figure: %s and %s are not set (the region is unknown)", CLOUD_ENV, REGION_ENV)
        return None
    try:
        return co2e_kg(energy_kwh=kwh, cloud=cloud, region=region)
    except (CarbonDataError, KeyError) as exc:
        log.info("energy: no emissions figure for %s/%s: %s", cloud, region, exc)
        return None


def energy_line(summary: dict[str, Any]) -> str:
    """The run summary's energy line."""
    kwh = summary.get("energy_kwh")
    if kwh is None:
        return NOT_MEASURED
    co2 = summary.get("co2e_kg")
    where = summary.get("energy_region")
    return (f"energy          {kwh:.4f} kWh at the GPUs" + (f", {co2:.4f} kg CO2e ({where}, x PUE)" if co2 is not None
                                                              else ", emissions unknown (no region)"))
