"""Is a job possible on a platform? Its settings, then its rendered JobSet against the team's queue and its pool's
nodes: the checks the stack's plan and `gpu-train submit` both run, before anything exists.

Usage:
    problems = check_job(job, pools=contract.pools, teams=contract.teams, kueue=contract.kueue,
                         nvme_host_path=contract.nvme_host_path, scheme="s3://", pod_env=contract.pod_env)

Every problem is one line naming the setting: the job's own (gpu_train.spec.job.job_problems: its settings, its
command, its image pinned and from an admitted registry), its layout and memory at every world size
(gpu_train.sizing.job.layout_problems), then why Kueue
would never admit its JobSet, all MAX pods at once (gpu_train.jobs.fit.queue_problems), and what a pod asks beyond
what a node of its pool leaves it (fit.node_problems).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpu_train.jobs import fit
from gpu_train.jobs.jobset import JobSpecError, Placement, jobset
from gpu_train.sizing.job import layout_problems
from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool, Kueue, Team
from gpu_train.spec.job import JobSpec, job_problems

# An image reference for rendering a job's JobSet before its image exists.
PLACEHOLDER_IMAGE = "registry.invalid/gpu-train/trainer@sha256:" + "0" * 64


def check_job(job: JobSpec, *, pools: Sequence[GpuPool], teams: Sequence[Team], kueue: Kueue, nvme_host_path: str,
              scheme: str, pod_env: Mapping[str, str] | None = None, key: str = f"{naming.PROJECT}:job",
              queue: str = "", pool_key: str = "", quota_key: str = "", registries: Sequence[str] | None = None,
              repositories: Sequence[str] = ()) -> list[str]:
    """Every reason the job cannot run on this platform ([] when it can), each naming its setting. `queue` is the
    LocalQueue it goes to (default: its team's). Where the platform's own settings are at hand (the stack's plan),
    `pool_key` names the pool's instance type setting, the culprit when a pod cannot fit a node, and `quota_key` the
    team's quota setting, the culprit when Kueue lacks the quota; by default both problems name the job's.
    `registries` and `repositories` are the images the team namespaces admit (the contract's); None checks a job's
    own image for its digest only."""
    problems = job_problems(job, pools=pools, teams=teams, scheme=scheme, key=key, registries=registries,
                            repositories=repositories) + layout_problems(job, pools=pools, key=key)
    pool = next((p for p in pools if p.name == job.pool), None)
    team = next((t for t in teams if t.name == job.team), None)
    if problems or pool is None or team is None:
        return problems
    where = Placement(pool=pool, image=PLACEHOLDER_IMAGE, queue=queue or team.local_queue,
                      nvme_host_path=nvme_host_path, datasets_bucket=f"{scheme}bucket",
                      checkpoints_bucket=f"{scheme}bucket", pod_env=dict(pod_env or {}))
    try:
        manifest = jobset(job, where)
    except JobSpecError as exc:
        return [f"{pool_key or f'{key}.pool {pool.name!r} ({pool.instance_type})'}: {exc}"]
    cq = next((q for q in kueue.cluster_queues if q["metadata"]["name"] == team.cluster_queue), None)
    if cq is None:
        return [f"{key}.team {team.name!r}: ClusterQueue {team.cluster_queue} doesn't exist"]
    count = fit.pod_sets(manifest)[0][1]
    for p in fit.queue_problems(manifest, cluster_queue=cq, cluster_queues=kueue.cluster_queues, flavor=pool.name,
                                namespace_labels=team.namespace_labels, limit_range=kueue.limit_range,
                                excluded_prefixes=kueue.excluded_resource_prefixes):
        culprit = quota_key if quota_key and "insufficient quota" in p else key
        problems.append(f"{culprit}: Kueue would not admit job {job.name!r} from queue {where.queue} of team "
                        f"{team.name!r} ({count} pods, admitted whole): {p}")
    pod_spec = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    for p in fit.node_problems(pod_spec, pool.allocatable.document() if pool.allocatable else {"cpu": 0, "memory": 0},
                               gpus=pool.gpus_per_node, limit_range=kueue.limit_range):
        problems.append(f"{pool_key or f'{key}.pool {pool.name!r}'}: a pod of job {job.name!r} does not fit a "
                        f"{pool.instance_type} node: {p}")
    return problems
