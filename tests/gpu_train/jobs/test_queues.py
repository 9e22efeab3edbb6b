"""Kueue's objects for the teams' queues (gpu_train/jobs/queues.py): ClusterQueues from per-pool quotas in one
cohort, what Kueue lets a team use of them (worked out from Kueue's cohort rules, gpu_train.jobs.fit), the
ResourceFlavors, the namespaces' LimitRange, and the CPU and memory quota that comes with each GPU. Pure, no
mocks: `pytest tests/gpu_train/jobs/test_queues.py`.
"""

from __future__ import annotations

import pytest

from gpu_train.jobs import fit, queues
from gpu_train.spec import naming
from gpu_train.spec.catalog import aws, gcp
from gpu_train.spec.contract import Fabric, GpuPool
from gpu_train.spec.settings import PrepareQuotaSettings, TeamSettings

SYSTEM = {naming.SYSTEM_LABEL: "true"}


def pool(name, gpus=8, max_nodes=4, capacity="spot"):
    return GpuPool(name=name, instance_type="p5.48xlarge", capacity=capacity, gpu_type="H100", gpus_per_node=gpus,
                   min_nodes=0, max_nodes=max_nodes, zone="", node_selector={naming.POOL_LABEL: name},
                   tolerations=naming.gpu_tolerations(), fabric=Fabric(kind="none"), provisioner="karpenter")


def test_cluster_queues_carry_each_teams_quota_per_pool_and_borrow_in_one_cohort():
    teams = (TeamSettings(name="research", gpu_quota={"reserved": 32, "spot": 16}),
             TeamSettings(name="applied", gpu_quota={"spot": 16}))
    pools = [pool("reserved"), pool("spot")]
    by_name = {q["metadata"]["name"]: q for q in queues.cluster_queues(teams, pools)}
    assert set(by_name) == {"team-research", "team-applied"}
    expected = {"team-research": {"reserved": (32, 0), "spot": (16, 16)},
                "team-applied": {"reserved": (0, 32), "spot": (16, 16)}}  # (nominal, borrowing limit)
    for q in by_name.values():
        # The CPU flavor first, then the pools': it is the data preparation's, and holds no GPU.
        assert [f["name"] for f in q["spec"]["resourceGroups"][0]["flavors"]] == ["cpu", "reserved", "spot"]
    for name, want in expected.items():
        q = by_name[name]
        assert q["apiVersion"] == "kueue.x-k8s.io/v1beta2"
        spec = q["spec"]
        assert spec["cohortName"] == naming.COHORT and "cohort" not in spec  # v1beta2 renamed the field
        (group,) = spec["resourceGroups"]
        assert group["coveredResources"] == ["cpu", "memory", "nvidia.com/gpu"]
        for f in group["flavors"]:
            by = {r["name"]: r for r in f["resources"]}
            assert [r["name"] for r in f["resources"]] == group["coveredResources"]
            if f["name"] == naming.CPU_FLAVOR:
                continue
            nominal, borrow = want[f["name"]]
            assert (by["nvidia.com/gpu"]["nominalQuota"], by["nvidia.com/gpu"]["borrowingLimit"]) == (nominal, borrow)
            assert by["nvidia.com/gpu"]["lendingLimit"] == nominal
            assert by["cpu"]["nominalQuota"] == nominal * queues.CPU_PER_GPU
            assert by["memory"]["nominalQuota"] == f"{nominal * queues.MEMORY_GIB_PER_GPU}Gi"


def test_the_cpu_flavor_holds_each_teams_prepare_quota_and_no_gpu_and_borrows_the_others():
    teams = (TeamSettings(name="research", gpu_quota=8, prepare_quota=PrepareQuotaSettings(cpus=24, memory_gi=96)),
             TeamSettings(name="applied", gpu_quota=8))  # the default: 8 CPUs, 32 GiB
    default = PrepareQuotaSettings()
    qs = queues.cluster_queues(teams, [pool("p")])
    for q, (cpus, gib), (other_cpus, other_gib) in zip(qs, ((24, 96), (default.cpus, default.memory_gi)),
                                                        ((default.cpus, default.memory_gi), (24, 96)), strict=True):
        cpu = next(f for f in q["spec"]["resourceGroups"][0]["flavors"] if f["name"] == naming.CPU_FLAVOR)
        by = {r["name"]: r for r in cpu["resources"]}
        assert (by["cpu"]["nominalQuota"], by["cpu"]["borrowingLimit"], by["cpu"]["lendingLimit"]) == \
            (cpus, other_cpus, cpus)
        assert (by["memory"]["nominalQuota"], by["memory"]["borrowingLimit"]) == (f"{gib}Gi", f"{other_gib}Gi")
        assert (by["nvidia.com/gpu"]["nominalQuota"], by["nvidia.com/gpu"]["borrowingLimit"]) == (0, 0)
        assert fit.potential_capacity(q, qs, naming.CPU_FLAVOR, "cpu") == 24 + default.cpus
        assert fit.potential_capacity(q, qs, naming.CPU_FLAVOR, "nvidia.com/gpu") == 0


def test_the_cpu_flavor_selects_the_system_nodes_and_no_gpu_pool_shares_its_labels():
    flavor = queues.cpu_flavor(SYSTEM)
    assert flavor["metadata"]["name"] == naming.CPU_FLAVOR
    assert flavor["spec"] == {"nodeLabels": SYSTEM}  # no taint to tolerate, no GPU pool's labels
    assert not set(SYSTEM) & set(queues.resource_flavor(pool("p"))["spec"]["nodeLabels"])
    with pytest.raises(ValueError, match="system_node_selector"):
        queues.cpu_flavor({})


def test_one_number_of_gpus_applies_to_every_pool():
    team = TeamSettings(name="a", gpu_quota=8)
    # The settings checks refuse a number above any pool's capacity, as they refuse such a mapping entry.
    assert queues.team_pool_quotas(team, [pool("reserved"), pool("small", max_nodes=1)]) == \
        {"reserved": 8, "small": 8}


def test_a_team_may_use_its_nominal_quota_plus_what_the_others_lend():
    # research 32 + applied 16 on one pool: Kueue's potential capacity for research is
    # min(32 + 16, 0 + (32 + 16)) = 48, for applied min(16 + 32, 48) = 48.
    teams = (TeamSettings(name="research", gpu_quota={"p": 32}), TeamSettings(name="applied", gpu_quota={"p": 16}))
    cluster_queues = queues.cluster_queues(teams, [pool("p", max_nodes=6)])
    for q in cluster_queues:
        assert fit.potential_capacity(q, cluster_queues, "p", "nvidia.com/gpu") == 48
        # CPU and memory follow the GPUs: 48 x 32 CPUs and 48 x 512 GiB.
        assert fit.potential_capacity(q, cluster_queues, "p", "cpu") == 48 * 32
        assert fit.potential_capacity(q, cluster_queues, "p", "memory") == 48 * 512 * 2**30


def test_limit_range_gives_no_cpu_limit_that_the_trainer_would_exceed():
    trainer = {"containers": [{"name": "trainer", "resources": {
        "requests": {"cpu": "187", "memory": "1880Gi", "nvidia.com/gpu": "8"},
        "limits": {"memory": "1880Gi", "nvidia.com/gpu": "8"}}}]}
    assert fit.request_limit_problems(trainer, queues.limit_range()) == []
    (item,) = queues.limit_range()["limits"]
    assert "cpu" not in item["default"] and item["defaultRequest"]["cpu"] == "500m"


def test_namespaces_are_selected_by_their_cluster_queue_and_managed_by_kueue():
    labels = naming.namespace_labels("research")
    (q,) = queues.cluster_queues((TeamSettings(name="research", gpu_quota=8),), [pool("p")])
    assert q["spec"]["namespaceSelector"]["matchLabels"].items() <= labels.items()
    assert labels[naming.KUEUE_MANAGED_LABEL] == "true"


def test_cpu_and_memory_per_gpu_cover_every_catalog_machine():
    for name, spec in [*aws.CATALOG.items(), *gcp.CATALOG.items()]:
        if spec.gpus:
            assert spec.vcpus / spec.gpus <= queues.CPU_PER_GPU, name
            assert spec.memory_gib / spec.gpus <= queues.MEMORY_GIB_PER_GPU, name


def test_resource_flavor_selects_the_pool_and_its_capacity_type():
    flavor = queues.resource_flavor(pool("h100-spot", capacity="spot"))
    assert flavor["spec"]["nodeLabels"] == {naming.POOL_LABEL: "h100-spot", naming.CAPACITY_LABEL: "spot"}
    # The GPU taint as the nodes carry it: Kueue gives the flavor only to pod sets that tolerate it themselves.
    assert flavor["spec"]["nodeTaints"] == [{k: naming.GPU_TAINT[k] for k in ("key", "value", "effect")}]
    assert "tolerations" not in flavor["spec"]


def test_team_entries_are_each_teams_namespace_queues_quota_and_workdir():
    teams = (TeamSettings(name="research", gpu_quota={"p": 8}, submitters=("g",)),)
    (team,) = queues.team_entries(teams, [pool("p")], "/mnt/nvme")
    assert (team.namespace, team.local_queue, team.cluster_queue) == ("team-research", "research-queue",
                                                                     "team-research")
    assert team.gpu_quota == {"p": 8} and team.nvme_workdir == "/mnt/nvme/gpu-train/team-research"
    assert team.namespace_labels == naming.namespace_labels("research") and team.submitters == ["g"]
    kueue = queues.kueue_objects(teams, [pool("p")], SYSTEM)
    assert kueue.cluster_queues == queues.cluster_queues(teams, [pool("p")])
    assert kueue.resource_flavors == [queues.cpu_flavor(SYSTEM), queues.resource_flavor(pool("p"))]
    assert kueue.excluded_resource_prefixes == list(queues.EXCLUDED_RESOURCE_PREFIXES)
