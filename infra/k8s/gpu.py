"""GPU node software, as the cloud layer describes it (platform.node_addons): NVIDIA's device plugin and GPU
feature discovery where the cloud runs none of its own, each fabric's device plugin chart, its host installers
and its cluster objects, all confined to GPU nodes.

Usage: `GpuStack("gpu", GpuStackArgs(platform=platform, namespace=ns))`. Values and manifests are pure functions
(`device_plugin_values`, `fabric_plugin_values`, `host_installer`) tested without mocks. Which plugins a cloud
needs is the cloud layer's knowledge (infra/aws/node_addons.py, infra/gcp/node_addons.py); this module installs
what it is given. Why the device plugin chart and not the GPU operator: docs/kubernetes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec.contract import GpuPool
from infra.k8s import common
from infra.platform import ClusterPlatform, DevicePlugin, HostInstaller

# https://github.com/NVIDIA/k8s-device-plugin/releases (chart and image share the version).
DEVICE_PLUGIN_CHART = "nvidia-device-plugin"
DEVICE_PLUGIN_REPO = "https://nvidia.github.io/k8s-device-plugin"
DEVICE_PLUGIN_VERSION = "0.20.0"
# Images of the host installers' helper containers: util-linux's nsenter to run a command in the host's mount
# namespace, and a pause container to idle in once the work is done (also used by infra/k8s/nvme.py).
HOST_TOOLS_IMAGE = "ubuntu:24.04"
PAUSE_IMAGE = "gke.gcr.io/pause:3.8@sha256:880e63f94b145e46f1b1082bb71b85e21f16b99b180b9996407d61240ceb9830"


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


def fabric_plugin_values(plugin: DevicePlugin, pools: list[GpuPool]) -> dict[str, Any]:
    """Values for a fabric's device-plugin chart: only on the nodes labelled with that fabric."""
    return {
        "nodeSelector": {naming.FABRIC_LABEL: plugin.fabric},
        "tolerations": common.gpu_tolerations(pools),
        "resources": common.resources("10m", "20Mi", "100m", "64Mi"),
    }


def host_installer(installer: HostInstaller, pools: list[GpuPool], namespace: str) -> dict[str, Any]:
    """The DaemonSet manifest (metadata + spec) of a host installer on the nodes labelled with its fabric. It must be
    privileged: it writes libraries and bind-mounts into the host (see infra/k8s/checkov-skips.yaml)."""
    labels = {"app.kubernetes.io/name": installer.name, "app.kubernetes.io/part-of": "gpu-train"}
    # host_dirs: volume name -> (directory on the host, where the installer sees it).
    volumes = [{"name": v, "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
               for v, (host, _) in installer.host_dirs.items()]
    mounts = [{"name": v, "mountPath": inside} for v, (_, inside) in installer.host_dirs.items()]
    privileged = {"privileged": True, "readOnlyRootFilesystem": False}
    pause_security = {**common.restricted_container_security()}
    return {
        "metadata": {"name": installer.name, "namespace": namespace, "labels": labels,
                     "annotations": common.checkov_skip_annotations(installer.name)},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": installer.name}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "affinity": common.pool_affinity(
                        pools, [{"key": naming.FABRIC_LABEL, "operator": "In", "values": [installer.fabric]}]),
                    "tolerations": common.gpu_tolerations(pools),
                    "hostPID": True,
                    "hostNetwork": True,
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "volumes": volumes,
                    "initContainers": [{
                        "name": "install",
                        "image": installer.image,
                        "imagePullPolicy": "Always",
                        "command": ["/bin/sh", "-c"],
                        "args": ["set -ex\n" + installer.script + "echo installed\n"],
                        "resources": common.resources("150m", "256Mi", "1", "1Gi"),
                        "securityContext": privileged,
                        "volumeMounts": mounts,
                    }, *([{
                        "name": "host-mount",
                        "image": HOST_TOOLS_IMAGE,
                        "imagePullPolicy": "Always",
                        "command": ["nsenter", "--target", "1", "--mount", "--", "sh", "-c", installer.host_script],
                        "resources": common.resources("10m", "32Mi", "100m", "64Mi"),
                        "securityContext": privileged,
                    }] if installer.host_script else [])],
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
    platform: ClusterPlatform  # pools, fabric, provider
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

        addons = p.node_addons
        if addons.device_plugin:
            self.releases.append(common.helm_release(
                f"{name}-device-plugin", "nvidia-device-plugin", DEVICE_PLUGIN_CHART, DEVICE_PLUGIN_VERSION,
                DEVICE_PLUGIN_REPO, args.namespace,
                values=device_plugin_values(list(p.gpu_pools), dict(p.system_node_selector)),
                opts=common.k8s_opts(p, self, deps)))

        for plugin in addons.device_plugins:
            pools = common.fabric_pools(p.gpu_pools, plugin.fabric)
            self.releases.append(common.helm_release(
                f"{name}-{plugin.fabric}-plugin", plugin.release, plugin.chart, plugin.version, plugin.repo,
                args.namespace, values=fabric_plugin_values(plugin, pools),
                opts=common.k8s_opts(p, self, deps)))

        for installer in addons.installers:
            pools = common.fabric_pools(p.gpu_pools, installer.fabric)
            manifest = host_installer(installer, pools, args.namespace)
            self.daemonsets.append(k8s.apps.v1.DaemonSet(
                f"{name}-{manifest['metadata']['name']}", metadata=manifest["metadata"], spec=manifest["spec"],
                opts=common.k8s_opts(p, self, deps)))

        for obj in addons.cluster_objects:
            self.networks.append(k8s.apiextensions.CustomResource(
                f"{name}-{obj['kind'].lower()}-{obj['metadata']['name']}",
                api_version=obj["apiVersion"], kind=obj["kind"], metadata=obj["metadata"], spec=obj["spec"],
                opts=common.k8s_opts(p, self, p.ready)))

        self.register_outputs({"releases": [r.name for r in self.releases],
                               "fabric_networks": [n.metadata for n in self.networks]})
