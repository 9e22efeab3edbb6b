"""A job's energy and emissions before it runs, and the factors a measured run is converted with.

Usage:
    est = job_estimate(job, cloud="aws", region="us-east-1", instance_type="p5.48xlarge")
    est.energy_kwh, est.kg_co2e, est.hours          # or est.unknown: why there is no estimate
    est.line()                                      # the one line `submit`, `lint`, `apply --dry-run` print
    node_hour_kg("gcp", "europe-west4", "a3-megagpu-8g")   # kg CO2e for one node-hour at full power
    co2e_kg(energy_kwh=12.0, cloud="gcp", region="europe-west4")   # measured GPU energy -> kg CO2e

The formula (docs/carbon.md): kg CO2e = GPUs x power x hours x PUE x grid intensity, where
- GPUs = the job's MAX nodes x its GPUs per node (Kueue admits the JobSet whole);
- power = the GPU model's TDP (gpu_train/spec/catalog/gpus.py): an upper bound, no utilisation factor below it;
- hours = the run's training FLOPs / (GPUs x the GPU's dense BF16 peak x ASSUMED_MFU), with FLOPs = train.steps x
  train.global_batch_tokens x FLOPs per token of the preset's model shape (gpu_train/sizing/flops.py); the job spec
  has no run time of its own, and the work it asks for is known exactly; a job of its own code (`command`) says
  nothing of its work, so it gets no estimate;
- PUE = the cloud's published fleet figure, grid intensity = the region's (gpu_train/carbon).
GPUs cancel out: a run's energy depends on its work and the GPU's efficiency, not on how many GPUs share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import gpu_train.carbon as carbon
from gpu_train.sizing.flops import gpu_peak_flops, shape_flops_per_token
from gpu_train.spec import catalog
from gpu_train.spec.catalog.gpus import tdp_watts
from gpu_train.spec.errors import ConfigError
from gpu_train.spec.job import JobSpec, World, job_world, trainer_config

# Model FLOPs utilisation assumed for the run time, a round figure below the 46% PaLM reports for its largest run
# (https://arxiv.org/abs/2204.02311, table 3). The trainer measures the real value (trainer_mfu, the run summary);
# the estimate states the one it assumed.
ASSUMED_MFU = 0.4


@dataclass(frozen=True, kw_only=True)
class Estimate:
    cloud: str
    region: str
    instance_type: str
    world: World | None = None  # the job's world sizes; the estimate is for its MAX (module docstring)
    watts_per_gpu: int = 0
    hours: float = 0.0
    pue: float = 0.0
    intensity: float = 0.0  # gCO2e/kWh
    unknown: str = ""  # why there is no estimate ("" when there is one)

    @property
    def gpus(self) -> int:
        """The GPUs the run is estimated on: MAX nodes' (0 without an estimate)."""
        return self.world.size(self.world.nodes.max) if self.world is not None else 0

    @property
    def gpu_kwh(self) -> float:
        """Energy at the GPUs: GPUs x power x hours."""
        return self.gpus * self.watts_per_gpu * self.hours / 1000

    @property
    def energy_kwh(self) -> float:
        """Energy the data centre draws for it: GPU energy x PUE."""
        return self.gpu_kwh * self.pue

    @property
    def kg_co2e(self) -> float:
        return self.energy_kwh * self.intensity / 1000

    def line(self) -> str:
        if self.unknown:
            return f"carbon: no estimate ({self.unknown})"
        at = self.world.describe(self.world.nodes.max, "MAX") if self.world is not None else ""
        return (f"carbon: ~{self.energy_kwh:,.3g} kWh, ~{self.kg_co2e:,.3g} kg CO2e in {self.region} "
                f"({self.intensity:.0f} gCO2e/kWh, PUE {self.pue}; {self.gpus} GPUs x {self.watts_per_gpu} W TDP x "
                f"{self.hours:,.2f} h at {ASSUMED_MFU:.0%} MFU, at {at}, which Kueue admits whole)")


def job_estimate(job: JobSpec, *, cloud: str, region: str, instance_type: str) -> Estimate:
    """The job's estimate on this cloud, region and machine type (or one saying why there is none)."""
    base = Estimate(cloud=cloud, region=region, instance_type=instance_type)
    shape = catalog.shape(cloud, instance_type)
    if shape is None:
        return _unknown(base, f"{instance_type} is not in the {cloud} catalog")
    watts, peak = tdp_watts(shape.gpu_type), gpu_peak_flops(shape.gpu_type)
    if watts is None or peak is None:
        return _unknown(base, f"no published power or peak figure for {shape.gpu_type}")
    try:
        where = carbon.region(cloud, region)
    except carbon.CarbonDataError as exc:
        return _unknown(base, str(exc))
    if not job.bundled:
        return _unknown(base, "the job runs its own code (job.command): the work it does is not known before it runs")
    try:
        model = trainer_config(job).model
    except ConfigError as exc:
        return _unknown(base, f"the trainer refuses the job's settings: {exc}")
    world = job_world(job, shape.gpus)
    flops = job.steps * job.global_batch_tokens * shape_flops_per_token(model)
    hours = flops / (world.size(job.nodes.max) * peak * ASSUMED_MFU) / 3600
    return Estimate(cloud=cloud, region=region, instance_type=instance_type, world=world, watts_per_gpu=watts,
                    hours=hours, pue=carbon.pue(cloud), intensity=where.intensity)


def _unknown(base: Estimate, why: str) -> Estimate:
    return Estimate(cloud=base.cloud, region=base.region, instance_type=base.instance_type, unknown=why)


def node_hour_kg(cloud: str, region: str, instance_type: str) -> float | None:
    """kg CO2e of one node of this type for one hour at full power in this region (None without a power figure)."""
    shape = catalog.shape(cloud, instance_type)
    watts = tdp_watts(shape.gpu_type) if shape is not None else None
    if shape is None or watts is None:
        return None
    return shape.gpus * watts / 1000 * carbon.pue(cloud) * carbon.region(cloud, region).intensity / 1000


def co2e_kg(*, energy_kwh: float, cloud: str, region: str) -> float:
    """Measured GPU energy converted as the estimate converts it: x PUE x the region's grid intensity."""
    return energy_kwh * carbon.pue(cloud) * carbon.region(cloud, region).intensity / 1000
