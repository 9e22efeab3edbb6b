"""The cloud layers behind one interface, and every check a stack's settings get before anything is created.

Usage (infra/__main__.py):
    layer = clouds.layer(settings.cloud)     # infra.aws or infra.gcp
    clouds.require_valid(settings)           # SettingsError naming every problem, or nothing
    platform = layer.build_platform(settings, tags)

Each cloud layer offers the same four names: `check(settings)` (the rules only that cloud has),
`describe_pools(settings)` (the GPU pools as jobs see them, from the settings alone), `NVME_HOST_PATH` and
`build_platform(settings, tags)`. `problems` reports, all at once, the cloud-neutral checks across settings
(gpu_train.spec.settings_checks), the stack job's layout and memory (gpu_train.sizing.job), the allowed carbon
regions against the carbon table (gpu_train.carbon) and the cloud's own; then what only the pools make checkable: whether Kueue could
ever admit the stack's job and its pods fit a node of their pool (gpu_train/jobs/check.py), against the same queue
objects the Kubernetes layer creates and the platform contract publishes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gpu_train import carbon
from gpu_train.jobs import queues
from gpu_train.jobs.check import check_job
from gpu_train.sizing.job import layout_problems
from gpu_train.spec import naming, settings_checks
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.settings import StackSettings
from gpu_train.spec.settings_checks import BUCKET_SCHEME


def layer(cloud: str) -> ModuleType:
    """The cloud layer's module: infra.aws or infra.gcp."""
    return importlib.import_module(f"infra.{cloud}")


def problems(settings: StackSettings) -> list[str]:
    """The checks across settings and the cloud's own rules, then the stack's job against its pools, teams and
    queues."""
    cloud = layer(settings.cloud)
    found = settings_checks.problems(settings) + carbon.settings_problems(settings.carbon.allowed_regions)
    if settings.job is not None:
        found += layout_problems(settings.job, pools=settings_checks.pool_facts(settings))
    found += cloud.check(settings)
    job = settings.job
    if job is None or found:
        return found
    pools = cloud.describe_pools(settings)
    nvme = cloud.NVME_HOST_PATH
    # Kueue admits a JobSet whole or not at all: refuse a job it could never admit, or whose pods cannot fit
    # their nodes. The stack's job goes to a LocalQueue of its own, which feeds its team's ClusterQueue. The stack's
    # own settings are named where they are the culprit: the pool's instance type, the team's quota.
    pool_index = next((i for i, p in enumerate(settings.gpu_pools) if p.name == job.pool), None)
    team_index = next((i for i, t in enumerate(settings.teams) if t.name == job.team), None)
    return check_job(job, pools=pools, teams=queues.team_entries(settings.teams, pools, nvme),
                     kueue=queues.kueue_objects(settings.teams, pools, cloud.SYSTEM_LABELS), nvme_host_path=nvme,
                     scheme=BUCKET_SCHEME[settings.cloud], queue=naming.job_queue_name(job.name),
                     pool_key=f"{naming.PROJECT}:gpuPools[{pool_index}].instanceType" if pool_index is not None else "",
                     quota_key=f"{naming.PROJECT}:teams[{team_index}].gpuQuota" if team_index is not None else "")


def require_valid(settings: StackSettings) -> None:
    """Raise SettingsError with every problem `problems` finds."""
    found = problems(settings)
    if found:
        raise SettingsError(found)
