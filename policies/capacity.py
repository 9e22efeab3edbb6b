"""Capacity and cost rules over all GPU pools of a stack: interruption handling, scale to zero, GPU cap.

Usage: `from policies import capacity; capacity.gpu_pools(resources)` lists the stack's GPU pools;
`list(capacity.gpu_total_cap(resources, ctx))` yields `(resource or None, detail)` pairs.

A GPU pool is any of: a Karpenter `NodePool` whose requirements select GPU instance types (or carry
the `nvidia.com/gpu` taint; bounded by `limits.nvidia.com/gpu`, or by `limits.nodes` / the static
`replicas` times the GPUs of its instance type), an EKS managed node group on GPU instance types (directly or through its
launch template), or a GKE node pool with guest accelerators or a GPU machine type. GPUs per node come
from the catalogs in `gpu_train/spec/catalog/aws.py` and `gpu_train/spec/catalog/gcp.py`.

Interruption handling: Karpenter drains spot nodes ahead of reclaim only when it reads EC2's
interruption events from an SQS queue (https://karpenter.sh/docs/concepts/disruption/#interruption).
EKS managed node groups rebalance spot capacity themselves
(https://docs.aws.amazon.com/eks/latest/userguide/managed-node-groups.html#managed-node-group-capacity-types),
and GKE shuts spot nodes down gracefully
(https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms#termination), so only Karpenter
spot pools need the queue.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from gpu_train.spec.catalog.aws import CATALOG as EC2_CATALOG
from gpu_train.spec.catalog.gcp import CATALOG as GCE_CATALOG
from policies.core import Context, Resource, as_int, dig, items, json_value, truthy

KARPENTER_NODE_POOL = "kubernetes:karpenter.sh/v1:NodePool"
EKS_NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
GKE_NODE_POOL = "gcp:container/nodePool:NodePool"
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
SQS_QUEUE = "aws:sqs/queue:Queue"
EVENT_RULE = "aws:cloudwatch/eventRule:EventRule"
EVENT_TARGET = "aws:cloudwatch/eventTarget:EventTarget"

GPU_RESOURCE = "nvidia.com/gpu"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
SPOT_INTERRUPTION = "EC2 Spot Instance Interruption Warning"


@dataclass(frozen=True, kw_only=True)
class GpuPool:
    """One GPU pool as the capacity rules see it."""

    resource: Resource
    gpus_per_node: int | None  # None: a GPU pool whose instance type is not in the catalog
    min_nodes: int  # nodes kept when idle
    max_gpus: int | None  # the most GPUs the pool can scale to; None: unbounded
    spot: bool
    karpenter: bool  # provisioned by Karpenter (needs its interruption queue for spot)


def _ec2_gpus(types) -> int | None:
    known = [EC2_CATALOG[t].gpus for t in types if t in EC2_CATALOG]
    return max(known) if known else None


def _karpenter_pool(res: Resource) -> GpuPool | None:
    spec = res.get("spec", "template", "spec") or {}
    requirements = items(dig(spec, "requirements"))
    types = [v for r in requirements if dig(r, "key") == INSTANCE_TYPE_LABEL for v in items(dig(r, "values"))]
    gpu_requirement = any(str(dig(r, "key", default="")).startswith("karpenter.k8s.aws/instance-gpu")
                          for r in requirements)
    gpu_taint = any(dig(t, "key") == GPU_RESOURCE for t in items(dig(spec, "taints")))
    gpus = _ec2_gpus(types)
    if gpus is None and not gpu_requirement and not gpu_taint:
        return None
    spot = any(dig(r, "key") == CAPACITY_TYPE_LABEL and "spot" in items(dig(r, "values")) for r in requirements)
    limit = as_int(res.get("spec", "limits", GPU_RESOURCE))
    # A static NodePool (spec.replicas) keeps exactly that many nodes and supports only limits.nodes;
    # a dynamic one may bound its nodes with limits.nodes instead of a GPU limit (karpenter.sh_nodepools CRD).
    replicas = as_int(res.get("spec", "replicas"))
    node_bound = [n for n in (as_int(res.get("spec", "limits", "nodes")), replicas) if n is not None]
    if limit is None and node_bound and gpus is not None:
        limit = min(node_bound) * gpus
    return GpuPool(resource=res, gpus_per_node=gpus, min_nodes=replicas or 0,
                   max_gpus=limit, spot=spot, karpenter=True)


def _node_group_pool(res: Resource, resources: Sequence[Resource]) -> GpuPool | None:
    types = list(items(res.get("instanceTypes")))
    template = res.get("launchTemplate") or {}
    types += [lt.get("instanceType") for lt in resources
              if lt.type == LAUNCH_TEMPLATE and lt.get("instanceType")
              and (lt.referred_by(dig(template, "id")) or lt.referred_by(dig(template, "name")))]
    gpus = _ec2_gpus(types)
    gpu_ami = any(s in str(res.get("amiType", default="")).upper() for s in ("GPU", "NVIDIA"))
    gpu_taint = any(dig(t, "key") == GPU_RESOURCE for t in items(res.get("taints")))
    if gpus is None and not gpu_ami and not gpu_taint:
        return None
    max_size = as_int(res.get("scalingConfig", "maxSize"))
    return GpuPool(resource=res, gpus_per_node=gpus, min_nodes=as_int(res.get("scalingConfig", "minSize")) or 0,
                   max_gpus=None if gpus is None or max_size is None else gpus * max_size,
                   spot=str(res.get("capacityType", default="")).upper() == "SPOT", karpenter=False)


def _gke_pool(res: Resource) -> GpuPool | None:
    node_config = res.get("nodeConfig") or {}
    accelerators = [as_int(dig(a, "count")) or 0 for a in items(dig(node_config, "guestAccelerators"))]
    machine = dig(node_config, "machineType")
    gpus = sum(accelerators) if accelerators else (GCE_CATALOG[machine].gpus if machine in GCE_CATALOG else None)
    if not gpus:
        return None
    zones = len(items(res.get("nodeLocations"))) or 1
    auto = res.get("autoscaling")
    if auto:
        total_max, per_zone_max = as_int(dig(auto, "totalMaxNodeCount")), as_int(dig(auto, "maxNodeCount"))
        max_nodes = total_max if total_max is not None else None if per_zone_max is None else per_zone_max * zones
        total_min, per_zone_min = as_int(dig(auto, "totalMinNodeCount")), as_int(dig(auto, "minNodeCount"))
        min_nodes = total_min if total_min is not None else (per_zone_min or 0) * zones
    else:
        count = as_int(res.get("nodeCount"))
        count = as_int(res.get("initialNodeCount")) if count is None else count
        max_nodes = min_nodes = (count or 0) * zones
    spot = truthy(dig(node_config, "spot")) or truthy(dig(node_config, "preemptible"))
    return GpuPool(resource=res, gpus_per_node=gpus, min_nodes=min_nodes,
                   max_gpus=None if max_nodes is None else max_nodes * gpus, spot=spot, karpenter=False)


def gpu_pools(resources: Sequence[Resource]) -> list[GpuPool]:
    """Every GPU pool in a stack, whatever provisions it."""
    pools = []
    for res in resources:
        if res.type == KARPENTER_NODE_POOL:
            pool = _karpenter_pool(res)
        elif res.type == EKS_NODE_GROUP:
            pool = _node_group_pool(res, resources)
        elif res.type == GKE_NODE_POOL:
            pool = _gke_pool(res)
        else:
            pool = None
        if pool is not None:
            pools.append(pool)
    return pools


def gpu_total_cap(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource | None, str]]:
    """Every GPU pool is bounded, and together they scale to at most the configured GPUs."""
    total, parts = 0, []
    for pool in gpu_pools(resources):
        if pool.max_gpus is None:
            what = (f"spec.limits['{GPU_RESOURCE}'] is not set, and no node bound (spec.limits.nodes, "
                    "spec.replicas) of a catalog instance type gives one" if pool.karpenter
                    else "its maximum size or GPUs per node (instance type not in the catalog) is unknown")
            yield pool.resource, f"the GPU pool is unbounded: {what}."
            continue
        total += pool.max_gpus
        parts.append(f"{pool.resource.name}={pool.max_gpus}")
    if total > ctx.max_gpus:
        yield None, (f"GPU pools can scale to {total} GPUs ({', '.join(parts)}), more than the "
                     f"{ctx.max_gpus} allowed for stack {ctx.stack or '(unknown)'}.")


def gpu_scale_to_zero(resources: Sequence[Resource], ctx: Context) -> Iterator[tuple[Resource | None, str]]:
    """Outside prod, GPU pools keep no idle nodes (min 0)."""
    if ctx.is_prod:
        return
    for pool in gpu_pools(resources):
        if pool.min_nodes > 0:
            field = {KARPENTER_NODE_POOL: "spec.replicas", EKS_NODE_GROUP: "scalingConfig.minSize",
                     GKE_NODE_POOL: "autoscaling min node count"}[pool.resource.type]
            yield pool.resource, (f"{field} keeps {pool.min_nodes} GPU node(s) running in the "
                                  f"{ctx.environment or 'non-prod'} stack {ctx.stack or '(unknown)'}.")


def _is_spot_interruption_rule(rule: Resource) -> bool:
    pattern = json_value(rule.get("eventPattern"))
    if not isinstance(pattern, Mapping):
        return False
    sources, kinds = items(pattern.get("source")), items(pattern.get("detail-type"))
    return "aws.ec2" in sources and SPOT_INTERRUPTION in kinds


def _karpenter_queue(resources: Sequence[Resource]) -> tuple[Resource | None, str | None]:
    """Karpenter's Helm release and its settings.interruptionQueue value."""
    for res in resources:
        if res.type == HELM_RELEASE and str(res.get("chart", default="")).rstrip("/").endswith("karpenter"):
            return res, res.get("values", "settings", "interruptionQueue")
    return None, None


def spot_interruption_handling(resources: Sequence[Resource],
                               ctx: Context) -> Iterator[tuple[Resource | None, str]]:
    """Karpenter spot pools get interruption events: SQS queue <- EventBridge rule, queue set in Karpenter."""
    spot = [p for p in gpu_pools(resources) if p.spot and p.karpenter]
    if not spot:
        return
    names = ", ".join(p.resource.name for p in spot)
    rules = [r for r in resources if r.type == EVENT_RULE and _is_spot_interruption_rule(r)]
    queues = [q for q in resources if q.type == SQS_QUEUE]
    targets = [t for t in resources if t.type == EVENT_TARGET]
    fed = [q for q in queues
           if any(q.referred_by(t.get("arn")) and any(r.referred_by(t.get("rule")) for r in rules) for t in targets)]
    if not rules:
        yield None, (f"spot pools ({names}) exist but no EventBridge rule matches source aws.ec2, "
                     f"detail-type '{SPOT_INTERRUPTION}'.")
    elif not fed:
        yield None, (f"spot pools ({names}) exist but no EventBridge target sends the spot interruption "
                     "rule's events to an SQS queue.")
    release, queue_name = _karpenter_queue(resources)
    if release is None:
        yield None, f"spot pools ({names}) exist but no Karpenter Helm release is in the stack."
    elif not queue_name:
        yield release, "values.settings.interruptionQueue is not set, so Karpenter ignores interruptions."
    elif fed and not any(q.referred_by(queue_name) or q.get("name") == queue_name for q in fed):
        yield release, (f"values.settings.interruptionQueue {queue_name!r} is not the queue the spot "
                        "interruption rule feeds.")
