"""Kueue's admission arithmetic and the node-allocatable estimate (infra/k8s/admission.py), on
hand-computed cases: every expected number below is worked out in the comment beside it from the
upstream rules the module cites, not read back from the code.

Usage: .venv/bin/pytest tests/infra/k8s/test_admission.py -q
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from infra.k8s import admission as a

GIB = 2**30
MIB = 2**20


def pod(containers, init=(), overhead=None, **spec):
    s = {"containers": list(containers), "initContainers": list(init), **spec}
    if overhead:
        s["overhead"] = overhead
    return s


def c(name, cpu=None, memory=None, limits=None, sidecar=False, **extra):
    requests = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    requests.update(extra)
    out = {"name": name, "resources": {"requests": requests, **({"limits": limits} if limits else {})}}
    if sidecar:
        out["restartPolicy"] = "Always"
    return out


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Fraction(1, 2)), ("4Gi", 4 * GIB), ("1.5", Fraction(3, 2)), ("2k", 2000), ("2e3", 2000),
    ("1E3", 1000), ("2E", 2 * 10**18), (8, 8), ("100Mi", 100 * MIB), ("250u", Fraction(250, 10**6)),
])
def test_quantities_parse_like_kubernetes(text, value):
    assert a.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "4 Gi", "4GB", "abc", "1.2.3", True])
def test_bad_quantities_are_refused(text):
    with pytest.raises(ValueError, match="not a resource quantity"):
        a.parse_quantity(text)


def test_pod_requests_count_sidecars_and_the_largest_init_container():
    spec = pod(
        [c("a", "1", "1Gi"), c("b", "500m", "2Gi")],
        init=[c("s1", "200m", "100Mi", sidecar=True), c("i1", "2", "3Gi")],
        overhead={"cpu": "100m"},
    )
    got = a.pod_requests(spec)
    # containers + sidecars: cpu 1 + 0.5 + 0.2 = 1.7, memory 1Gi + 2Gi + 100Mi;
    # init i1 runs beside the sidecar started before it: cpu 2 + 0.2 = 2.2, memory 3Gi + 100Mi;
    # the larger of the two per resource, plus the 100m overhead: cpu 2.3, memory 3Gi + 100Mi.
    assert got == {"cpu": Fraction(23, 10), "memory": 3 * GIB + 100 * MIB}


def test_excluded_prefixes_drop_fabric_devices():
    spec = pod([c("t", "1", "1Gi", **{"vpc.amazonaws.com/efa": "32", "nvidia.com/gpu": "8"})])
    got = a.pod_requests(spec, excluded_prefixes=("vpc.amazonaws.com/",))
    assert got == {"cpu": 1, "memory": GIB, "nvidia.com/gpu": 8}


def test_limit_range_defaults_and_limits_fill_missing_requests():
    spec = pod([c("plain"), {"name": "limited", "resources": {"limits": {"cpu": "3"}}}])
    memory_only = [{"spec": {"limits": [{"type": "Container", "default": {"memory": "4Gi"},
                                         "defaultRequest": {"memory": "1Gi"}}]}}]
    # plain: memory request 1Gi from defaultRequest, no cpu. limited: no cpu request, so its 3-CPU
    # limit stands in; memory 1Gi from defaultRequest. Total: cpu 3, memory 2Gi.
    assert a.pod_requests(spec, memory_only) == {"cpu": 3, "memory": 2 * GIB}
    with_cpu = [{"spec": {"limits": [{"type": "Container", "default": {"memory": "4Gi"},
                                      "defaultRequest": {"cpu": "500m", "memory": "1Gi"}}]}}]
    # Kueue applies the LimitRange's defaultRequest before it uses limits as requests
    # (pkg/workload/resources.go AdjustResources): limited gets 500m, not its 3-CPU limit. cpu 0.5 + 0.5.
    assert a.pod_requests(spec, with_cpu) == {"cpu": 1, "memory": 2 * GIB}


def test_a_cpu_request_above_a_defaulted_limit_is_refused():
    old = [{"spec": {"limits": [{"type": "Container", "default": {"cpu": "2", "memory": "4Gi"},
                                 "defaultRequest": {"cpu": "500m", "memory": "1Gi"}}]}}]
    trainer = pod([c("trainer", "162", "100Gi", limits={"memory": "100Gi"})])
    assert a.request_limit_problems(trainer, old) == ["container 'trainer' requests 162 cpu but its limit is 2"]
    no_cpu_default = [{"spec": {"limits": [{"type": "Container", "default": {"memory": "4Gi"}}]}}]
    assert a.request_limit_problems(trainer, no_cpu_default) == []


def test_pod_sets_of_a_jobset():
    jobset = {"spec": {"replicatedJobs": [
        {"name": "w", "replicas": 2, "template": {"spec": {"parallelism": 4, "completions": 3, "template": {}}}},
        {"name": "d", "template": {"spec": {"template": {}}}},
    ]}}
    # replicas x min(parallelism, completions): 2 x 3 = 6; defaults (1 replica, parallelism 1) = 1.
    assert [(s.name, s.count) for s in a.workload_pod_sets(jobset)] == [("w", 6), ("d", 1)]


# --------------------------------------------------------------------------- queues and quota


def flavor(name, labels=None, taints=None):
    return {"metadata": {"name": name}, "spec": {"nodeLabels": labels or {"pool": name},
                                                 **({"nodeTaints": taints} if taints else {})}}


def quota(name, nominal, borrow=None, lend=None):
    r = {"name": name, "nominalQuota": nominal}
    if borrow is not None:
        r["borrowingLimit"] = borrow
    if lend is not None:
        r["lendingLimit"] = lend
    return r


def cq(name, flavors, cohort="c", team=None, covered=("cpu", "memory", "nvidia.com/gpu")):
    spec = {"namespaceSelector": {"matchLabels": {"team": team or name}},
            "resourceGroups": [{"coveredResources": list(covered),
                                "flavors": [{"name": f, "resources": rs} for f, rs in flavors]}]}
    if cohort:
        spec["cohortName"] = cohort
    return {"metadata": {"name": name}, "spec": spec}


def lq(namespace, name, cluster_queue):
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": cluster_queue}}


def gpu_pod_set(count, gpus=8, cpu="100", memory="1000Gi", selector=None, tolerations=()):
    spec = pod([c("t", cpu, memory, **{"nvidia.com/gpu": str(gpus)})],
               nodeSelector=selector or {"pool": "p"}, tolerations=list(tolerations))
    return [a.PodSet(name="worker", count=count, template={"spec": spec})]


def resources(gpus, borrow=None, lend=None):
    """cpu, memory and GPU quotas as the platform sets them: 32 CPUs and 512 GiB with every GPU."""
    def per_gpu(n, unit, suffix=""):
        return None if n is None else f"{n * unit}{suffix}" if suffix else n * unit

    return [quota("cpu", 32 * gpus, per_gpu(borrow, 32), per_gpu(lend, 32)),
            quota("memory", f"{512 * gpus}Gi", per_gpu(borrow, 512, "Gi"), per_gpu(lend, 512, "Gi")),
            quota("nvidia.com/gpu", gpus, borrow, lend)]


def run(sets, queues, flavors=(flavor("p"),), ns_labels=None, queue="q"):
    return a.admit(sets, namespace="team-a", namespace_labels=ns_labels or {"team": "a"},
                   local_queues=[lq("team-a", "q", "a")], queue_name=queue, cluster_queues=queues, flavors=flavors)


def test_a_job_within_nominal_quota_is_admitted_on_its_flavor():
    got = run(gpu_pod_set(4), [cq("a", [("p", resources(32, borrow=0, lend=32))])])
    assert got.admitted and got.cluster_queue == "a"
    assert got.flavors == {"worker": {"cpu": "p", "memory": "p", "nvidia.com/gpu": "p"}}
    # 4 pods x 8 GPUs, 4 x 100 CPUs.
    assert got.usage[("p", "nvidia.com/gpu")] == 32 and got.usage[("p", "cpu")] == 400


def test_borrowing_in_the_cohort_is_bounded_by_the_borrowing_limit_and_the_lenders():
    # Team a: 16 nominal, may borrow 8; team b lends all of its 8. Potential for a:
    # min(16 + 8, local 0 + cohort subtree (16 + 8)) = 24 < 32 GPUs that 4 pods of 8 need.
    queues = [cq("a", [("p", resources(16, borrow=8, lend=16))]), cq("b", [("p", resources(8, borrow=16, lend=8))])]
    got = run(gpu_pod_set(4), queues)
    assert not got.admitted
    assert "insufficient quota for nvidia.com/gpu in flavor p: 4 pods x 8 = 32 > maximum capacity 24" in got.problems[0]
    # 3 pods (24 GPUs) fit exactly.
    assert run(gpu_pod_set(3), queues).admitted


def test_a_lending_limit_keeps_quota_out_of_the_cohort():
    # b lends only 4 of its 8: its local quota is 8 - 4 = 4, the cohort's subtree 16 + 4 = 20, so a gets
    # min(16 + 8, 0 + 20) = 20: 2 pods (16) fit, 3 pods (24) do not.
    queues = [cq("a", [("p", resources(16, borrow=8, lend=16))]), cq("b", [("p", resources(8, borrow=16, lend=4))])]
    assert run(gpu_pod_set(2), queues).admitted
    assert "> maximum capacity 20" in run(gpu_pod_set(3), queues).problems[0]


def test_without_a_cohort_only_nominal_quota_counts():
    queues = [cq("a", [("p", resources(16))], cohort=""), cq("b", [("p", resources(64))], cohort="")]
    assert "> maximum capacity 16" in run(gpu_pod_set(3), queues).problems[0]


def test_cpu_and_memory_quota_are_checked_like_gpus():
    # 32 CPUs per GPU: 8 GPUs bring 256 CPUs; one pod asking for 300 does not fit.
    got = run(gpu_pod_set(1, cpu="300"), [cq("a", [("p", resources(8, borrow=0, lend=8))])])
    assert not got.admitted and "insufficient quota for cpu in flavor p: 1 pods x 300 = 300 > maximum capacity 256" \
        in got.problems[0]


def test_flavors_are_tried_in_order_skipping_mismatched_and_tainted_ones():
    flavors = [flavor("x", {"pool": "x"}), flavor("t", {"pool": "p"}, taints=[{"key": "k", "value": "v",
                                                                                 "effect": "NoSchedule"}]),
               flavor("p", {"pool": "p"})]
    queues = [cq("a", [("x", resources(64)), ("t", resources(64)), ("p", resources(64))])]
    got = run(gpu_pod_set(1), queues, flavors=flavors)
    assert got.admitted and got.flavors["worker"]["nvidia.com/gpu"] == "p"
    tolerated = run(gpu_pod_set(1, tolerations=[{"key": "k", "operator": "Exists"}]), queues, flavors=flavors)
    assert tolerated.flavors["worker"]["nvidia.com/gpu"] == "t"
    none = run(gpu_pod_set(1, selector={"pool": "zzz"}), queues, flavors=flavors)
    assert not none.admitted and "doesn't match node affinity" in none.problems[0]


def test_a_resource_no_group_covers_is_unavailable():
    spec = pod([c("t", "1", "1Gi", **{"example.com/widget": "1"})], nodeSelector={"pool": "p"})
    sets = [a.PodSet(name="worker", count=1, template={"spec": spec})]
    got = run(sets, [cq("a", [("p", resources(8))])])
    assert got.problems == ("pod set worker: resource example.com/widget unavailable in ClusterQueue a",)


def test_queue_and_namespace_must_line_up():
    queues = [cq("a", [("p", resources(8))])]
    assert "doesn't match ClusterQueue a's namespaceSelector" in run(gpu_pod_set(1), queues,
                                                                     ns_labels={"team": "b"}).problems[0]
    assert "LocalQueue team-a/nope doesn't exist" in run(gpu_pod_set(1), queues, queue="nope").problems[0]
    assert "ClusterQueue a doesn't exist" in run(gpu_pod_set(1), [cq("z", [("p", resources(8))])]).problems[0]


# --------------------------------------------------------------------------- nodes


def test_eks_allocatable_follows_the_ami_formula():
    # p5.48xlarge: 192 vCPUs, 2048 GiB, 100 pods (VPC CNI eni-max-pods).
    # cpu reserved: 0.06 + 0.01 + 2 x 0.005 + 188 x 0.0025 = 0.55 -> 191.45 cores.
    # memory: 2048 GiB x 0.925 = 1894.4 GiB, less (11 x 100 + 255) MiB and 100 MiB eviction.
    got = a.node_allocatable("aws", vcpus=192, memory_gib=2048, gpus=8, max_pods=100)
    assert got.cpu == Fraction(19145, 100)
    assert got.memory == Fraction(18944, 10) * GIB - 1355 * MIB - 100 * MIB


def test_gke_allocatable_follows_the_published_tiers():
    # g2-standard-8: 8 vCPUs, 32 GiB. cpu reserved 0.06 + 0.01 + 0.005 x 2 + 0.0025 x 4 = 0.09 -> 7.91.
    # memory seen: 29.6 GiB; reserved 25% of 4 + 20% of 4 + 10% of 8 + 6% of the 13.6 above 16
    # = 1 + 0.8 + 0.8 + 0.816 = 3.416 GiB; less 100 MiB eviction.
    got = a.node_allocatable("gcp", vcpus=8, memory_gib=32, gpus=1)
    assert got.cpu == Fraction(791, 100)
    assert got.memory == Fraction(296, 10) * GIB - Fraction(3416, 1000) * GIB - 100 * MIB


def test_gpu_node_capacity_leaves_the_agents_their_budget():
    node = a.gpu_node_capacity("aws", "p5.48xlarge")
    alloc = a.node_allocatable("aws", vcpus=192, memory_gib=2048, gpus=8, max_pods=100)
    assert node.cpu == alloc.cpu - a.GPU_NODE_AGENTS.cpu and node.memory == alloc.memory - a.GPU_NODE_AGENTS.memory
    assert node.gpus == 8


def test_every_aws_catalog_type_has_its_eni_pod_limit():
    from infra.aws.catalog import CATALOG

    assert set(CATALOG) <= set(a.ENI_MAX_PODS)


def test_pod_fits_node_names_what_does_not_fit():
    node = a.NodeResources(cpu=Fraction(10), memory=Fraction(20 * GIB), gpus=8)
    assert a.pod_fits_node(pod([c("t", "10", "20Gi", **{"nvidia.com/gpu": "8"})]), node) == []
    too_big = a.pod_fits_node(pod([c("t", "11", "21Gi", **{"nvidia.com/gpu": "9"})]), node)
    assert too_big == ["cpu: the pod requests 11, the node leaves 10",
                       "memory: the pod requests 21Gi, the node leaves 20Gi",
                       "nvidia.com/gpu: the pod requests 9, the node leaves 8"]


def test_the_timeouts_must_nest():
    assert a.timeout_problems(rendezvous_s=35 * 60, key="k") == []
    assert a.PODS_READY_TIMEOUT_S >= a.GPU_NODE_STARTUP_S
    short_rdzv = a.timeout_problems(rendezvous_s=600, key="gpu-train:job.rendezvousTimeoutMinutes")
    assert short_rdzv and short_rdzv[0].startswith("gpu-train:job.rendezvousTimeoutMinutes is 10 minutes")
    short_ready = a.timeout_problems(rendezvous_s=3600, key="k", node_startup_s=1200, pods_ready_s=600)
    assert short_ready and "shorter than a GPU node's start" in short_ready[0]
