"""Prepare the GPU nodes' local NVMe for training pods, on every GPU node of both clouds.

Usage: `NvmeSetup("nvme", NvmeSetupArgs(platform=platform, namespace="gpu-system",
team_namespaces=("team-research", ...)))`. The manifest is the pure function `nvme_daemonset(...)`.

One DaemonSet on all GPU pools, with up to two init steps and a pause container:
1. `raid0` (only when the cloud hands over raw local NVMe devices, `platform.node_addons.nvme_device_glob`, as
   GKE's `localNvmeSsdBlockConfig` does): RAID0 + format + mount at `nvme_host_path`. It runs
   mdadm/mkfs/mount in the host's mount namespace, so it is privileged with the host PID namespace.
   On EKS, nodeadm already assembles and mounts the instance store, so this step is absent.
2. `workdirs` (always): creates `<nvme_host_path>/gpu-train/<team namespace>` for every team, owned by
   the trainer image's user (naming.TRAINER_UID) with mode 0700. Training pods mount their namespace's
   directory with hostPath type `Directory`, so they never need root to fix ownership. It also creates
   the Alluxio workers' page store, `<nvme_host_path>/alluxio`, owned by Alluxio's user
   (infra/k8s/cache.py): the chart mounts it with hostPath type `DirectoryOrCreate`, and a directory the
   kubelet creates belongs to root, which the worker cannot write. This step runs as root but is not
   privileged: it holds only CAP_CHOWN and CAP_FOWNER, cannot escalate, and sees the host only through
   one hostPath volume of the NVMe root.

Both steps are idempotent (safe after a pod restart, a node reboot or a new team). checkov's matching
checks are skipped for these DaemonSets by name in infra/k8s/checkov-skips.yaml, each with its reason.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from infra.k8s import cache, common
from infra.k8s.gpu import HOST_TOOLS_IMAGE, PAUSE_IMAGE
from infra.platform import ClusterPlatform

# Object names: the RAID variant (GKE) holds a privileged container, the other (EKS) does not, so each
# carries only the checkov skips it needs.
RAID_NAME = "nvme-raid0"
WORKDIRS_NAME = "nvme-workdirs"
MD_DEVICE = "/dev/md/gpu-train-nvme"
# Where the workdirs step sees the node's NVMe root.
NVME_MOUNT = "/nvme"
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Directories under the NVMe root that belong to a service's user: (name, uid, gid).
SERVICE_DIRS: tuple[tuple[str, int, int], ...] = ((cache.PAGE_STORE_DIR, cache.ALLUXIO_UID, cache.ALLUXIO_UID),)


def _check_host_path(host_path: str) -> None:
    if not host_path.startswith("/") or host_path.rstrip("/") == "":
        raise ValueError(f"platform.nvme_host_path must be an absolute directory, not {host_path!r}")


def raid_script(host_path: str, device_glob: str) -> str:
    """Idempotent shell script run in the host's mount namespace: assemble or create the RAID0,
    format it once, mount it at host_path. Safe to re-run after a pod restart or node reboot."""
    _check_host_path(host_path)
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


def workdirs_script(uid: int = naming.TRAINER_UID, gid: int | None = None, root: str = NVME_MOUNT,
                    service_dirs: Sequence[tuple[str, int, int]] = SERVICE_DIRS) -> str:
    """Idempotent shell script: for every namespace given as an argument, make
    <root>/gpu-train/<namespace> owned by uid:gid (gid defaults to uid) with mode 0700. The parent stays root-owned 0755, so
    one team's pods cannot reach another team's directory through it. Each service directory
    <root>/<name> is made owned by its uid:gid, mode 0700 (ownership is re-applied on every run, so
    a directory the kubelet created first is fixed too)."""
    base = shlex.quote(f"{root.rstrip('/')}/{naming.WORKDIR_ROOT}")
    lines = [
        "set -eu",
        f"mkdir -p {base}",
        f"chmod 0755 {base}",
    ]
    for name, owner, group in service_dirs:
        if not _NAMESPACE.fullmatch(name):
            raise ValueError(f"nvme service directory {name!r} must be one plain path segment")
        path = shlex.quote(f"{root.rstrip('/')}/{name}")
        lines += [f"mkdir -p {path}", f"chown {int(owner)}:{int(group)} {path}", f"chmod 0700 {path}",
                  f"echo ready: {path}"]
    lines += [
        'for ns in "$@"; do',
        f'  dir={base}/"$ns"',
        '  mkdir -p "$dir"',
        f'  chown {uid}:{uid if gid is None else gid} "$dir"',
        '  chmod 0700 "$dir"',  # not the owner any more: needs CAP_FOWNER
        '  echo "ready: $dir"',
        "done",
    ]
    return "\n".join(lines)


def workdirs_container(namespaces: Sequence[str], uid: int = naming.TRAINER_UID) -> dict[str, Any]:
    """The init container that creates the per-team work directories (root, CHOWN/FOWNER only)."""
    if not namespaces:
        raise ValueError("nvme workdirs: no team namespaces (gpu-train:teams must list at least one team)")
    bad = [ns for ns in namespaces if not isinstance(ns, str) or len(ns) > 63 or not _NAMESPACE.fullmatch(ns)]
    if bad:
        raise ValueError(f"nvme workdirs: {bad} are not Kubernetes namespace names")
    return {
        "name": "workdirs",
        "image": HOST_TOOLS_IMAGE,
        "imagePullPolicy": "Always",
        # $0 is a label for error messages; the namespaces follow as "$@".
        "command": ["sh", "-c", workdirs_script(uid), "nvme-workdirs", *sorted(set(namespaces))],
        "volumeMounts": [{"name": "nvme", "mountPath": NVME_MOUNT}],
        "resources": common.resources("10m", "16Mi", "100m", "64Mi"),
        # Root, because changing a file's owner always needs CAP_CHOWN and the NVMe root is root-owned;
        # but only CHOWN (chown) and FOWNER (chmod of a directory it no longer owns), nothing else.
        "securityContext": {
            "runAsUser": 0,
            "runAsGroup": 0,
            "runAsNonRoot": False,
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def raid_container(host_path: str, device_glob: str) -> dict[str, Any]:
    """The privileged init container that builds and mounts the RAID0 in the host's mount namespace."""
    return {
        "name": "raid0",
        "image": HOST_TOOLS_IMAGE,
        "imagePullPolicy": "Always",
        "command": ["nsenter", "--target", "1", "--mount", "--uts", "--ipc", "--net", "--",
                    "sh", "-c", raid_script(host_path, device_glob)],
        "resources": common.resources("50m", "64Mi", "1", "256Mi"),
        "securityContext": {"privileged": True, "readOnlyRootFilesystem": True},
    }


def nvme_daemonset(host_path: str, pools: Sequence[GpuPool], namespace: str, *, device_glob: str,
                   team_namespaces: Sequence[str]) -> dict[str, Any]:
    """The DaemonSet (metadata + spec): init steps prepare the disks (a RAID0 of `device_glob`, when the cloud
    leaves raw devices) and the team directories on every GPU node, then a pause container keeps the pod (and the
    node's readiness for it) visible."""
    raid = bool(device_glob)
    if not pools:
        raise ValueError("nvme_daemonset needs at least one GPU pool")
    _check_host_path(host_path)
    name = RAID_NAME if raid else WORKDIRS_NAME
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "gpu-train"}
    init = [raid_container(host_path, device_glob)] if raid else []
    init.append(workdirs_container(team_namespaces))
    pod: dict[str, Any] = {
        "affinity": common.pool_affinity(pools),
        "tolerations": common.gpu_tolerations(pools),
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": init,
        "containers": [{
            "name": "pause",
            "image": PAUSE_IMAGE,
            "imagePullPolicy": "Always",
            "resources": common.resources("1m", "8Mi", "10m", "16Mi"),
            "securityContext": common.restricted_container_security(),
        }],
        "volumes": [{"name": "nvme", "hostPath": {
            "path": host_path,
            # Without raw devices the node's bootstrap mounted the array before the kubelet started, so the
            # directory must exist. With them the raid0 step mounts the array over this path, after the kubelet
            # set up the pod's volumes; the workdirs container is created after raid0 finished, so its
            # bind mount of the path shows the RAID filesystem.
            "type": "DirectoryOrCreate" if raid else "Directory",
        }}],
    }
    if raid:
        pod["hostPID"] = True  # nsenter --target 1
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "annotations": common.checkov_skip_annotations(name)},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


@dataclass(frozen=True, kw_only=True)
class NvmeSetupArgs:
    platform: ClusterPlatform  # nvme_host_path, node_addons.nvme_device_glob, GPU pools, provider
    namespace: str  # where the DaemonSet runs
    team_namespaces: tuple[str, ...]  # one work directory per team namespace on every GPU node
    depends_on: tuple[pulumi.Resource, ...] = ()


class NvmeSetup(pulumi.ComponentResource):
    """The NVMe DaemonSet on GPU nodes: RAID0 + mount where the cloud leaves raw disks, and the
    per-team work directories everywhere."""

    def __init__(self, name: str, args: NvmeSetupArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:NvmeSetup", name, None, opts)
        p = args.platform
        manifest = nvme_daemonset(p.nvme_host_path, list(p.gpu_pools), args.namespace,
                                  device_glob=p.node_addons.nvme_device_glob, team_namespaces=args.team_namespaces)
        self.daemonset = k8s.apps.v1.DaemonSet(
            f"{name}-daemonset", metadata=manifest["metadata"], spec=manifest["spec"],
            opts=common.k8s_opts(p, self, [*p.ready, *args.depends_on]))
        self.host_path: str = p.nvme_host_path
        self.register_outputs({"host_path": self.host_path})
