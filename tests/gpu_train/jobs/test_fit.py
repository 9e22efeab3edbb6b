"""Kueue's admission arithmetic and a pod's fit on its node (gpu_train/jobs/fit.py), on hand-computed cases:
every expected number below is worked out in the comment beside it from the upstream rules the module cites
(Kueue v0.19.2, Kubernetes' PodRequests and quantity grammar), not read back from the code.

Usage: .venv/bin/pytest tests/gpu_train/jobs/test_fit.py -q
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from gpu_train.jobs import fit

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
    assert fit.quantity(text) == value


@pytest.mark.parametrize("text", ["", "4 Gi", "4GB", "abc", "1.2.3", True, "NaN", "1_000", " 4"])
def test_bad_quantities_are_refused(text):
    # Kubernetes' grammar (k8s.io/apimachinery/pkg/api/resource/quantity.go): a signed decimal number, then one
    # binary or decimal SI suffix or a decimal exponent, nothing else.
    with pytest.raises(ValueError, match="not a resource quantity"):
        fit.quantity(text)


def test_pod_requests_count_sidecars_and_the_largest_init_container():
    spec = pod(
        [c("a", "1", "1Gi"), c("b", "500m", "2Gi")],
        init=[c("s1", "200m", "100Mi", sidecar=True), c("i1", "2", "3Gi")],
        overhead={"cpu": "100m"},
    )
    got = fit.pod_requests(spec)
    # containers + sidecars: cpu 1 + 0.5 + 0.2 = 1.7, memory 1Gi + 2Gi + 100Mi;
    # init i1 runs beside the sidecar started before it: cpu 2 + 0.2 = 2.2, memory 3Gi + 100Mi;
    # the larger of the two per resource, plus the 100m overhead: cpu 2.3, memory 3Gi + 100Mi.
    assert got == {"cpu": Fraction(23, 10), "memory": 3 * GIB + 100 * MIB}


def test_excluded_prefixes_drop_fabric_devices():
    spec = pod([c("t", "1", "1Gi", **{"vpc.amazonaws.com/efa": "32", "nvidia.com/gpu": "8"})])
    got = fit.pod_requests(spec, excluded_prefixes=("vpc.amazonaws.com/",))
    assert got == {"cpu": 1, "memory": GIB, "nvidia.com/gpu": 8}


def test_limit_range_defaults_and_limits_fill_missing_requests():
    spec = pod([c("plain"), {"name": "limited", "resources": {"limits": {"cpu": "3"}}}])
    memory_only = {"limits": [{"type": "Container", "default": {"memory": "4Gi"}, "defaultRequest": {"memory": "1Gi"}}]}
    # plain: memory request 1Gi from defaultRequest, no cpu. limited: no cpu request, so its 3-CPU
    # limit stands in; memory 1Gi from defaultRequest. Total: cpu 3, memory 2Gi.
    assert fit.pod_requests(spec, memory_only) == {"cpu": 3, "memory": 2 * GIB}
    with_cpu = {"limits": [{"type": "Container", "default": {"memory": "4Gi"},
                            "defaultRequest": {"cpu": "500m", "memory": "1Gi"}}]}
    # Kueue applies the LimitRange's defaultRequest before it uses limits as requests
    # (pkg/workload/resources.go AdjustResources): limited gets 500m, not its 3-CPU limit. cpu 0.5 + 0.5.
    assert fit.pod_requests(spec, with_cpu) == {"cpu": 1, "memory": 2 * GIB}


def test_a_cpu_request_above_a_defaulted_limit_is_refused():
    old = {"limits": [{"type": "Container", "default": {"cpu": "2", "memory": "4Gi"},
                       "defaultRequest": {"cpu": "500m", "memory": "1Gi"}}]}
    trainer = pod([c("trainer", "162", "100Gi", limits={"memory": "100Gi"})])
    assert fit.request_limit_problems(trainer, old) == ["container 'trainer' requests 162 cpu but its limit is 2"]
    no_cpu_default = {"limits": [{"type": "Container", "default": {"memory": "4Gi"}}]}
    assert fit.request_limit_problems(trainer, no_cpu_default) == []


def test_pod_sets_of_a_jobset():
    jobset = {"spec": {"replicatedJobs": [
        {"name": "w", "replicas": 2, "template": {"spec": {"parallelism": 4, "completions": 3, "template": {"spec": {}}}}},
        {"name": "d", "template": {"spec": {"template": {"spec": {}}}}},
    ]}}
    # replicas x min(parallelism, completions): 2 x 3 = 6; defaults (1 replica, parallelism 1) = 1.
    assert [(name, count) for name, count, _ in fit.pod_sets(jobset)] == [("w", 6), ("d", 1)]


# --------------------------------------------------------------------------- queues and quota


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


def resources(gpus, borrow=None, lend=None):
    """cpu, memory and GPU quotas as the platform sets them: 32 CPUs and 512 GiB with every GPU."""
    def per_gpu(n, unit, suffix=""):
        return None if n is None else f"{n * unit}{suffix}" if suffix else n * unit

    return [quota("cpu", 32 * gpus, per_gpu(borrow, 32), per_gpu(lend, 32)),
            quota("memory", f"{512 * gpus}Gi", per_gpu(borrow, 512, "Gi"), per_gpu(lend, 512, "Gi")),
            quota("nvidia.com/gpu", gpus, borrow, lend)]


def jobset(count, gpus=8, cpu="100", memory="1000Gi", extra=None):
    spec = pod([c("t", cpu, memory, **{"nvidia.com/gpu": str(gpus), **(extra or {})})], nodeSelector={"pool": "p"})
    return {"metadata": {"name": "j", "namespace": "team-a"}, "spec": {"replicatedJobs": [{
        "name": "worker", "replicas": 1,
        "template": {"spec": {"parallelism": count, "completions": count, "template": {"spec": spec}}}}]}}


def problems(manifest, queues, queue="a", ns_labels=None):
    own = next(q for q in queues if q["metadata"]["name"] == queue)
    return fit.queue_problems(manifest, cluster_queue=own, cluster_queues=queues, flavor="p",
                              namespace_labels=ns_labels or {"team": "a"})


def test_a_job_within_nominal_quota_is_admitted():
    # 4 pods x 8 GPUs = 32 of 32 nominal; 4 x 100 CPUs = 400 of 32 x 32 = 1024.
    assert problems(jobset(4), [cq("a", [("p", resources(32, borrow=0, lend=32))])]) == []


def test_borrowing_in_the_cohort_is_bounded_by_the_borrowing_limit_and_the_lenders():
    # Team a: 16 nominal, may borrow 8; team b lends all of its 8. Potential for a:
    # min(16 + 8, local 0 + cohort subtree (16 + 8)) = 24 < 32 GPUs that 4 pods of 8 need.
    queues = [cq("a", [("p", resources(16, borrow=8, lend=16))]), cq("b", [("p", resources(8, borrow=16, lend=8))])]
    assert fit.potential_capacity(queues[0], queues, "p", "nvidia.com/gpu") == 24
    got = problems(jobset(4), queues)
    assert got == ["pod set worker: insufficient quota for nvidia.com/gpu in flavor p: 4 pods x 8 = 32 > maximum "
                   "capacity 24"]
    # 3 pods (24 GPUs) fit exactly.
    assert problems(jobset(3), queues) == []


def test_a_lending_limit_keeps_quota_out_of_the_cohort():
    # b lends only 4 of its 8: its local quota is 8 - 4 = 4, the cohort's subtree 16 + 4 = 20, so a gets
    # min(16 + 8, 0 + 20) = 20: 2 pods (16) fit, 3 pods (24) do not.
    queues = [cq("a", [("p", resources(16, borrow=8, lend=16))]), cq("b", [("p", resources(8, borrow=16, lend=4))])]
    assert fit.potential_capacity(queues[0], queues, "p", "nvidia.com/gpu") == 20
    assert problems(jobset(2), queues) == []
    assert "> maximum capacity 20" in problems(jobset(3), queues)[0]


def test_without_a_borrowing_limit_a_queue_may_take_the_whole_cohort():
    # a: 16 nominal, no limits; b: 64, no limits. Without a lending limit nothing is held back (local 0), and
    # without a borrowing limit only the cohort bounds a: 0 + (16 + 64) = 80.
    queues = [cq("a", [("p", resources(16))]), cq("b", [("p", resources(64))])]
    assert fit.potential_capacity(queues[0], queues, "p", "nvidia.com/gpu") == 80
    assert problems(jobset(10), queues) == []
    assert "> maximum capacity 80" in problems(jobset(11), queues)[0]


def test_without_a_cohort_only_nominal_quota_counts():
    queues = [cq("a", [("p", resources(16))], cohort=""), cq("b", [("p", resources(64))], cohort="")]
    assert "> maximum capacity 16" in problems(jobset(3), queues)[0]


def test_a_flavor_or_resource_the_queue_lacks_gives_nothing():
    queues = [cq("a", [("p", resources(16))])]
    assert fit.potential_capacity(queues[0], queues, "other", "nvidia.com/gpu") == 0
    assert fit.potential_capacity(queues[0], queues, "p", "example.com/widget") == 0


def test_cpu_and_memory_quota_are_checked_like_gpus():
    # 32 CPUs per GPU: 8 GPUs bring 256 CPUs; one pod asking for 300 does not fit.
    got = problems(jobset(1, cpu="300"), [cq("a", [("p", resources(8, borrow=0, lend=8))])])
    assert got == ["pod set worker: insufficient quota for cpu in flavor p: 1 pods x 300 = 300 > maximum capacity 256"]


def test_a_resource_no_group_covers_is_unavailable():
    got = problems(jobset(1, extra={"example.com/widget": "1"}), [cq("a", [("p", resources(8))])])
    assert got == ["pod set worker: resource example.com/widget unavailable in ClusterQueue a"]


def test_excluded_resources_need_no_quota():
    manifest = jobset(1, extra={"vpc.amazonaws.com/efa": "32"})
    queues = [cq("a", [("p", resources(8))])]
    own = queues[0]
    assert fit.queue_problems(manifest, cluster_queue=own, cluster_queues=queues, flavor="p",
                              namespace_labels={"team": "a"}, excluded_prefixes=("vpc.amazonaws.com/",)) == []
    assert "vpc.amazonaws.com/efa unavailable" in problems(manifest, queues)[0]


def test_the_namespace_must_match_the_queues_selector():
    queues = [cq("a", [("p", resources(8))])]
    assert problems(jobset(1), queues, ns_labels={"team": "b"}) == [
        "namespace team-a doesn't match ClusterQueue a's namespaceSelector"]
    # kubernetes.io/metadata.name is set on every namespace by the API server, so a selector may name it.
    by_name = [cq("a", [("p", resources(8))], team="x")]
    by_name[0]["spec"]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}
    assert problems(jobset(1), by_name, ns_labels={}) == []


def test_a_request_above_its_limit_is_a_problem_of_the_pod_set():
    manifest = jobset(1, cpu="4")
    container = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"] = {"cpu": "2"}
    assert problems(manifest, [cq("a", [("p", resources(8))])]) == [
        "pod set worker: container 't' requests 4 cpu but its limit is 2"]


# --------------------------------------------------------------------------- nodes


def test_node_problems_name_what_does_not_fit():
    node = {"cpu": "10", "memory": "20Gi"}
    assert fit.node_problems(pod([c("t", "10", "20Gi", **{"nvidia.com/gpu": "8"})]), node, gpus=8) == []
    too_big = fit.node_problems(pod([c("t", "11", "21Gi", **{"nvidia.com/gpu": "9"})]), node, gpus=8)
    assert too_big == ["cpu: the pod requests 11, the node leaves 10",
                       "memory: the pod requests 21Gi, the node leaves 20Gi",
                       "nvidia.com/gpu: the pod requests 9, the node leaves 8"]


def test_a_sidecar_counts_toward_the_node_fit():
    # 9 + 1 CPU and 19Gi + 1Gi: exactly the node's 10 and 20Gi; one more CPU in the sidecar does not fit.
    node = {"cpu": "10", "memory": "20Gi"}
    fits = pod([c("t", "9", "19Gi")], init=[c("rxdm", "1", "1Gi", sidecar=True)])
    assert fit.node_problems(fits, node, gpus=0) == []
    over = pod([c("t", "9", "19Gi")], init=[c("rxdm", "2", "1Gi", sidecar=True)])
    assert fit.node_problems(over, node, gpus=0) == ["cpu: the pod requests 11, the node leaves 10"]
