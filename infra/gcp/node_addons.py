"""What GKE's GPU nodes need and give, for the platform contract: pools as jobs see them and the node add-ons.

Usage:
    pools = gpu_pools(settings)                   # before any resource: the platform's GpuPools (fabric, allocatable)
    addons = node_addons(settings, network_names)  # for ClusterPlatform.node_addons

GKE runs its own NVIDIA device plugin with the driver installer on GPU node pools, so the platform installs
none; the driver's libraries and tools live on the host under /home/kubernetes/bin/nvidia
(https://cloud.google.com/kubernetes-engine/docs/how-to/gpus#cuda), where agents that use the GPUs directly
(DCGM exporter, the pre-flight check) mount them. The local SSDs arrive as raw block devices
(localNvmeSsdBlockConfig) named /dev/disk/by-id/google-local-nvme-ssd-N
(https://cloud.google.com/kubernetes-engine/docs/how-to/persistent-volumes/local-ssd-raw), which the
Kubernetes layer assembles into a RAID0. GPUDirect-TCPX/TCPXO/RDMA need Google's NCCL plugin installers
(https://github.com/GoogleCloudPlatform/container-engine-accelerators: gpudirect-tcpx/, gpudirect-tcpxo/,
gpudirect-rdma/) and one Network + GKENetworkParamSet per fabric network
(https://cloud.google.com/kubernetes-engine/docs/how-to/setup-multinetwork-support-for-pods).

A node's allocatable follows GKE's published reservation
(https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes): kube-reserved CPU of 6% of the first
core, 1% of the second, 0.5% of the next two and 0.25% above four; memory 25% of the first 4 GiB, 20% of the
next 4, 10% of the next 8, 6% of the next 112 and 2% above 128 GiB; plus the 100 MiB eviction threshold, with the
machine's memory taken 7.5% below nominal for what the hypervisor and kernel keep.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from gpu_train.spec import naming
from gpu_train.spec.catalog.gcp import machine_spec
from gpu_train.spec.contract import Allocatable, GpuPool
from gpu_train.spec.settings import StackSettings
from infra.gcp.fabric import fabric_contract
from infra.gcp.network import FabricSetPlan, fabric_sets, pool_fabric_key
from infra.platform import FabricProbe, HostInstaller, NodeAddons, left_for_pods

GIB = 2**30
MIB = 2**20
DRIVER_HOST_PATH = "/home/kubernetes/bin/nvidia"
NVME_DEVICE_GLOB = "/dev/disk/by-id/google-local-nvme-ssd-*"
# Pinned as in Google's installer manifests; each copies the plugin libraries onto the host, where the job's pods
# mount them (the pools' fabric volumes).
NCCL_INSTALLERS: dict[str, HostInstaller] = {
    "tcpx": HostInstaller(
        fabric="tcpx", name="nccl-tcpx-installer",
        image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/nccl-plugin-gpudirecttcpx-dev:v3.1.9",
        script="/scripts/container_entry.sh install --install-nccl\n",
        host_dirs={"var-lib": ("/var/lib", "/var/lib")},
        # COS mounts /var/lib noexec; the plugin's directory must be executable on the host.
        host_script="mount --bind /var/lib/tcpx /var/lib/tcpx && mount -o remount,exec /var/lib/tcpx"),
    "tcpxo": HostInstaller(
        fabric="tcpxo", name="nccl-tcpxo-installer",
        image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/nccl-plugin-gpudirecttcpx-dev:v1.0.3",
        script="/scripts/container_entry.sh install --install-nccl\nmkdir -p /usr/local/nvidia/lib64\n"
               "cp -r /var/lib/tcpxo/lib64/. /usr/local/nvidia/lib64\n",
        host_dirs={"var-lib": ("/var/lib", "/var/lib"), "library-dir-host": ("/home/kubernetes/bin", "/usr/local")}),
    "rdma": HostInstaller(
        fabric="rdma", name="nccl-rdma-installer",
        image="us-docker.pkg.dev/gce-ai-infra/gpudirect-gib/nccl-plugin-gib:v1.0.6",
        script="/scripts/container_entry.sh install --install-nccl\n"
               "cp -r /var/lib/gib/lib64/. /usr/local/home/kubernetes/bin/nvidia/lib64\n"
               "cp -r /var/lib/gib/. /usr/local/home/kubernetes/bin/gib\n",
        host_dirs={
            "library-dir-host": ("/home/kubernetes/bin/nvidia/lib64", "/usr/local/home/kubernetes/bin/nvidia/lib64"),
            "gib": ("/home/kubernetes/bin/gib", "/usr/local/home/kubernetes/bin/gib")}),
}
_CPU_TIERS = ((0, 1, Fraction(6, 100)), (1, 2, Fraction(1, 100)), (2, 4, Fraction(5, 1000)),
              (4, 1 << 31, Fraction(25, 10000)))
_MEMORY_TIERS = ((0, 4, Fraction(25, 100)), (4, 8, Fraction(20, 100)), (8, 16, Fraction(10, 100)),
                 (16, 128, Fraction(6, 100)), (128, 1 << 40, Fraction(2, 100)))
VM_MEMORY_OVERHEAD = Fraction(75, 1000)
EVICTION_MEMORY = 100 * MIB


def kubelet_allocatable(machine_type: str) -> tuple[Fraction, Fraction]:
    """(cores, bytes) the kubelet offers to pods on a node of this machine type."""
    spec = machine_spec(machine_type)
    cpu = Fraction(spec.vcpus) - sum((Fraction(max(0, min(spec.vcpus, end) - start)) * pct
                                      for start, end, pct in _CPU_TIERS), Fraction(0))
    memory = Fraction(spec.memory_gib * GIB) * (1 - VM_MEMORY_OVERHEAD)
    reserved = Fraction(255 * MIB) if memory < GIB else sum(
        (max(Fraction(0), min(memory, end * GIB) - start * GIB) * pct for start, end, pct in _MEMORY_TIERS),
        Fraction(0))
    return cpu, memory - reserved - EVICTION_MEMORY


def allocatable(machine_type: str) -> Allocatable:
    """What a GPU node of this machine type leaves to a training pod."""
    return left_for_pods(*kubelet_allocatable(machine_type))


def gpu_pools(s: StackSettings) -> list[GpuPool]:
    """Every GPU pool as a job sees it, from the settings alone (no cloud call)."""
    sets = fabric_sets(s) if any(p.fabric for p in s.gpu_pools) else {}
    out = []
    for p in s.gpu_pools:
        spec = machine_spec(p.instance_type)
        key = pool_fabric_key(p)
        out.append(GpuPool(
            name=p.name, instance_type=p.instance_type, capacity=p.capacity, gpu_type=spec.gpu_type,
            gpus_per_node=spec.gpus, min_nodes=p.min_nodes, max_nodes=p.max_nodes, zone=p.zone,
            node_selector={naming.POOL_LABEL: p.name}, tolerations=naming.gpu_tolerations(),
            fabric=fabric_contract(sets[key] if key else None, p.instance_type), provisioner="node-pool",
            allocatable=allocatable(p.instance_type)))
    return out


def fabric_probe(fset: FabricSetPlan | None) -> FabricProbe:
    """What the pre-flight check counts: GPUDirect-TCPX/TCPXO, one gVNIC per fabric network plus the node's
    primary gVNIC; RDMA (A3 Ultra, A4), one ConnectX NIC per RDMA network (their extra gVNIC is not GPU traffic)."""
    if fset is None:
        return FabricProbe(probe="none", devices=0)
    if fset.kind in ("tcpx", "tcpxo"):
        return FabricProbe(probe="gvnic", devices=len(fset.nics()) + 1)
    return FabricProbe(probe="mlx", devices=sum(1 for vpc, _ in fset.nics() if vpc.rdma))


def network_objects(fsets: Mapping[str, FabricSetPlan], names: Mapping[str, Any]) -> list[dict[str, Any]]:
    """GKENetworkParamSet + Network (networking.gke.io/v1) per fabric network; the pools' pod annotations name the
    Network objects. `names` maps GCE network/subnet names to the Outputs of those resources."""
    objects: dict[str, list[dict[str, Any]]] = {}
    for fset in fsets.values():
        for vpc, sub in fset.nics():
            if sub.k8s_network in objects:
                continue
            mode = "RDMA" if vpc.rdma else "NetDevice"
            objects[sub.k8s_network] = [
                {"apiVersion": "networking.gke.io/v1", "kind": "GKENetworkParamSet", "metadata": {"name": sub.k8s_network},
                 "spec": {"vpc": names.get(vpc.name, vpc.name), "vpcSubnet": names.get(sub.name, sub.name),
                          "deviceMode": mode}},
                {"apiVersion": "networking.gke.io/v1", "kind": "Network", "metadata": {"name": sub.k8s_network},
                 "spec": {"type": "Device", "parametersRef": {"group": "networking.gke.io",
                                                              "kind": "GKENetworkParamSet", "name": sub.k8s_network}}},
            ]
    return [o for pair in objects.values() for o in pair]


def node_addons(s: StackSettings, names: Mapping[str, Any]) -> NodeAddons:
    """GKE's GPU node add-ons for this stack's pools."""
    sets = fabric_sets(s) if any(p.fabric for p in s.gpu_pools) else {}
    kinds = sorted({fset.kind for fset in sets.values()})
    probes = {}
    for p in s.gpu_pools:
        key = pool_fabric_key(p)
        probes[p.name] = fabric_probe(sets[key] if key else None)
    return NodeAddons(device_plugin=False, installers=[NCCL_INSTALLERS[k] for k in kinds],
                      cluster_objects=network_objects(sets, names), driver_host_path=DRIVER_HOST_PATH,
                      nvme_device_glob=NVME_DEVICE_GLOB, fabric_probes=probes)
