"""Kueue's objects for the teams' queues: one ResourceFlavor per GPU pool and one for the CPU (system) nodes, one
ClusterQueue per team in one cohort, a LocalQueue per team namespace, the namespaces' LimitRange; and each team as a
job sees it.

Usage:
    flavors = [cpu_flavor(system_nodes), *(resource_flavor(p) for p in pools)]   # pools: contract.GpuPool
    queues = cluster_queues(teams, pools)                 # teams: gpu_train.spec.settings.TeamSettings
    team_entries(teams, pools, nvme_host_path)            # contract Teams: namespace, queues, quota, workdir

The stack creates these objects (infra/k8s/tenancy.py) and publishes them in the platform contract; a job is
checked against exactly them (gpu_train.jobs.check), whether the stack plans it or a team member submits it.
Field names follow apis/kueue/v1beta2 at tag v0.19.2 of github.com/kubernetes-sigs/kueue: a ClusterQueue names
its cohort in `cohortName`.

CPU work (data preparation's Ray pods, gpu_train/jobs/prepare.py) is admitted against the `cpu` flavor, whose node
labels select the system nodes: Kueue adds them to an admitted pod set's node selector
(https://kueue.sigs.k8s.io/docs/concepts/resource_flavor/). A GPU pool's flavor names its nodes' taints
(`nodeTaints`), and Kueue gives a flavor only to a pod set that tolerates them: CPU work, which does not, is never
admitted on a GPU pool. (A node selector alone would not keep it off: Kueue 0.19.2 matches a pod set against a
flavor on that flavor's own label keys only, pkg/scheduler/flavorassigner/flavorassigner.go.) The `cpu` flavor
comes first in each ClusterQueue; it holds no GPU quota, so a pod set asking for GPUs never fits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool, Kueue, Team
from gpu_train.spec.settings import TeamSettings, pool_quotas

KUEUE_API = "kueue.x-k8s.io/v1beta2"
# CPU and memory quota that comes with each GPU of quota: above the largest per-GPU share of any supported machine
# (a4-highgpu-8g: 28 vCPU and 496 GiB per GPU), so GPU quota, not CPU or memory, is what limits a team.
CPU_PER_GPU = 32
MEMORY_GIB_PER_GPU = 512
# Fabric devices requested next to GPUs come with the node, so Kueue does not count them: AWS's EFA devices
# (vpc.amazonaws.com/efa) and the per-network resources GKE's multi-networking adds to pods (networking.gke.io...).
EXCLUDED_RESOURCE_PREFIXES = ("vpc.amazonaws.com/", "networking.gke.io")


def team_pool_quotas(team: TeamSettings, pools: Sequence[GpuPool]) -> dict[str, int]:
    """The team's nominal GPUs on every pool, from its `gpuQuota` setting."""
    return pool_quotas(team.gpu_quota, [p.name for p in pools])


def pool_taints(tolerations: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """The taints a pool's nodes carry: its tolerations turned around (those with an effect)."""
    return [{"key": t["key"], "value": t.get("value", ""), "effect": t["effect"]} for t in tolerations
            if t.get("effect")]


def resource_flavor(pool: GpuPool) -> dict[str, Any]:
    """ResourceFlavor for a pool: its node labels (pool + capacity type) and its nodes' taints (the GPU taint).
    Kueue assigns the flavor only to a pod set that tolerates those taints itself (a job's pods carry the pool's
    tolerations, gpu_train.jobs.pods): a pod set that does not, CPU work, is never given a GPU pool."""
    labels = {**pool.node_selector, naming.POOL_LABEL: pool.name, naming.CAPACITY_LABEL: pool.capacity}
    return {
        "apiVersion": KUEUE_API, "kind": "ResourceFlavor",
        "metadata": {"name": pool.name, "labels": {naming.CAPACITY_LABEL: pool.capacity}},
        "spec": {"nodeLabels": labels, "nodeTaints": pool_taints(pool.tolerations)},
    }


def cpu_flavor(cpu_nodes: Mapping[str, str]) -> dict[str, Any]:
    """ResourceFlavor of the CPU (system) nodes: their node selector (the platform's system_node_selector), no
    taint to tolerate."""
    if not cpu_nodes:
        raise ValueError("the CPU flavor needs the system nodes' node selector (platform.system_node_selector)")
    return {
        "apiVersion": KUEUE_API, "kind": "ResourceFlavor",
        "metadata": {"name": naming.CPU_FLAVOR},
        "spec": {"nodeLabels": dict(cpu_nodes)},
    }


def _quota(name: str, nominal: int | str, borrow: int | str, lend: int | str) -> dict[str, Any]:
    return {"name": name, "nominalQuota": nominal, "borrowingLimit": borrow, "lendingLimit": lend}


def cluster_queues(teams: Sequence[TeamSettings], pools: Sequence[GpuPool]) -> list[dict[str, Any]]:
    """One ClusterQueue per team in one cohort. First the `cpu` flavor: the team's `prepareQuota` of CPU and memory
    and no GPUs. Per pool flavor: the team's nominal GPUs on that pool. The team may lend all of a flavor's quota
    while idle and borrow what the other teams have there (reclaimed by preemption). On a pool, CPU and memory
    quota come with each GPU."""
    if not pools:
        raise ValueError("cluster queues need at least one GPU pool")
    shares = {t.name: team_pool_quotas(t, pools) for t in teams}
    queues = []
    for team in teams:
        prep = team.prepare_quota
        cpus = sum(o.prepare_quota.cpus for o in teams if o.name != team.name)
        mem = sum(o.prepare_quota.memory_gi for o in teams if o.name != team.name)
        flavors = [{"name": naming.CPU_FLAVOR, "resources": [
            _quota("cpu", prep.cpus, cpus, prep.cpus),
            _quota("memory", f"{prep.memory_gi}Gi", f"{mem}Gi", f"{prep.memory_gi}Gi"),
            _quota(naming.GPU_RESOURCE, 0, 0, 0),
        ]}]
        for pool in pools:
            gpus = shares[team.name][pool.name]
            others = sum(shares[o.name][pool.name] for o in teams if o.name != team.name)
            flavors.append({"name": pool.name, "resources": [
                _quota("cpu", gpus * CPU_PER_GPU, others * CPU_PER_GPU, gpus * CPU_PER_GPU),
                _quota("memory", f"{gpus * MEMORY_GIB_PER_GPU}Gi", f"{others * MEMORY_GIB_PER_GPU}Gi",
                       f"{gpus * MEMORY_GIB_PER_GPU}Gi"),
                _quota(naming.GPU_RESOURCE, gpus, others, gpus),
            ]})
        queues.append({
            "apiVersion": KUEUE_API, "kind": "ClusterQueue",
            "metadata": {"name": naming.cluster_queue_name(team.name), "labels": {naming.TEAM_LABEL: team.name}},
            "spec": {
                "cohortName": naming.COHORT,
                "namespaceSelector": {"matchLabels": {naming.TEAM_LABEL: team.name}},
                "queueingStrategy": "BestEffortFIFO",
                "resourceGroups": [{"coveredResources": ["cpu", "memory", naming.GPU_RESOURCE], "flavors": flavors}],
                "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority",
                               "borrowWithinCohort": {"policy": "Never"}},
            },
        })
    return queues


# Kueue WorkloadPriorityClasses (apis/kueue/v1beta2 at v0.19.2: cluster-scoped, `value` and `description` at the
# top level). A job names one through its JobSet's kueue.x-k8s.io/priority-class label (gpu_train.jobs.jobset).
# Production jobs outrank sweep trials: in a team's ClusterQueue (withinClusterQueue: LowerPriority) a production job
# preempts trials, and sweeps, below every workload without a class (priority 0), are the first to be preempted.
PRIORITY_VALUES = {"production": 1000, "sweep": -1000}
PRIORITY_TEXT = {"production": "gpu-train jobs: preempt sweep trials in the team's queue",
                 "sweep": "gpu-train sweep trials: borrow idle quota, preempted first"}


def workload_priority_classes() -> list[dict[str, Any]]:
    """The platform's WorkloadPriorityClasses, one per JobSpec.priority_class value."""
    return [{"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass",
             "metadata": {"name": naming.priority_class_name(kind)}, "value": value,
             "description": PRIORITY_TEXT[kind]} for kind, value in PRIORITY_VALUES.items()]


def local_queue(team: str) -> dict[str, Any]:
    return {
        "apiVersion": KUEUE_API, "kind": "LocalQueue",
        "metadata": {"name": naming.local_queue_name(team), "namespace": naming.team_namespace(team)},
        "spec": {"clusterQueue": naming.cluster_queue_name(team)},
    }


def limit_range() -> dict[str, Any]:
    """Defaults for containers that name no resources (the trainer sets its own). No default CPU limit:
    the LimitRanger would give it to the trainer, which sets no CPU limit on purpose, and its CPU
    request above that default would make the API server refuse the pods."""
    return {"limits": [{
        "type": "Container",
        "default": {"memory": "4Gi"},
        "defaultRequest": {"cpu": "500m", "memory": "1Gi"},
    }]}


def team_entries(teams: Sequence[TeamSettings], pools: Sequence[GpuPool], nvme_host_path: str) -> list[Team]:
    """Each team as its jobs see it: namespace, queues, nominal quota per pool, service account, NVMe workdir."""
    out = []
    for team in teams:
        ns = naming.team_namespace(team.name)
        out.append(Team(
            name=team.name, namespace=ns, namespace_labels=naming.namespace_labels(team.name),
            local_queue=naming.local_queue_name(team.name), cluster_queue=naming.cluster_queue_name(team.name),
            gpu_quota=team_pool_quotas(team, pools), service_account=naming.TRAINER_SERVICE_ACCOUNT,
            nvme_workdir=naming.workdir_path(nvme_host_path, ns), submitters=list(team.submitters),
            viewers=list(team.viewers)))
    return out


def kueue_objects(teams: Sequence[TeamSettings], pools: Sequence[GpuPool], cpu_nodes: Mapping[str, str]) -> Kueue:
    """The queue objects a job is admitted against, as the platform contract carries them; `cpu_nodes` is the
    platform's system_node_selector."""
    return Kueue(cluster_queues=cluster_queues(teams, pools),
                 resource_flavors=[cpu_flavor(cpu_nodes), *(resource_flavor(p) for p in pools)],
                 limit_range=limit_range(), excluded_resource_prefixes=list(EXCLUDED_RESOURCE_PREFIXES))
