"""The plan's carbon lines: the stack job's estimated energy and emissions, the greener regions for its pool, and
a one-line advisory when the stack's region is far above the best allowed region offering its pools' types.

Usage (infra/__main__.py): `for line in plan_notes(cfg): pulumi.log.info(line)`. Pure: tests call `plan_notes`
with loaded settings. The numbers and the rule come from gpu_train/carbon (docs/carbon.md).
"""

from __future__ import annotations

from gpu_train import carbon
from gpu_train.carbon import advisor
from gpu_train.carbon.estimate import job_estimate
from gpu_train.spec.settings import StackSettings


def plan_notes(cfg: StackSettings) -> list[str]:
    allow = carbon.allowed(cfg.carbon.allowed_regions) if cfg.carbon.allowed_regions else None
    lines = []
    if cfg.job is not None:
        instance_type = cfg.pool(cfg.job.pool).instance_type
        lines.append(f"job {cfg.job.name}: "
                     + job_estimate(cfg.job, cloud=cfg.cloud, region=cfg.region, instance_type=instance_type).line())
        lines.append(f"job {cfg.job.name}: "
                     + advisor.greener_text(cfg.cloud, cfg.region, instance_type,
                                            allow=allow if allow is not None else carbon.same_area(cfg.cloud, cfg.region)))
    note = advisor.advisory(cfg.cloud, cfg.region, [p.instance_type for p in cfg.gpu_pools], allow=allow)
    if note:
        lines.append(note)
    return lines
