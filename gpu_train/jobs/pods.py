"""Pod pieces every renderer shares: where a pool's pods go, and the security contexts the platform's pods run with.

Usage:
    spec = {**pool_scheduling(pool), "securityContext": pod_security(uid), ...}          # a pod spec
    container = {..., "securityContext": container_security(uid)}
    gpu_resources(2)                                                                     # {"nvidia.com/gpu": "2"}

The JobSet renderer (gpu_train.jobs.jobset) and the serving renderer (gpu_train.jobs.serving) build their pods
from these, so a training pod and a serving pod on the same pool tolerate the same taints and select the same
nodes, and both meet what the team namespaces' admission policies require (gpu_train.spec.pod_rules): non-root,
no privilege escalation, every capability dropped, the runtime's default seccomp profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool


def pool_scheduling(pool: GpuPool) -> dict[str, Any]:
    """The node selector and tolerations that put a pod on exactly this pool's nodes."""
    return {"nodeSelector": dict(pool.node_selector), "tolerations": [dict(t) for t in pool.tolerations]}


def node_scheduling(node_selector: Mapping[str, str]) -> dict[str, Any]:
    """A pod on untainted nodes chosen by label (the platform's CPU nodes)."""
    return {"nodeSelector": dict(node_selector)}


def pod_security(uid: int) -> dict[str, Any]:
    """A pod's securityContext: a numeric non-root user and group, volumes owned by the group, RuntimeDefault
    seccomp."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security(uid: int, read_only_root: bool = True) -> dict[str, Any]:
    """A container's securityContext: the same user, no privilege escalation, no capabilities, RuntimeDefault
    seccomp; a read-only root filesystem unless the program must write beside itself."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": read_only_root, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def gpu_resources(gpus: int) -> dict[str, str]:
    """The extended resource a container requests (and limits) to hold `gpus` of its node's GPUs."""
    return {naming.GPU_RESOURCE: str(gpus)} if gpus else {}
