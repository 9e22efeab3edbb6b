"""GPU node software: NVIDIA device plugin + GPU feature discovery, the fabric device plugins (AWS EFA)
or NCCL fabric plugin installers (GKE GPUDirect TCPX / TCPXO / RDMA) with their multi-network
objects, all confined to GPU nodes.

Usage: `GpuStack("gpu", GpuStackArgs(platform=platform, namespace=ns))`. Values and manifests are
pure functions (`device_plugin_values`, `efa_plugin_values`, `nccl_installer`, `gke_network_objects`)
tested without mocks. Why the device plugin chart and not the GPU operator: docs/kubernetes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra import naming
from infra.k8s import common
from infra.platform import ClusterPlatform, GpuPool

# https://github.com/NVIDIA/k8s-device-plugin/releases (chart and image share the version).
DEVICE_PLUGIN_CHART = "nvidia-device-plugin"
DEVICE_PLUGIN_REPO = "https://nvidia.github.io/k8s-device-plugin"
DEVICE_PLUGIN_VERSION = "0.20.0"
# https://github.com/aws/eks-charts/tree/master/stable/aws-efa-k8s-device-plugin
EFA_CHART = "aws-efa-k8s-device-plugin"
EFA_REPO = "https://aws.github.io/eks-charts"
EFA_VERSION = "v0.5.30"

# GKE's NCCL fabric plugins, pinned as in Google's installer manifests
# (https://github.com/GoogleCloudPlatform/container-engine-accelerators: gpudirect-tcpx/,
# gpudirect-tcpxo/, gpudirect-rdma/). Each copies the plugin libraries onto the host, where the
# job's pods mount them (platform.gpu_pools[*].fabric.volumes).
HOST_TOOLS_IMAGE = "ubuntu:24.04"  # util-linux's nsenter, to run a command in the host's mount namespace
PAUSE_IMAGE = "gke.gcr.io/pause:3.8@sha256:880e63f94b145e46f1b1082bb71b85e21f16b99b180b9996407d61240ceb9830"
NCCL_INSTALLERS: dict[str, dict[str, Any]] = {
    "tcpx": {
        "name": "nccl-tcpx-installer",
        "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev:v3.1.9",
        "script": "/scripts/container_entry.sh install --install-nccl\n",
        "host_dirs": {"var-lib": ("/var/lib", "/var/lib")},
        # COS mounts /var/lib noexec; the plugin's directory must be executable on the host.
        "host_script": "mount --bind /var/lib/tcpx /var/lib/tcpx && mount -o remount,exec /var/lib/tcpx",
    },
    "tcpxo": {
        "name": "nccl-tcpxo-installer",
        "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev:v1.0.3",
        "script": "/scripts/container_entry.sh install --install-nccl\n"
                  "mkdir -p /usr/local/nvidia/lib64\n"
                  "cp -r /var/lib/tcpxo/lib64/. /usr/local/nvidia/lib64\n",
        "host_dirs": {"var-lib": ("/var/lib", "/var/lib"), "library-dir-host": ("/home/kubernetes/bin", "/usr/local")},
    },
    "rdma": {
        "name": "nccl-rdma-installer",
        "image": "us-docker.pkg.dev/gce-ai-infra/gpudirect-gib/nccl-plugin-gib:v1.0.6",
        "script": "/scripts/container_entry.sh install --install-nccl\n"
                  "cp -r /var/lib/gib/lib64/. /usr/local/home/kubernetes/bin/nvidia/lib64\n"
                  "cp -r /var/lib/gib/. /usr/local/home/kubernetes/bin/gib\n",
        "host_dirs": {
            "library-dir-host": ("/home/kubernetes/bin/nvidia/lib64", "/usr/local/home/kubernetes/bin/nvidia/lib64"),
            "gib": ("/home/kubernetes/bin/gib", "/usr/local/home/kubernetes/bin/gib"),
        },
    },
}


def managed_device_plugin(pool: GpuPool) -> bool:
    """GKE node pools run Google's own device plugin (with the driver installer); a second plugin
    would register nvidia.com/gpu twice. Everywhere else we install NVIDIA's."""
    return pool.provisioner == "node-pool"


def device_plugin_values(pools: list[GpuPool], system_selector: dict[str, str]) -> dict[str, Any]:
    """Values for NVIDIA's device-plugin chart: the plugin + GFD on the given GPU pools only, node
    feature discovery's controller on system nodes."""
    if not pools:
        raise ValueError("device_plugin_values needs at least one GPU pool")
    tolerations = common.gpu_tolerations(pools)
    affinity = common.pool_affinity(pools)
    return {
        "devicePlugin": {"enabled": True},
        "gfd": {"enabled": True},
        # Both the driver and the container toolkit come with the node image (AL2023 NVIDIA AMI).
        "affinity": affinity,
        "tolerations": tolerations,
        "priorityClassName": "system-node-critical",
        "resources": common.resources("50m", "64Mi", "200m", "128Mi"),
        "nfd": {
            "master": {"nodeSelector": system_selector,
                       "resources": common.resources("50m", "128Mi", "500m", "512Mi")},
            "gc": {"nodeSelector": system_selector,
                   "resources": common.resources("10m", "64Mi", "100m", "128Mi")},
            "worker": {"affinity": affinity, "tolerations": tolerations,
                       "resources": common.resources("20m", "64Mi", "200m", "256Mi")},
        },
    }


def efa_plugin_values(pools: list[GpuPool]) -> dict[str, Any]:
    """Values for the EFA device plugin: only on nodes labelled with the EFA fabric."""
    return {
        "nodeSelector": {naming.FABRIC_LABEL: "efa"},
        "tolerations": common.gpu_tolerations(pools),
        "resources": common.resources("10m", "20Mi", "100m", "64Mi"),
    }


def nccl_installer(kind: str, pools: list[GpuPool], namespace: str) -> dict[str, Any]:
    """The DaemonSet manifest (metadata + spec) that installs GKE's NCCL plugin for one fabric kind
    on the nodes labelled with that fabric. It must be privileged: it writes libraries and
    bind-mounts into the host (see infra/k8s/checkov-skips.yaml)."""
    if kind not in NCCL_INSTALLERS:
        raise ValueError(f"no NCCL plugin installer for fabric kind {kind!r} (known: {sorted(NCCL_INSTALLERS)})")
    spec = NCCL_INSTALLERS[kind]
    labels = {"app.kubernetes.io/name": spec["name"], "app.kubernetes.io/part-of": "gpu-train"}
    # host_dirs: volume name -> (directory on the host, where the installer sees it).
    volumes = [{"name": v, "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
               for v, (host, _) in spec["host_dirs"].items()]
    mounts = [{"name": v, "mountPath": inside} for v, (_, inside) in spec["host_dirs"].items()]
    privileged = {"privileged": True, "readOnlyRootFilesystem": False}
    pause_security = {**common.restricted_container_security()}
    return {
        "metadata": {"name": spec["name"], "namespace": namespace, "labels": labels,
                     "annotations": common.checkov_skip_annotations(spec["name"])},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": spec["name"]}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "affinity": common.pool_affinity(
                        pools, [{"key": naming.FABRIC_LABEL, "operator": "In", "values": [kind]}]),
                    "tolerations": common.gpu_tolerations(pools),
                    "hostPID": True,
                    "hostNetwork": True,
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "volumes": volumes,
                    "initContainers": [{
                        "name": "install",
                        "image": spec["image"],
                        "imagePullPolicy": "Always",
                        "command": ["/bin/sh", "-c"],
                        "args": ["set -ex\n" + spec["script"] + "echo installed\n"],
                        "resources": common.resources("150m", "256Mi", "1", "1Gi"),
                        "securityContext": privileged,
                        "volumeMounts": mounts,
                    }, *([{
                        "name": "host-mount",
                        "image": HOST_TOOLS_IMAGE,
                        "imagePullPolicy": "Always",
                        "command": ["nsenter", "--target", "1", "--mount", "--", "sh", "-c", spec["host_script"]],
                        "resources": common.resources("10m", "32Mi", "100m", "64Mi"),
                        "securityContext": privileged,
                    }] if "host_script" in spec else [])],
                    "containers": [{
                        "name": "pause",
                        "image": PAUSE_IMAGE,
                        "imagePullPolicy": "Always",
                        "resources": common.resources("1m", "8Mi", "10m", "16Mi"),
                        "securityContext": pause_security,
                    }],
                },
            },
        },
    }


def gke_network_objects(pools: list[GpuPool]) -> list[dict[str, Any]]:
    """GKENetworkParamSet + Network (networking.gke.io/v1) per fabric network of the pools; each
    pool's pod annotations (fabric.annotations) refer to the Network objects by name.
    See https://cloud.google.com/kubernetes-engine/docs/how-to/setup-multinetwork-support-for-pods."""
    objects: dict[str, list[dict[str, Any]]] = {}
    for pool in pools:
        for net in pool.fabric.networks:
            name = net.get("name")
            mode = net.get("deviceMode")
            if not name or mode not in ("NetDevice", "RDMA"):
                raise ValueError(f"gpu pool {pool.name!r}: fabric network {net!r} needs a name and "
                                 f"deviceMode NetDevice or RDMA")
            if "vpc" not in net or "subnet" not in net:
                raise ValueError(f"gpu pool {pool.name!r}: fabric network {name!r} needs vpc and subnet")
            if name in objects:
                continue  # pools in the same zone share their fabric networks
            objects[name] = [
                {"apiVersion": "networking.gke.io/v1", "kind": "GKENetworkParamSet",
                 "metadata": {"name": name},
                 "spec": {"vpc": net["vpc"], "vpcSubnet": net["subnet"], "deviceMode": mode}},
                {"apiVersion": "networking.gke.io/v1", "kind": "Network",
                 "metadata": {"name": name},
                 "spec": {"type": "Device",
                          "parametersRef": {"group": "networking.gke.io", "kind": "GKENetworkParamSet",
                                            "name": name}}},
            ]
    return [o for pair in objects.values() for o in pair]


def gpu_network_policies(platform: ClusterPlatform) -> list[common.Policy]:
    """Plugins need DNS and the API server (NFD/GFD label nodes); the device plugins talk to the
    kubelet over a host socket, which NetworkPolicy does not govern."""
    return [
        common.default_deny(),
        common.allow_dns(),
        common.allow_api_server(platform.api_server_cidrs),
        common.allow_same_namespace(),
    ]


@dataclass(frozen=True, kw_only=True)
class GpuStackArgs:
    platform: ClusterPlatform  # the cluster contract (pools, fabric, provider)
    namespace: str  # namespace created for the plugins (with default-deny NetworkPolicies)
    depends_on: tuple[pulumi.Resource, ...] = ()


class GpuStack(pulumi.ComponentResource):
    """Device + fabric plugins on GPU nodes."""

    def __init__(self, name: str, args: GpuStackArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:GpuStack", name, None, opts)
        p = args.platform
        # Privileged: the NCCL installers and the NVMe DaemonSet write to the host.
        self.namespace = common.namespace(args.namespace, p, self, enforce="privileged",
                                          depends_on=[*p.ready, *args.depends_on])
        self.network_policies = common.network_policies(args.namespace, gpu_network_policies(p), p, self,
                                                        [self.namespace])
        deps = [*p.ready, *args.depends_on, self.namespace]
        self.releases: list[k8s.helm.v3.Release] = []
        self.daemonsets: list[k8s.apps.v1.DaemonSet] = []
        self.networks: list[k8s.apiextensions.CustomResource] = []

        plugin_pools = [pool for pool in p.gpu_pools if not managed_device_plugin(pool)]
        if plugin_pools:
            self.releases.append(k8s.helm.v3.Release(
                f"{name}-device-plugin",
                name="nvidia-device-plugin",
                chart=DEVICE_PLUGIN_CHART,
                version=DEVICE_PLUGIN_VERSION,
                repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=DEVICE_PLUGIN_REPO),
                namespace=args.namespace,
                values=device_plugin_values(plugin_pools, dict(p.system_node_selector)),
                opts=common.k8s_opts(p, self, deps)))

        efa_pools = [pool for pool in p.gpu_pools if pool.fabric.kind == "efa"]
        if efa_pools:
            self.releases.append(k8s.helm.v3.Release(
                f"{name}-efa-plugin",
                name="aws-efa-k8s-device-plugin",
                chart=EFA_CHART,
                version=EFA_VERSION,
                repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=EFA_REPO),
                namespace=args.namespace,
                values=efa_plugin_values(efa_pools),
                opts=common.k8s_opts(p, self, deps)))

        for kind in sorted({pool.fabric.kind for pool in p.gpu_pools} & set(NCCL_INSTALLERS)):
            pools = [pool for pool in p.gpu_pools if pool.fabric.kind == kind]
            manifest = nccl_installer(kind, pools, args.namespace)
            self.daemonsets.append(k8s.apps.v1.DaemonSet(
                f"{name}-{manifest['metadata']['name']}", metadata=manifest["metadata"], spec=manifest["spec"],
                opts=common.k8s_opts(p, self, deps)))

        for obj in gke_network_objects(list(p.gpu_pools)):
            self.networks.append(k8s.apiextensions.CustomResource(
                f"{name}-{obj['kind'].lower()}-{obj['metadata']['name']}",
                api_version=obj["apiVersion"], kind=obj["kind"], metadata=obj["metadata"], spec=obj["spec"],
                opts=common.k8s_opts(p, self, p.ready)))

        self.register_outputs({"releases": [r.name for r in self.releases],
                               "fabric_networks": [n.metadata for n in self.networks]})
