"""Is a job possible on a platform (gpu_train/jobs/check.py): the job's settings, then its JobSet against the
team's queue (Kueue admits all MAX pods at once or none) and its pods against a node of the pool, for the pools
each cloud layer describes. The expected capacities are worked out beside them from Kueue's cohort rules.

Run: .venv/bin/pytest tests/gpu_train/jobs/test_check.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.jobs import queues
from gpu_train.jobs.check import check_job
from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from gpu_train.spec.settings import TeamSettings
from tests.gpu_train.jobs.test_jobset import NVME, dev_job, efa_pool, l4_pool, prod_job, tcpxo_pool


def _teams(research: dict, applied: dict) -> tuple[TeamSettings, ...]:
    return (TeamSettings(name="research", gpu_quota=research), TeamSettings(name="applied", gpu_quota=applied))


def _spot(pool: GpuPool) -> GpuPool:
    return pool.model_copy(update={"name": "h100-spot", "capacity": "spot",
                                   "node_selector": {naming.POOL_LABEL: "h100-spot"}})


def check(job, teams, pools, cloud="aws"):
    """The job checked as the stack checks its own (its own LocalQueue) against these teams' queue objects."""
    nvme = NVME[cloud]
    return check_job(job, pools=pools, teams=queues.team_entries(teams, pools, nvme),
                     kueue=queues.kueue_objects(teams, pools, {naming.SYSTEM_LABEL: "true"}), nvme_host_path=nvme,
                     scheme="s3://" if cloud == "aws" else "gs://", queue=naming.job_queue_name(job.name))


@pytest.mark.parametrize(("pool", "cloud"), [(efa_pool(), "aws"), (tcpxo_pool(), "gcp")])
def test_the_prod_job_is_admissible_on_its_teams_quota(pool, cloud):
    teams = _teams({"h100-reserved": 32, "h100-spot": 16}, {"h100-spot": 16})
    assert check(prod_job(), teams, [pool, _spot(pool)], cloud) == []


def test_a_job_kueue_cannot_admit_whole_is_refused_naming_the_quota():
    pool = efa_pool()
    # research: 16 nominal on h100-reserved (enough for MIN 2 x 8), may borrow applied's 8: Kueue's potential
    # capacity is min(16 + 8, 0 + (16 + 8)) = 24 of the 32 GPUs that MAX 4 pods need at once.
    teams = _teams({"h100-reserved": 16}, {"h100-reserved": 8, "h100-spot": 32})
    (problem,) = check(prod_job(), teams, [pool, _spot(pool)])
    assert problem.startswith("gpu-train:job: Kueue would not admit job 'gpt2-350m-pretrain' from queue "
                              "gpt2-350m-pretrain-job of team 'research' (4 pods")
    assert "insufficient quota for nvidia.com/gpu in flavor h100-reserved: 4 pods x 8 = 32 > maximum capacity 24" \
        in problem


def test_a_nominal_quota_below_min_nodes_names_the_teams_setting():
    pool = efa_pool()
    teams = _teams({"h100-reserved": 8}, {"h100-reserved": 24})
    problems = check(prod_job(), teams, [pool])
    assert problems == ["gpu-train:teams[0].gpuQuota gives team 'research' 8 GPUs of nominal quota on pool "
                        "'h100-reserved', below the 16 that gpu-train:job.nodes MIN 2 x 8 GPUs need"]


def test_a_pod_that_cannot_fit_its_node_is_refused_naming_the_pool():
    pool = efa_pool()
    heavy = pool.model_copy(update={"fabric": pool.fabric.model_copy(update={"sidecars": [{
        "name": "big", "image": "x", "resources": {"requests": {"cpu": "500", "memory": "1Gi"}}}]})})
    teams = _teams({"h100-reserved": 32}, {"h100-spot": 16})
    (problem,) = check(prod_job(), teams, [heavy, _spot(heavy)])
    assert problem.startswith("gpu-train:job.pool 'h100-reserved' (p5.48xlarge): p5.48xlarge leaves the trainer "
                              "0 CPUs")


def test_overrides_of_the_jobs_own_settings_are_refused_naming_the_setting():
    teams = _teams({"l4-spot": 2}, {})
    problems = check(dev_job(overrides={"train.steps": 5}), teams, [l4_pool()])
    assert problems and problems[0] == ("gpu-train:job.overrides.train.steps is set by gpu-train:job.steps; set that "
                                        "instead")


def test_a_team_without_its_cluster_queue_is_named():
    from gpu_train.spec.contract import Kueue

    teams = _teams({"l4-spot": 2}, {})
    pools = [l4_pool()]
    nvme = NVME["aws"]
    empty = Kueue(cluster_queues=[], resource_flavors=[], limit_range=queues.limit_range(),
                  excluded_resource_prefixes=[])
    assert check_job(dev_job(), pools=pools, teams=queues.team_entries(teams, pools, nvme), kueue=empty,
                     nvme_host_path=nvme, scheme="s3://") == [
        "gpu-train:job.team 'research': ClusterQueue team-research doesn't exist"]


def test_the_platforms_own_settings_are_named_where_they_are_the_culprit():
    """The stack's plan names its settings: the team's quota when Kueue lacks it, the pool's instance type when a
    pod cannot fit its node."""
    pool = efa_pool()
    keys = {"pool_key": "gpu-train:gpuPools[0].instanceType", "quota_key": "gpu-train:teams[0].gpuQuota"}
    teams = _teams({"h100-reserved": 16}, {"h100-reserved": 8, "h100-spot": 32})
    pools = [pool, _spot(pool)]
    nvme = NVME["aws"]

    def named(job, teams, pools):
        return check_job(job, pools=pools, teams=queues.team_entries(teams, pools, nvme),
                         kueue=queues.kueue_objects(teams, pools, {naming.SYSTEM_LABEL: "true"}), nvme_host_path=nvme, scheme="s3://",
                         queue=naming.job_queue_name(job.name), **keys)

    (problem,) = named(prod_job(), teams, pools)
    assert problem.startswith("gpu-train:teams[0].gpuQuota: Kueue would not admit job 'gpt2-350m-pretrain'")
    heavy = pool.model_copy(update={"fabric": pool.fabric.model_copy(update={"sidecars": [{
        "name": "big", "image": "x", "resources": {"requests": {"cpu": "500", "memory": "1Gi"}}}]})})
    (problem,) = named(prod_job(), _teams({"h100-reserved": 32}, {}), [heavy])
    assert problem.startswith("gpu-train:gpuPools[0].instanceType: p5.48xlarge leaves the trainer 0 CPUs")
