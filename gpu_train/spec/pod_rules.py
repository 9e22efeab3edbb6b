"""The pod-security data the policy pack and the team namespaces' admission policies both read.

Usage:
    from gpu_train.spec import pod_rules
    pod_rules.HOST_AGENTS          # the platform's own host agents and exactly what each may do on the host
    pod_rules.RXDM_SIDECARS        # GPUDirect's receive-datapath sidecars allowed in training pods
    pod_rules.image_allowed(image, registries, repositories)
    pod_rules.serving_image(container)  # KServe's pinned model server and storage initializer

One source for two enforcement points: policies/pods.py judges planned objects with it (CrossGuard and offline),
and infra/k8s/pod_admission.py generates the ValidatingAdmissionPolicies of the team namespaces from it, so what
the pack refuses at plan time the cluster refuses at admission. Pod Security Standards names follow
k8s.io/pod-security-admission (https://kubernetes.io/docs/concepts/security/pod-security-standards/); why each
host agent needs what it is granted is in docs/policies.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_train.spec import naming
from gpu_train.spec.serving import RUNTIME_IMAGES, STORAGE_INITIALIZER_IMAGE

TEAM_NAMESPACE_PREFIX = naming.team_namespace("")

# kind -> paths from the object to its pod spec(s); "*" fans out over a list.
POD_SPEC_PATHS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Pod": (("spec",),),
    "PodTemplate": (("template", "spec"),),
    "Deployment": (("spec", "template", "spec"),),
    "StatefulSet": (("spec", "template", "spec"),),
    "DaemonSet": (("spec", "template", "spec"),),
    "ReplicaSet": (("spec", "template", "spec"),),
    "ReplicationController": (("spec", "template", "spec"),),
    "Job": (("spec", "template", "spec"),),
    "CronJob": (("spec", "jobTemplate", "spec", "template", "spec"),),
    "JobSet": (("spec", "replicatedJobs", "*", "template", "spec", "template", "spec"),),
    "LeaderWorkerSet": (("spec", "leaderWorkerTemplate", "leaderTemplate", "spec"),
                        ("spec", "leaderWorkerTemplate", "workerTemplate", "spec")),
}
CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")
# Pod Security Standards, restricted: the one capability a container may add.
RESTRICTED_ADDABLE = frozenset({"NET_BIND_SERVICE"})
SECCOMP_OK = ("RuntimeDefault", "Localhost")

# Where the GPU nodes' NVMe array is mounted: infra/aws/gpu_nodes.py NVME_HOST_PATH (nodeadm's RAID0
# of the instance store) and infra/gcp/__init__.py NVME_HOST_PATH (the nvme-raid0 DaemonSet's mount).
NVME_ROOTS = ("/mnt/k8s-disks/0", "/mnt/stateful_partition/gpu-train/nvme-raid")
WORKDIR_ROOT = "gpu-train"  # infra/k8s/nvme.py WORKDIR_ROOT
# GKE's driver install (also where the TCPX/TCPXO installers put NCCL's plugin) and the RDMA gIB
# plugin directory (infra/gcp/fabric.py NVIDIA_HOST_LIB, GIB_HOST_DIR).
NVIDIA_HOST_LIB = "/home/kubernetes/bin/nvidia/lib64"
GIB_HOST_DIR = "/home/kubernetes/bin/gib"
READ_ONLY_HOST_PATHS = frozenset({NVIDIA_HOST_LIB, GIB_HOST_DIR})
DEVICE_HOST_PATHS = frozenset({"/dev/aperture_devices"})

UBUNTU = "docker.io/library/ubuntu"
GOOGLE_GPUDIRECT = "us-docker.pkg.dev/gce-ai-infra"


@dataclass(frozen=True, kw_only=True)
class ContainerGrant:
    """What one exempt container may do beyond the usual checks."""

    image: str  # image repository (normalised: registry/path, no tag or digest)
    privileged: bool = False  # privileged; implies running as root with escalation and every capability
    root: bool = False  # may run as UID 0 (not privileged)
    capabilities: frozenset[str] = frozenset()  # may add these capabilities
    host_paths: frozenset[str] = frozenset()  # host paths it may mount (writable, or besides the usual list)


@dataclass(frozen=True, kw_only=True)
class HostAgent:
    """One of the platform's own host agents: an object matched by kind, namespace and name."""

    kind: str
    namespace: str
    name: str
    why: str  # why it needs the host (one sentence, repeated in docs/policies.md)
    host_network: bool = False
    host_pid: bool = False
    host_paths: frozenset[str] = frozenset()  # hostPath volumes the pod may declare
    containers: Mapping[str, ContainerGrant]  # container name -> grant


# The GPU pre-flight check of infra/k8s/health.py (PREFLIGHT_NAME, DCGM_IMAGE, GKE_NVIDIA_DIR), in the GPU
# agents' namespace.
PREFLIGHT_DCGM = "nvcr.io/nvidia/cloud-native/dcgm"
GKE_NVIDIA_DIR = "/home/kubernetes/bin/nvidia"
_NCCL_INSTALLER_WHY = ("Google's NCCL fabric plugin installer copies the plugin onto the host and configures the "
                       "GPU NICs in the host network namespace, from the host's mount namespace (nsenter).")
HOST_AGENTS: tuple[HostAgent, ...] = (
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nvme-raid0", host_pid=True,
              why="Builds a RAID0 array over GKE's raw local NVMe SSDs and mounts it on the host (mdadm, mkfs, "
                  "mount through nsenter into the host's namespaces), then creates each team's work directory.",
              host_paths=frozenset({"/mnt/stateful_partition/gpu-train/nvme-raid"}),
              containers={"raid0": ContainerGrant(image=UBUNTU, privileged=True),
                          "workdirs": ContainerGrant(image=UBUNTU, root=True,
                                                     capabilities=frozenset({"CHOWN", "FOWNER"}))}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nvme-workdirs",
              why="Creates each team's work directory on the node's NVMe array (mounted by nodeadm) and hands it "
                  "to the trainer's UID, which needs root with CAP_CHOWN and CAP_FOWNER only.",
              host_paths=frozenset({"/mnt/k8s-disks/0"}),
              containers={"workdirs": ContainerGrant(image=UBUNTU, root=True,
                                                     capabilities=frozenset({"CHOWN", "FOWNER"}))}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="gpu-preflight",
              why="Checks a new GPU node before it takes work (GPU count, ECC state, DCGM diagnostics, fabric "
                  "devices): it drives every GPU without holding them through the device plugin, so it is "
                  "privileged, and on GKE it runs the driver's tools from the host, read-only.",
              host_paths=frozenset({GKE_NVIDIA_DIR}),
              containers={"check": ContainerGrant(image=PREFLIGHT_DCGM, privileged=True,
                                                  host_paths=frozenset({GKE_NVIDIA_DIR}))}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nccl-tcpx-installer", host_network=True,
              host_pid=True, why=_NCCL_INSTALLER_WHY, host_paths=frozenset({"/var/lib"}),
              containers={
                  "install": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev",
                                            privileged=True),
                  "host-mount": ContainerGrant(image=UBUNTU, privileged=True)}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nccl-tcpxo-installer", host_network=True,
              host_pid=True, why=_NCCL_INSTALLER_WHY, host_paths=frozenset({"/var/lib", "/home/kubernetes/bin"}),
              containers={
                  "install": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev",
                                            privileged=True)}),
    HostAgent(kind="DaemonSet", namespace="gpu-system", name="nccl-rdma-installer", host_network=True,
              host_pid=True, why=_NCCL_INSTALLER_WHY, host_paths=frozenset({NVIDIA_HOST_LIB, GIB_HOST_DIR}),
              containers={
                  "install": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-gib/nccl-plugin-gib",
                                            privileged=True)}),
)

# Google's GPUDirect receive-datapath managers, the native sidecars a TCPX/TCPXO training pod runs next
# to the trainer (infra/gcp/fabric.py): they program flow steering on the GPU NICs and tune the host's
# network sysctls through /sys and /proc/sys, so Google's manifests run them privileged and as root
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx,
# https://github.com/GoogleCloudPlatform/container-engine-accelerators/tree/master/gpudirect-tcpxo).
_RXDM_PATHS = frozenset({"/sys", "/proc/sys", NVIDIA_HOST_LIB})
RXDM_SIDECARS: dict[str, ContainerGrant] = {
    "tcpx-daemon": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpx/tcpgpudmarxd-dev", privileged=True,
                                  host_paths=_RXDM_PATHS),
    "tcpxo-daemon": ContainerGrant(image=f"{GOOGLE_GPUDIRECT}/gpudirect-tcpxo/tcpgpudmarxd-dev", privileged=True,
                                   host_paths=_RXDM_PATHS),
}

# KServe's containers in a serving pod (gpu_train/jobs/serving.py): the model server and the storage initializer.
# KServe publishes its images by tag only, so exactly these references, in containers of exactly these names, are
# exempt from the digest and registry rules, and from nothing else. The team namespaces' admission policies carry
# this grant only where the stack serves models (infra/k8s/pod_admission.py).
SERVING_IMAGES: dict[str, frozenset[str]] = {
    "kserve-container": frozenset(RUNTIME_IMAGES.values()),
    "storage-initializer": frozenset({STORAGE_INITIALIZER_IMAGE}),
}


def serving_image(container: Mapping[str, Any]) -> bool:
    """Whether a container is one of KServe's, by name, running exactly its pinned image."""
    return container.get("image") in SERVING_IMAGES.get(str(container.get("name", "")), frozenset())


_REGISTRY = re.compile(r"^([a-z0-9-]+\.[a-z0-9.-]+|localhost)(:[0-9]+)?$")


def image_repository(image: Any) -> str:
    """`ubuntu:24.04` -> `docker.io/library/ubuntu`; `reg.io/a/b:t@sha256:..` -> `reg.io/a/b`."""
    ref = str(image or "").split("@", 1)[0]
    head, _, last = ref.rpartition("/")
    if ":" in last:
        last = last.split(":", 1)[0]
    parts = [p for p in (head.split("/") if head else []) + [last] if p]
    if not parts:
        return ""
    if len(parts) == 1 or not _REGISTRY.match(parts[0]):
        parts = ["docker.io", *(["library"] if len(parts) == 1 else []), *parts]
    return "/".join(parts)


def repository_of(ref: str) -> str:
    """An image reference without its digest and tag, as written (no registry defaults added)."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    last = last.split(":", 1)[0]
    return f"{head}/{last}" if head else last


def registry_prefix(repository: str) -> str:
    """The platform registry as an image prefix: the trainer repository's parent, with a slash
    (<account>.dkr.ecr.<region>.amazonaws.com/ on ECR; <region>-docker.pkg.dev/<project>/<repository>/ on
    Artifact Registry)."""
    parent = repository.rsplit("/", 1)[0] if "/" in repository else ""
    if not parent:
        raise ValueError(f"registry repository {repository!r} has no registry part")
    return parent + "/"


def image_allowed(image: Any, registries: Sequence[str], repositories: Sequence[str] = ()) -> bool:
    """Whether an image reference comes from the platform registry (a prefix) or is one of the allowed
    repositories at any tag or digest."""
    if not isinstance(image, str):
        return False
    return (any(image.startswith(p) for p in registries)
            or any(image == r or image.startswith((r + ":", r + "@")) for r in repositories))
