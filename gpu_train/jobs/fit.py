"""Would Kueue ever admit a JobSet, and would its pods fit their nodes? Pure checks over the rendered JobSet.

Usage:
    problems = queue_problems(jobset, cluster_queue=cq, cluster_queues=all_cqs, flavor="h100-spot",
                              namespace_labels={...}, limit_range=lr, excluded_prefixes=("vpc.amazonaws.com/",))
    problems += node_problems(pod_spec, allocatable, gpus=8)     # [] = one pod fits a node of its pool

Kueue's rules as read at tag v0.19.2 of github.com/kubernetes-sigs/kueue, for the shape this platform gives every
job and queue (one replicated job; one ResourceFlavor per pool carrying the pool's labels, which the job's node
selector always names; one ClusterQueue per team in one cohort):
- a JobSet is one workload with one pod set per replicated job, of replicas x min(parallelism, completions)
  pods and no minCount, so it is admitted whole or not at all (pkg/controller/jobs/jobset/jobset_controller.go);
- LimitRange container defaults fill missing requests and limits, then limits stand in for missing requests, and
  a request above its limit makes the workload invalid (pkg/workload/resources.go);
- one pod's requests are Kubernetes' PodRequests: the containers plus the sidecars, or the largest classic init
  container with the sidecars started before it, whichever is larger, plus the overhead
  (k8s.io/component-helpers/resource); resources under an excluded prefix are dropped;
- every requested resource must be covered by the ClusterQueue, and the pod set must fit its flavor's potential
  capacity: nominal quota without a cohort; in a cohort, min(nominal + borrowingLimit, local quota + the sum over
  the cohort of nominal less local quota), where local quota is max(0, nominal - lendingLimit) when a lending
  limit is set (pkg/cache/scheduler/resource_node.go). In an empty cluster what is available equals that.
Quantities are Kubernetes' own grammar, read with the `kubernetes` client's parse_quantity.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

GIB = 2**30
# Kubernetes' quantity grammar (k8s.io/apimachinery/pkg/api/resource/quantity.go): the client's parse_quantity
# alone also takes what the API server refuses, such as "4 Gi", "NaN" or "1_000".
_QUANTITY = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")


def quantity(value: Any) -> Fraction:
    """A Kubernetes resource quantity ("500m", "4Gi", 8) as an exact number of units."""
    from kubernetes.utils.quantity import parse_quantity

    if isinstance(value, bool) or (isinstance(value, str) and not _QUANTITY.fullmatch(value)):
        raise ValueError(f"not a resource quantity: {value!r}")
    if isinstance(value, Fraction):
        return value
    return Fraction(Decimal(parse_quantity(value)))


def readable(resource: str, amount: Fraction) -> str:
    """Cores for cpu, GiB for memory, a plain number otherwise."""
    if resource == "memory":
        return f"{float(amount / GIB):g}Gi"
    return f"{float(amount):g}"


def _resources(mapping: Mapping[str, Any] | None) -> dict[str, Fraction]:
    return {k: quantity(v) for k, v in (mapping or {}).items()}


def _defaults(limit_range: Mapping[str, Any] | None) -> tuple[dict[str, Fraction], dict[str, Fraction]]:
    """(default limits, default requests) of type Container in a LimitRange spec."""
    for item in (limit_range or {}).get("limits") or []:
        if item.get("type") == "Container":
            return _resources(item.get("default")), _resources(item.get("defaultRequest"))
    return {}, {}


def containers(pod_spec: Mapping[str, Any], limit_range: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every container with its requests and limits after LimitRange defaults and limits-as-missing-requests, and
    whether it is an init container, a sidecar (restartPolicy Always) or a regular one."""
    default_limits, default_requests = _defaults(limit_range)
    out = []
    for kind in ("initContainers", "containers"):
        for c in pod_spec.get(kind) or []:
            res = c.get("resources") or {}
            limits = {**default_limits, **_resources(res.get("limits"))}
            requests = {**limits, **default_requests, **_resources(res.get("requests"))}
            role = "container" if kind == "containers" else (
                "sidecar" if c.get("restartPolicy") == "Always" else "init")
            out.append({"name": c.get("name", "?"), "role": role, "requests": requests, "limits": limits})
    return out


def pod_requests(pod_spec: Mapping[str, Any], limit_range: Mapping[str, Any] | None = None,
                 excluded_prefixes: Sequence[str] = ()) -> dict[str, Fraction]:
    """The requests Kueue counts for one pod of this template."""
    total: dict[str, Fraction] = {}
    sidecars: dict[str, Fraction] = {}
    peak: dict[str, Fraction] = {}
    for c in containers(pod_spec, limit_range):
        if c["role"] == "container":
            for k, v in c["requests"].items():
                total[k] = total.get(k, Fraction(0)) + v
            continue
        if c["role"] == "sidecar":
            for k, v in c["requests"].items():
                sidecars[k] = sidecars.get(k, Fraction(0)) + v
            candidate = dict(sidecars)
        else:
            candidate = {k: sidecars.get(k, Fraction(0)) + c["requests"].get(k, Fraction(0))
                         for k in {*sidecars, *c["requests"]}}
        for k, v in candidate.items():
            peak[k] = max(peak.get(k, Fraction(0)), v)
    for k, v in sidecars.items():
        total[k] = total.get(k, Fraction(0)) + v
    for k, v in peak.items():
        total[k] = max(total.get(k, Fraction(0)), v)
    for k, v in _resources(pod_spec.get("overhead")).items():
        total[k] = total.get(k, Fraction(0)) + v
    return {k: v for k, v in total.items() if not any(k.startswith(p) for p in excluded_prefixes)}


def request_limit_problems(pod_spec: Mapping[str, Any], limit_range: Mapping[str, Any] | None = None) -> list[str]:
    """Containers whose request exceeds their limit: the API server refuses such pods, and Kueue the workload."""
    problems = []
    for c in containers(pod_spec, limit_range):
        for name, request in sorted(c["requests"].items()):
            limit = c["limits"].get(name)
            if limit is not None and request > limit:
                problems.append(f"container {c['name']!r} requests {readable(name, request)} {name} but its limit is "
                                f"{readable(name, limit)}")
    return problems


def potential_capacity(cq: Mapping[str, Any], cluster_queues: Iterable[Mapping[str, Any]], flavor: str,
                       resource: str) -> Fraction:
    """The most of (flavor, resource) a workload of this ClusterQueue can get with nothing else running."""

    def quota(q: Mapping[str, Any]) -> tuple[Fraction, Fraction | None, Fraction] | None:
        for group in q["spec"].get("resourceGroups") or []:
            for f in group.get("flavors") or []:
                for r in f.get("resources") or [] if f["name"] == flavor else []:
                    if r["name"] == resource:
                        nominal = quantity(r.get("nominalQuota", 0))
                        borrow = quantity(r["borrowingLimit"]) if r.get("borrowingLimit") is not None else None
                        lend = r.get("lendingLimit")
                        local = max(Fraction(0), nominal - quantity(lend)) if lend is not None else Fraction(0)
                        return nominal, borrow, local
        return None

    own = quota(cq)
    if own is None:
        return Fraction(0)
    nominal, borrow, local = own
    cohort = cq["spec"].get("cohortName") or ""
    if not cohort:
        return nominal
    subtree = sum((q[0] - q[2] for m in cluster_queues if (m["spec"].get("cohortName") or "") == cohort
                   if (q := quota(m)) is not None), Fraction(0))
    available = local + subtree
    return min(nominal + borrow, available) if borrow is not None else available


def pod_sets(jobset: Mapping[str, Any]) -> list[tuple[str, int, Mapping[str, Any]]]:
    """(name, pod count, pod spec) of each replicated job: what Kueue's JobSet integration asks quota for."""
    out = []
    for rj in jobset["spec"]["replicatedJobs"]:
        job = rj["template"]["spec"]
        parallelism = int(job.get("parallelism", 1))
        count = int(rj.get("replicas", 1)) * min(parallelism, int(job.get("completions", parallelism)))
        out.append((rj["name"], count, job["template"]["spec"]))
    return out


def queue_problems(jobset: Mapping[str, Any], *, cluster_queue: Mapping[str, Any],
                   cluster_queues: Sequence[Mapping[str, Any]], flavor: str, namespace_labels: Mapping[str, str],
                   limit_range: Mapping[str, Any] | None = None, excluded_prefixes: Sequence[str] = ()) -> list[str]:
    """Why Kueue would never admit this JobSet from its team's ClusterQueue, even in an empty cluster."""
    name = cluster_queue["metadata"]["name"]
    namespace = jobset["metadata"]["namespace"]
    labels = {**namespace_labels, "kubernetes.io/metadata.name": namespace}
    wanted = (cluster_queue["spec"].get("namespaceSelector") or {}).get("matchLabels") or {}
    if any(labels.get(k) != v for k, v in wanted.items()):
        return [f"namespace {namespace} doesn't match ClusterQueue {name}'s namespaceSelector"]
    covered = {r for g in cluster_queue["spec"].get("resourceGroups") or [] for r in g.get("coveredResources") or []}
    problems: list[str] = []
    for set_name, count, spec in pod_sets(jobset):
        bad = request_limit_problems(spec, limit_range)
        if bad:
            problems += [f"pod set {set_name}: {p}" for p in bad]
            continue
        per_pod = pod_requests(spec, limit_range, excluded_prefixes)
        for resource, amount in sorted(per_pod.items()):
            if amount <= 0:
                continue
            if resource not in covered:
                problems.append(f"pod set {set_name}: resource {resource} unavailable in ClusterQueue {name}")
                continue
            capacity = potential_capacity(cluster_queue, cluster_queues, flavor, resource)
            if amount * count > capacity:
                problems.append(f"pod set {set_name}: insufficient quota for {resource} in flavor {flavor}: {count} "
                                f"pods x {readable(resource, amount)} = {readable(resource, amount * count)} > "
                                f"maximum capacity {readable(resource, capacity)}")
    return problems


def node_problems(pod_spec: Mapping[str, Any], allocatable: Mapping[str, Any], *, gpus: int,
                  gpu_resource: str = "nvidia.com/gpu", limit_range: Mapping[str, Any] | None = None) -> list[str]:
    """The resources one pod of this template requests beyond what a node of its pool leaves it ([] = fits)."""
    req = pod_requests(pod_spec, limit_range)
    problems = []
    for name, have in (("cpu", quantity(allocatable["cpu"])), ("memory", quantity(allocatable["memory"])),
                       (gpu_resource, Fraction(gpus))):
        want = req.get(name, Fraction(0))
        if want > have:
            problems.append(f"{name}: the pod requests {readable(name, want)}, the node leaves "
                            f"{readable(name, max(have, Fraction(0)))}")
    return problems
