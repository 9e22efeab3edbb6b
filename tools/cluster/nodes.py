"""kwok nodes shaped like a stack's pools, read from the platform contract the stack publishes.

Usage:
    for node in pool_nodes(contract): plane.apply([node])     # every pool at its maxNodes, and one system node

Each GPU node carries what the cloud layer gives a real one: the pool's node selector labels, the GPU labels, the
pool's taints (its tolerations turned around), `nvidia.com/gpu` at gpusPerNode and the fabric's device resources
(EFA interfaces, GPUDirect NICs) beside the pool's CPU and memory. The system node carries the system label and no
taint, as the clusters' system node group does.
"""

from __future__ import annotations

from typing import Any

from gpu_train.jobs.queues import pool_taints
from gpu_train.spec import naming
from tools.cluster.controllers import KWOK_ANNOTATION

PODS_PER_NODE = "110"


def _node(name: str, labels: dict[str, str], taints: list[dict[str, str]], resources: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {KWOK_ANNOTATION: "fake"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok", **labels}},
            "spec": {"taints": taints},
            "status": {"allocatable": resources, "capacity": resources}}


def pool_nodes(contract: dict[str, Any], system_nodes: int = 1) -> list[dict[str, Any]]:
    nodes = []
    for pool in contract["pools"]:
        taints = pool_taints(pool["tolerations"])
        resources = {**pool["allocatable"], naming.GPU_RESOURCE: str(pool["gpusPerNode"]),
                     **{k: str(v) for k, v in pool["fabric"]["resources"].items()}, "pods": PODS_PER_NODE}
        labels = {**pool["nodeSelector"], naming.GPU_NODE_LABEL: "true", naming.GPU_TYPE_LABEL: pool["gpuType"],
                  naming.CAPACITY_LABEL: pool["capacity"], "node.kubernetes.io/instance-type": pool["instanceType"]}
        nodes += [_node(f"{pool['name']}-{i}", labels, taints, resources) for i in range(pool["maxNodes"])]
    return nodes + [_node(f"system-{i}", {naming.SYSTEM_LABEL: "true"}, [],
                          {"cpu": "16", "memory": "64Gi", "pods": PODS_PER_NODE}) for i in range(system_nodes)]
