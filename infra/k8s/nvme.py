"""RAID0 + mount of the GPU nodes' raw local NVMe disks, for clouds whose node bootstrap leaves them
as raw block devices (GKE `localNvmeSsdBlockConfig`); used when `platform.nvme_setup == "daemonset"`.

Usage: `NvmeSetup("nvme", NvmeSetupArgs(platform=platform, namespace="gpu-system"))`. The manifest is
the pure function `nvme_daemonset(...)`. The DaemonSet is privileged with the host's PID namespace
(it runs mdadm/mkfs/mount in the host's mount namespace); checkov's matching checks are skipped for
it by name in infra/k8s/checkov-skips.yaml.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.k8s import common
from infra.k8s.gpu import HOST_TOOLS_IMAGE, PAUSE_IMAGE
from infra.platform import ClusterPlatform, GpuPool

NAME = "nvme-raid0"
# GKE names raw local SSDs /dev/disk/by-id/google-local-nvme-ssd-N
# (https://cloud.google.com/kubernetes-engine/docs/how-to/persistent-volumes/local-ssd-raw).
DEVICE_GLOB = "/dev/disk/by-id/google-local-nvme-ssd-*"
MD_DEVICE = "/dev/md/gpu-train-nvme"


def raid_script(host_path: str, device_glob: str = DEVICE_GLOB) -> str:
    """Idempotent shell script run in the host's mount namespace: assemble or create the RAID0,
    format it once, mount it at host_path. Safe to re-run after a pod restart or node reboot."""
    if not host_path.startswith("/") or host_path == "/":
        raise ValueError(f"platform.nvme_host_path must be an absolute directory, not {host_path!r}")
    path = shlex.quote(host_path)
    md = shlex.quote(MD_DEVICE)
    return "\n".join([
        "set -eu",
        f"if mountpoint -q {path}; then echo 'already mounted'; exit 0; fi",
        f"devices=$(ls {device_glob} 2>/dev/null || true)",
        'if [ -z "$devices" ]; then echo "no local NVMe devices found" >&2; exit 1; fi',
        "count=$(echo $devices | wc -w)",
        f"if [ ! -e {md} ]; then mdadm --assemble {md} $devices 2>/dev/null || "
        f"mdadm --create {md} --level=0 --force --raid-devices=$count $devices --run; fi",
        f"blkid {md} >/dev/null 2>&1 || mkfs.ext4 -F -m 0 -E lazy_itable_init=1 {md}",
        f"mkdir -p {path}",
        f"mount -o noatime,discard {md} {path}",
        f"chmod 0755 {path}",
        "echo mounted",
    ])


def nvme_daemonset(host_path: str, pools: list[GpuPool], namespace: str) -> dict[str, Any]:
    """The DaemonSet (metadata + spec): an init container prepares the disks on every GPU node,
    then a pause container keeps the pod (and the node's readiness for it) visible."""
    if not pools:
        raise ValueError("nvme_daemonset needs at least one GPU pool")
    labels = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "gpu-train"}
    return {
        "metadata": {"name": NAME, "namespace": namespace, "labels": labels,
                     "annotations": common.checkov_skip_annotations(NAME)},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "affinity": common.pool_affinity(pools),
                    "tolerations": common.gpu_tolerations(pools),
                    "hostPID": True,
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": [{
                        "name": "raid0",
                        "image": HOST_TOOLS_IMAGE,
                        "imagePullPolicy": "Always",
                        "command": ["nsenter", "--target", "1", "--mount", "--uts", "--ipc", "--net", "--",
                                    "sh", "-c", raid_script(host_path)],
                        "resources": common.resources("50m", "64Mi", "1", "256Mi"),
                        "securityContext": {"privileged": True, "readOnlyRootFilesystem": True},
                    }],
                    "containers": [{
                        "name": "pause",
                        "image": PAUSE_IMAGE,
                        "imagePullPolicy": "Always",
                        "resources": common.resources("1m", "8Mi", "10m", "16Mi"),
                        "securityContext": common.restricted_container_security(),
                    }],
                },
            },
        },
    }


@dataclass(frozen=True, kw_only=True)
class NvmeSetupArgs:
    platform: ClusterPlatform  # nvme_host_path, GPU pools, provider
    namespace: str  # where the DaemonSet runs
    depends_on: tuple[pulumi.Resource, ...] = ()


class NvmeSetup(pulumi.ComponentResource):
    """The NVMe RAID0 DaemonSet on GPU nodes."""

    def __init__(self, name: str, args: NvmeSetupArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:NvmeSetup", name, None, opts)
        p = args.platform
        manifest = nvme_daemonset(p.nvme_host_path, list(p.gpu_pools), args.namespace)
        self.daemonset = k8s.apps.v1.DaemonSet(
            f"{name}-daemonset", metadata=manifest["metadata"], spec=manifest["spec"],
            opts=common.k8s_opts(p, self, [*p.ready, *args.depends_on]))
        self.host_path: str = p.nvme_host_path
        self.register_outputs({"host_path": self.host_path})
