"""Would Kueue admit the job, and would its pods fit on their nodes? Kueue 0.19.2's admission
arithmetic for an empty cluster, and an estimate of a GPU node's allocatable resources, as pure
functions over the manifests the program renders.

Usage:
    sets = workload_pod_sets(jobset)                 # what Kueue's JobSet integration asks quota for
    result = admit(sets, namespace="team-research", namespace_labels={...}, local_queues=[lq],
                   queue_name="gpt2-job", cluster_queues=cqs, flavors=flavors,
                   limit_ranges=[lr], excluded_prefixes=("vpc.amazonaws.com/",))
    result.admitted, result.cluster_queue, result.flavors, result.problems
    node = gpu_node_capacity("aws", "p5.48xlarge")   # allocatable less the node agents' budget
    pod_fits_node(pod_spec, node)                    # [] or the resources that do not fit

Kueue's rules, as read at tag v0.19.2 of github.com/kubernetes-sigs/kueue:
- A JobSet is one workload with one pod set per replicated job; its count is replicas x
  min(parallelism, completions), and no minCount, so it is admitted whole or not at all
  (pkg/controller/jobs/jobset/jobset_controller.go: PodSets, PodsCountPerReplica). Elastic workload
  slices (pkg/workloadslicing) are wired into the batch/Job, RayCluster and other integrations, not
  the JobSet one.
- Before counting, the pod template is adjusted: LimitRange container defaults fill missing
  requests and limits, then limits stand in for missing requests (pkg/workload/resources.go:
  AdjustResources); a request above its limit makes the workload invalid (ValidateResources).
- One pod's requests are Kubernetes' PodRequests (k8s.io/component-helpers/resource, used by
  pkg/workload/workload.go totalRequestsFromPodSets): the containers plus every restartable
  (sidecar) init container, or the largest classic init container together with the sidecars
  started before it, whichever is larger, plus the pod overhead. Resources whose names start with
  an excluded prefix (Configuration.resources.excludeResourcePrefixes) are dropped.
- The workload goes to the ClusterQueue of its LocalQueue, which must select the namespace
  (spec.namespaceSelector). Every requested resource must be covered by a resource group ("resource
  X unavailable in ClusterQueue", the default BlockUndeclared strategy). Within a group the flavors
  are tried in order; a flavor is skipped when one of its NoSchedule/NoExecute node taints is not
  tolerated, or its node labels contradict the pod's node selector or required node affinity
  (restricted to the flavor's own label keys), and it fits when the request is at most the
  ClusterQueue's potential capacity for that flavor and resource
  (pkg/scheduler/flavorassigner/flavorassigner.go: findFlavorForPodSets, checkFlavorForPodSets,
  fitsResourceQuota).
- Capacity (pkg/cache/scheduler/resource_node.go): a ClusterQueue's subtree quota is its nominal
  quota; a cohort's is the sum over its ClusterQueues of nominal less local quota, where local
  quota is max(0, nominal - lendingLimit) when a lending limit is set. The potential capacity of a
  ClusterQueue in a cohort is min(nominal + borrowingLimit, local quota + cohort subtree quota), and
  its nominal quota without a cohort. In an empty cluster what is available equals that potential.
Not modelled: Cohort objects with quota of their own, topology-aware scheduling, admission checks,
fair sharing and preemption (none are used by this platform).

Node capacity: allocatable = capacity - kube-reserved - the eviction threshold, by each cloud's
published formula, with capacity's memory taken 7.5% below the instance's nominal memory for what
the hypervisor and kernel keep (Karpenter's default VM_MEMORY_OVERHEAD_PERCENT). Then a fixed
budget for the per-node agents (GPU_NODE_AGENTS) comes off; tests/infra/test_plan.py checks that
budget against the agents every planned stack really runs on its GPU nodes.

Hand-written: Kueue is a Go program with no Python binding, and the Kubernetes quantity grammar is
a dozen lines here where the `kubernetes` client package would add a large dependency for one
function.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

GIB = 2**30
MIB = 2**20

# ------------------------------------------------------------------------------------ quantities

_SUFFIX = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$")


def parse_quantity(value: Any) -> Fraction:
    """A Kubernetes resource quantity ("500m", "4Gi", 8, "1.5", "2e3") as an exact number of units."""
    if isinstance(value, bool):
        raise ValueError(f"not a resource quantity: {value!r}")
    if isinstance(value, int | Fraction):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"not a resource quantity: {value!r}")
    number = Fraction(m.group(1))
    if m.group(2):
        return number * Fraction(10) ** int(m.group(2)[1:])
    return number * _SUFFIX[m.group(3) or ""]


def format_quantity(resource: str, amount: Fraction) -> str:
    """Readable amount: cores for cpu, GiB for memory, a plain number otherwise."""
    if resource == "memory":
        return f"{float(amount / GIB):g}Gi"
    if resource == "cpu":
        return f"{float(amount):g}"
    return f"{float(amount):g}"


def _resources(mapping: Mapping[str, Any] | None) -> dict[str, Fraction]:
    return {k: parse_quantity(v) for k, v in (mapping or {}).items()}


# ------------------------------------------------------------------------------------ pod requests


def _merge_keep_first(first: Mapping[str, Fraction], second: Mapping[str, Fraction]) -> dict[str, Fraction]:
    return {**second, **first}


def _container_defaults(limit_ranges: Iterable[Mapping[str, Any]]) -> tuple[dict, dict]:
    """(default limits, default requests) of type Container over the namespace's LimitRanges."""
    default: dict[str, Fraction] = {}
    default_request: dict[str, Fraction] = {}
    for lr in limit_ranges:
        for item in (lr.get("spec") or lr).get("limits") or []:
            if item.get("type") == "Container":
                default = _merge_keep_first(default, _resources(item.get("default")))
                default_request = _merge_keep_first(default_request, _resources(item.get("defaultRequest")))
    return default, default_request


@dataclass(frozen=True)
class ContainerResources:
    name: str
    requests: dict[str, Fraction]
    limits: dict[str, Fraction]
    sidecar: bool = False  # an init container with restartPolicy Always


def adjusted_containers(pod_spec: Mapping[str, Any], limit_ranges: Iterable[Mapping[str, Any]] = ()
                        ) -> tuple[list[ContainerResources], list[ContainerResources]]:
    """(init containers, containers) after LimitRange defaults and limits-as-missing-requests."""
    default, default_request = _container_defaults(limit_ranges)

    def adjust(c: Mapping[str, Any], sidecar: bool = False) -> ContainerResources:
        res = c.get("resources") or {}
        limits = _merge_keep_first(_resources(res.get("limits")), default)
        requests = _merge_keep_first(_resources(res.get("requests")), default_request)
        requests = _merge_keep_first(requests, limits)
        return ContainerResources(name=c.get("name", "?"), requests=requests, limits=limits, sidecar=sidecar)

    inits = [adjust(c, c.get("restartPolicy") == "Always") for c in pod_spec.get("initContainers") or []]
    return inits, [adjust(c) for c in pod_spec.get("containers") or []]


def request_limit_problems(pod_spec: Mapping[str, Any], limit_ranges: Iterable[Mapping[str, Any]] = ()
                           ) -> list[str]:
    """Containers whose request exceeds their limit once the namespace's defaults are applied: the
    API server refuses such pods, and Kueue refuses the workload."""
    inits, mains = adjusted_containers(pod_spec, limit_ranges)
    problems = []
    for c in [*inits, *mains]:
        for name, request in sorted(c.requests.items()):
            limit = c.limits.get(name)
            if limit is not None and request > limit:
                problems.append(f"container {c.name!r} requests {format_quantity(name, request)} {name} "
                                f"but its limit is {format_quantity(name, limit)}")
    return problems


def pod_requests(pod_spec: Mapping[str, Any], limit_ranges: Iterable[Mapping[str, Any]] = (),
                 excluded_prefixes: Sequence[str] = ()) -> dict[str, Fraction]:
    """The requests Kueue counts for one pod of this template."""
    inits, mains = adjusted_containers(pod_spec, limit_ranges)
    total: dict[str, Fraction] = {}
    for c in mains:
        for k, v in c.requests.items():
            total[k] = total.get(k, Fraction(0)) + v
    sidecars: dict[str, Fraction] = {}
    init_peak: dict[str, Fraction] = {}
    for c in inits:
        if c.sidecar:
            for k, v in c.requests.items():
                sidecars[k] = sidecars.get(k, Fraction(0)) + v
            candidate = dict(sidecars)
        else:
            candidate = {k: sidecars.get(k, Fraction(0)) + c.requests.get(k, Fraction(0))
                         for k in {*sidecars, *c.requests}}
        for k, v in candidate.items():
            init_peak[k] = max(init_peak.get(k, Fraction(0)), v)
    for k, v in sidecars.items():
        total[k] = total.get(k, Fraction(0)) + v
    for k, v in init_peak.items():
        total[k] = max(total.get(k, Fraction(0)), v)
    for k, v in _resources(pod_spec.get("overhead")).items():
        total[k] = total.get(k, Fraction(0)) + v
    return {k: v for k, v in total.items() if not any(k.startswith(p) for p in excluded_prefixes)}


# ------------------------------------------------------------------------------------ pod sets


@dataclass(frozen=True)
class PodSet:
    name: str
    count: int
    template: Mapping[str, Any]  # the pod template ({"metadata", "spec"})


def workload_pod_sets(jobset: Mapping[str, Any]) -> list[PodSet]:
    """Kueue's pod sets for a JobSet: one per replicated job, replicas x min(parallelism, completions)."""
    sets = []
    for rj in jobset["spec"]["replicatedJobs"]:
        job = rj["template"]["spec"]
        parallelism = int(job.get("parallelism", 1))
        per_job = min(parallelism, int(job.get("completions", parallelism)))
        sets.append(PodSet(name=rj["name"], count=int(rj.get("replicas", 1)) * per_job, template=job["template"]))
    return sets


# ------------------------------------------------------------------------------------ flavors


def _tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        operator = t.get("operator", "Equal")
        if not t.get("key") and operator == "Exists":
            return True
        if t.get("key") != taint.get("key"):
            continue
        if operator == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _expression_matches(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], list(expr.get("values") or [])
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        try:
            have, want = int(labels[key]), int(values[0])
        except (KeyError, ValueError, IndexError):
            return False
        return have > want if op == "Gt" else have < want
    return False


def flavor_mismatch(pod_spec: Mapping[str, Any], flavor: Mapping[str, Any]) -> str | None:
    """Why this ResourceFlavor cannot host the pod (an untolerated taint, contradicting node labels)."""
    spec = flavor.get("spec") or {}
    name = flavor["metadata"]["name"]
    tolerations = [*(pod_spec.get("tolerations") or []), *(spec.get("tolerations") or [])]
    for taint in spec.get("nodeTaints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, taint):
            return f"untolerated taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} in flavor {name}"
    labels = dict(spec.get("nodeLabels") or {})
    for key, value in (pod_spec.get("nodeSelector") or {}).items():
        if key in labels and labels[key] != value:
            return f"flavor {name} doesn't match node affinity ({key}={labels[key]}, the pod wants {value})"
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = []
    for term in required.get("nodeSelectorTerms") or []:
        exprs = [e for e in term.get("matchExpressions") or [] if e["key"] in labels]
        if not exprs:
            terms = []
            break
        terms.append(exprs)
    if terms and not any(all(_expression_matches(e, labels) for e in term) for term in terms):
        return f"flavor {name} doesn't match node affinity"
    return None


# ------------------------------------------------------------------------------------ quota


@dataclass(frozen=True)
class _Quota:
    nominal: Fraction
    borrowing_limit: Fraction | None
    lending_limit: Fraction | None

    def local(self) -> Fraction:
        if self.lending_limit is None:
            return Fraction(0)
        return max(Fraction(0), self.nominal - self.lending_limit)


def _quotas(cq: Mapping[str, Any]) -> dict[tuple[str, str], _Quota]:
    out = {}
    for group in cq["spec"].get("resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            for r in flavor.get("resources") or []:
                out[(flavor["name"], r["name"])] = _Quota(
                    nominal=parse_quantity(r.get("nominalQuota", 0)),
                    borrowing_limit=parse_quantity(r["borrowingLimit"]) if r.get("borrowingLimit") is not None else None,
                    lending_limit=parse_quantity(r["lendingLimit"]) if r.get("lendingLimit") is not None else None,
                )
    return out


def _cohort(cq: Mapping[str, Any]) -> str:
    return cq["spec"].get("cohortName") or ""


def potential_capacity(cq: Mapping[str, Any], cluster_queues: Sequence[Mapping[str, Any]], flavor: str,
                       resource: str) -> Fraction:
    """The most of (flavor, resource) a workload of this ClusterQueue can get with nothing else running."""
    own = _quotas(cq).get((flavor, resource))
    if own is None:
        return Fraction(0)
    cohort = _cohort(cq)
    if not cohort:
        return own.nominal
    subtree = Fraction(0)
    for member in cluster_queues:
        if _cohort(member) != cohort:
            continue
        q = _quotas(member).get((flavor, resource))
        if q is not None:
            subtree += q.nominal - q.local()
    available = own.local() + subtree
    if own.borrowing_limit is not None:
        available = min(own.nominal + own.borrowing_limit, available)
    return available


# ------------------------------------------------------------------------------------ admission


@dataclass(frozen=True)
class Admission:
    admitted: bool
    cluster_queue: str = ""
    flavors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # pod set -> resource -> flavor
    usage: Mapping[tuple[str, str], Fraction] = field(default_factory=dict)  # (flavor, resource) -> amount
    problems: tuple[str, ...] = ()


def _selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False  # a nil selector selects nothing
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    return all(_expression_matches(e, labels) for e in selector.get("matchExpressions") or [])


def admit(pod_sets: Sequence[PodSet], *, namespace: str, namespace_labels: Mapping[str, str],
          local_queues: Sequence[Mapping[str, Any]], queue_name: str,
          cluster_queues: Sequence[Mapping[str, Any]], flavors: Sequence[Mapping[str, Any]],
          limit_ranges: Sequence[Mapping[str, Any]] = (), excluded_prefixes: Sequence[str] = ()) -> Admission:
    """Would Kueue admit these pod sets, submitted to `queue_name` in `namespace`, in an empty cluster?"""
    lq = next((q for q in local_queues
               if q["metadata"]["name"] == queue_name and q["metadata"].get("namespace") == namespace), None)
    if lq is None:
        return Admission(False, problems=(f"LocalQueue {namespace}/{queue_name} doesn't exist",))
    cq_name = lq["spec"].get("clusterQueue", "")
    cq = next((q for q in cluster_queues if q["metadata"]["name"] == cq_name), None)
    if cq is None:
        return Admission(False, problems=(f"ClusterQueue {cq_name} doesn't exist",))
    if not _selector_matches(cq["spec"].get("namespaceSelector"), {**namespace_labels,
                                                                   "kubernetes.io/metadata.name": namespace}):
        return Admission(False, cq_name, problems=(f"namespace {namespace} doesn't match ClusterQueue "
                                                   f"{cq_name}'s namespaceSelector",))
    by_name = {f["metadata"]["name"]: f for f in flavors}
    groups = cq["spec"].get("resourceGroups") or []
    usage: dict[tuple[str, str], Fraction] = {}
    assignment: dict[str, dict[str, str]] = {}
    problems: list[str] = []
    for ps in pod_sets:
        spec = ps.template.get("spec") or {}
        bad_limits = request_limit_problems(spec, limit_ranges)
        if bad_limits:
            problems += [f"pod set {ps.name}: {p}" for p in bad_limits]
            continue
        per_pod = pod_requests(spec, limit_ranges, excluded_prefixes)
        total = {k: v * ps.count for k, v in per_pod.items() if v > 0}
        chosen: dict[str, str] = {}
        for resource in sorted(total):
            if not any(resource in (g.get("coveredResources") or []) for g in groups):
                problems.append(f"pod set {ps.name}: resource {resource} unavailable in ClusterQueue {cq_name}")
        for group in groups:
            wanted = {r: total[r] for r in group.get("coveredResources") or [] if r in total}
            if not wanted:
                continue
            reasons, quota_reasons = [], []
            for fq in group.get("flavors") or []:
                fname = fq["name"]
                flavor = by_name.get(fname)
                if flavor is None:
                    reasons.append(f"flavor {fname} not found")
                    continue
                mismatch = flavor_mismatch(spec, flavor)
                if mismatch:
                    reasons.append(mismatch)
                    continue
                short = []
                for resource, amount in sorted(wanted.items()):
                    capacity = potential_capacity(cq, cluster_queues, fname, resource)
                    already = usage.get((fname, resource), Fraction(0))
                    if already + amount > capacity:
                        short.append(
                            f"insufficient quota for {resource} in flavor {fname}: {ps.count} pods x "
                            f"{format_quantity(resource, per_pod[resource])} = {format_quantity(resource, amount)}"
                            + (f" (+ {format_quantity(resource, already)} of earlier pod sets)" if already else "")
                            + f" > maximum capacity {format_quantity(resource, capacity)}")
                if short:
                    quota_reasons += short
                    continue
                for resource, amount in wanted.items():
                    usage[(fname, resource)] = usage.get((fname, resource), Fraction(0)) + amount
                    chosen[resource] = fname
                break
            else:
                # The flavors the pod could use but that lack quota say more than the ones it cannot use.
                problems.append(f"pod set {ps.name}: no flavor of ClusterQueue {cq_name} fits: "
                                + "; ".join(quota_reasons or reasons))
        assignment[ps.name] = chosen
    return Admission(not problems, cq_name, assignment, usage, tuple(problems))


# ------------------------------------------------------------------------------------ nodes

# Karpenter's default VM_MEMORY_OVERHEAD_PERCENT: the share of an instance's nominal memory the
# kubelet never sees (karpenter-provider-aws pkg/providers/instancetype/types.go, memory()).
VM_MEMORY_OVERHEAD = Fraction(75, 1000)
# kubelet's default hard eviction threshold memory.available<100Mi (both clouds).
EVICTION_MEMORY = 100 * MIB
# Pods per node: EKS sets the kubelet's maxPods from the VPC CNI's ENI table (misc/eni-max-pods.txt
# of github.com/aws/amazon-vpc-cni-k8s, v1.23.0), which sizes kube-reserved memory; GKE Standard's
# default is 110 and its reservation does not depend on it.
ENI_MAX_PODS = {
    "p4d.24xlarge": 737, "p4de.24xlarge": 737, "p5.48xlarge": 100, "p5e.48xlarge": 100, "p5en.48xlarge": 198,
    "trn1.32xlarge": 247, "g6e.48xlarge": 492, "g6e.12xlarge": 292, "g6e.xlarge": 58, "g6e.2xlarge": 58,
    "g6.xlarge": 58, "g6.2xlarge": 58, "g6.12xlarge": 234, "g5.xlarge": 58, "g5.48xlarge": 345,
}


@dataclass(frozen=True)
class NodeResources:
    cpu: Fraction  # cores
    memory: Fraction  # bytes
    gpus: int


def _cpu_reserved(vcpus: int) -> Fraction:
    """kube-reserved CPU, the same tiers on both clouds: 6% of the first core, 1% of the second,
    0.5% of the next two, 0.25% of every core above four (EKS AMI / Karpenter kubeReservedResources;
    https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes)."""
    tiers = ((0, 1, Fraction(6, 100)), (1, 2, Fraction(1, 100)), (2, 4, Fraction(5, 1000)),
             (4, 1 << 31, Fraction(25, 10000)))
    return sum((Fraction(max(0, min(vcpus, end) - start)) * pct for start, end, pct in tiers), Fraction(0))


def _gke_memory_reserved(memory: Fraction) -> Fraction:
    """GKE's kube-reserved memory: 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8, 6%
    of the next 112, 2% above 128 GiB (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes)."""
    if memory < GIB:
        return Fraction(255 * MIB)
    tiers = ((0, 4, Fraction(25, 100)), (4, 8, Fraction(20, 100)), (8, 16, Fraction(10, 100)),
             (16, 128, Fraction(6, 100)), (128, 1 << 40, Fraction(2, 100)))
    return sum((max(Fraction(0), min(memory, end * GIB) - start * GIB) * pct for start, end, pct in tiers),
               Fraction(0))


def node_allocatable(cloud: str, *, vcpus: int, memory_gib: int, gpus: int, max_pods: int = 110) -> NodeResources:
    """What the kubelet offers to pods on a node of this shape."""
    memory = Fraction(memory_gib * GIB) * (1 - VM_MEMORY_OVERHEAD)
    # EKS AMI / Karpenter: kube-reserved memory is 11 MiB per pod + 255 MiB; GKE has its own tiers.
    reserved = Fraction((11 * max_pods + 255) * MIB) if cloud == "aws" else _gke_memory_reserved(memory)
    return NodeResources(cpu=Fraction(vcpus) - _cpu_reserved(vcpus),
                         memory=memory - reserved - EVICTION_MEMORY, gpus=gpus)


# What every GPU node keeps for agents other than the trainer: the platform's DaemonSets (the Alluxio
# worker and its job worker, DCGM exporter, node exporter, device and fabric plugins, NVMe setup,
# fabric installers) and the cloud's own (CNI, kube-proxy, CSI node, identity and logging agents).
# tests/infra/test_plan.py adds up the platform's from every planned stack and checks they fit with
# CLOUD_AGENTS to spare.
GPU_NODE_AGENTS = NodeResources(cpu=Fraction(4), memory=Fraction(12 * GIB), gpus=0)
# The cloud-managed DaemonSets the plan does not show: EKS aws-node, kube-proxy, ebs-csi-node, the
# Pod Identity agent and the node monitoring agent; GKE kube-proxy, fluentbit, gke-metadata-server, pdcsi-node, netd, the GPU
# device plugin and metrics agent. Their published requests add up to well under this.
CLOUD_AGENTS = NodeResources(cpu=Fraction(1), memory=Fraction(3 * GIB, 2), gpus=0)


def instance_shape(cloud: str, instance_type: str) -> tuple[int, int, int, int]:
    """(vCPUs, memory GiB, GPUs, max pods) of a catalog instance or machine type."""
    if cloud == "aws":
        from infra.aws.catalog import instance_spec

        spec = instance_spec(instance_type)
        return spec.vcpus, spec.memory_gib, spec.gpus, ENI_MAX_PODS.get(instance_type, max(ENI_MAX_PODS.values()))
    from infra.gcp.catalog import machine_spec

    spec = machine_spec(instance_type)
    return spec.vcpus, spec.memory_gib, spec.gpus, 110


def gpu_node_capacity(cloud: str, instance_type: str) -> NodeResources:
    """What a GPU node of this type leaves for training pods: allocatable less GPU_NODE_AGENTS."""
    vcpus, memory_gib, gpus, max_pods = instance_shape(cloud, instance_type)
    alloc = node_allocatable(cloud, vcpus=vcpus, memory_gib=memory_gib, gpus=gpus, max_pods=max_pods)
    return NodeResources(cpu=alloc.cpu - GPU_NODE_AGENTS.cpu, memory=alloc.memory - GPU_NODE_AGENTS.memory,
                         gpus=gpus)


def pod_fits_node(pod_spec: Mapping[str, Any], node: NodeResources, gpu_resource: str = "nvidia.com/gpu",
                  limit_ranges: Iterable[Mapping[str, Any]] = ()) -> list[str]:
    """The resources one pod of this template requests beyond what the node leaves it ([] = fits)."""
    req = pod_requests(pod_spec, limit_ranges)
    problems = []
    for name, have in (("cpu", node.cpu), ("memory", node.memory), (gpu_resource, Fraction(node.gpus))):
        want = req.get(name, Fraction(0))
        if want > have:
            problems.append(f"{name}: the pod requests {format_quantity(name, want)}, the node leaves "
                            f"{format_quantity(name, max(have, Fraction(0)))}")
    return problems


# ------------------------------------------------------------------------------------ timeouts

# From Kueue's admission to a running trainer container on a fresh GPU node: the provisioner's
# decision, instance launch and boot, GPU driver and fabric setup, the NVMe DaemonSet, and pulling
# the trainer image (several GB of CUDA libraries).
GPU_NODE_STARTUP_S = 15 * 60
# Kueue's waitForPodsReady.timeout (also Kueue's own default): an admitted job whose pods are not all
# ready by then is evicted and requeued, so it must outlast a node start.
PODS_READY_TIMEOUT_S = 30 * 60


def timeout_problems(*, rendezvous_s: int, key: str, node_startup_s: int = GPU_NODE_STARTUP_S,
                     pods_ready_s: int = PODS_READY_TIMEOUT_S) -> list[str]:
    """The three waits must nest: a node starts within Kueue's pods-ready timeout, and the first
    torchrun agents wait for their peers at least as long as Kueue gives the pods to come up (else
    they give up, and fail the pod, while Kueue still considers the start on time)."""
    problems = []
    if pods_ready_s < node_startup_s:
        problems.append(f"Kueue's waitForPodsReady timeout ({pods_ready_s} s) is shorter than a GPU node's "
                        f"start ({node_startup_s} s): every cold start would be evicted")
    if rendezvous_s < pods_ready_s:
        problems.append(f"{key} is {rendezvous_s // 60} minutes, shorter than Kueue's waitForPodsReady timeout "
                        f"({pods_ready_s // 60} minutes): the first pods would stop waiting for their peers "
                        "while Kueue still lets the others start")
    return problems
