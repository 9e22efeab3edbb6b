"""Compute Engine GPU machine-type catalog: GPUs, fabric, extra NICs and local SSDs.

Usage: `from gpu_train.spec.catalog.gcp import machine_spec; machine_spec("a3-megagpu-8g").fabric`

Figures come from the accelerator-optimized machine family page
(https://cloud.google.com/compute/docs/accelerator-optimized-machines) and the GPUDirect guides
(https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx,
https://cloud.google.com/ai-hypercomputer/docs/create/gke-ai-hypercompute-custom).

Boot disks: A3 Ultra (H200) and A4 (B200) support Hyperdisk only, no Persistent Disk (the
machine series tables of https://cloud.google.com/compute/docs/accelerator-optimized-machines and
https://cloud.google.com/compute/docs/disks/hyperdisks), so their node pools boot from
`hyperdisk-balanced`; the other GPU series keep Persistent Disk.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MachineSpec:
    """What the platform needs to know about one GPU machine type."""

    accelerator: str  # GKE accelerator type, e.g. "nvidia-h100-mega-80gb"
    gpu_type: str  # short GPU model name used in labels and the MFU peak table
    gpus: int
    fabric: str  # "tcpx" | "tcpxo" | "rdma" | "none"
    extra_gvnic_networks: int  # additional gVNIC VPCs (one NIC each) beyond the primary
    rdma_nics: int  # RDMA NICs on the RoCE network (A3 Ultra / A4)
    local_ssds: int  # 375 GB local NVMe SSDs that come with the machine
    vcpus: int
    memory_gib: int
    boot_disk: str = "pd-balanced"  # boot disk type the machine series accepts


CATALOG: dict[str, MachineSpec] = {
    "a3-highgpu-8g": MachineSpec(accelerator="nvidia-h100-80gb", gpu_type="H100", gpus=8, fabric="tcpx",
                                 extra_gvnic_networks=4, rdma_nics=0, local_ssds=16, vcpus=208, memory_gib=1872,
                                 boot_disk="pd-ssd"),
    "a3-megagpu-8g": MachineSpec(accelerator="nvidia-h100-mega-80gb", gpu_type="H100", gpus=8, fabric="tcpxo",
                                 extra_gvnic_networks=8, rdma_nics=0, local_ssds=16, vcpus=208, memory_gib=1872,
                                 boot_disk="pd-ssd"),
    "a3-ultragpu-8g": MachineSpec(accelerator="nvidia-h200-141gb", gpu_type="H200", gpus=8, fabric="rdma",
                                  extra_gvnic_networks=1, rdma_nics=8, local_ssds=32, vcpus=224, memory_gib=2952,
                                  boot_disk="hyperdisk-balanced"),
    "a4-highgpu-8g": MachineSpec(accelerator="nvidia-b200", gpu_type="B200", gpus=8, fabric="rdma",
                                 extra_gvnic_networks=1, rdma_nics=8, local_ssds=32, vcpus=224, memory_gib=3968,
                                 boot_disk="hyperdisk-balanced"),
    "a2-ultragpu-1g": MachineSpec(accelerator="nvidia-a100-80gb", gpu_type="A100-80GB", gpus=1, fabric="none",
                                  extra_gvnic_networks=0, rdma_nics=0, local_ssds=1, vcpus=12, memory_gib=170),
    "g2-standard-4": MachineSpec(accelerator="nvidia-l4", gpu_type="L4", gpus=1, fabric="none",
                                 extra_gvnic_networks=0, rdma_nics=0, local_ssds=1, vcpus=4, memory_gib=16),
    "g2-standard-8": MachineSpec(accelerator="nvidia-l4", gpu_type="L4", gpus=1, fabric="none",
                                 extra_gvnic_networks=0, rdma_nics=0, local_ssds=1, vcpus=8, memory_gib=32),
    "g2-standard-24": MachineSpec(accelerator="nvidia-l4", gpu_type="L4", gpus=2, fabric="none",
                                  extra_gvnic_networks=0, rdma_nics=0, local_ssds=2, vcpus=24, memory_gib=96),
}


def machine_spec(machine_type: str) -> MachineSpec:
    """Return the catalog entry, or raise KeyError naming the type and the known ones."""
    try:
        return CATALOG[machine_type]
    except KeyError:
        known = ", ".join(sorted(CATALOG))
        raise KeyError(f"unknown GCE GPU machine type {machine_type!r} (known: {known})") from None
