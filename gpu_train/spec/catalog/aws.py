"""EC2 GPU instance catalog used for validation and offline plans.

Usage: `from gpu_train.spec.catalog.aws import instance_spec; instance_spec("p5.48xlarge").network_cards`

At deploy time the EFA interface count is read from the EC2 API (`aws.ec2.get_instance_type`,
`maximumNetworkCards`); this table is the tested fallback used by offline plans and by config
validation. Figures come from the EC2 accelerated-computing instance pages
(https://aws.amazon.com/ec2/instance-types/p5/, .../p4/, .../g6e/, .../g6/, .../g5/, .../trn1/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """What the platform needs to know about one EC2 instance type."""

    accelerator: str  # "nvidia" or "neuron"
    gpu_type: str  # short GPU model name used in labels and the MFU peak table
    gpus: int  # accelerators per instance (NVIDIA GPUs, or Trainium chips)
    network_cards: int  # maximum network cards = EFA interfaces we attach
    efa: bool  # whether the type supports EFA at all
    nvme_disks: int  # instance-store NVMe volumes (RAID0-ed for the cache)
    nvme_gb_each: int
    vcpus: int
    memory_gib: int


CATALOG: dict[str, InstanceSpec] = {
    "p4d.24xlarge": InstanceSpec(accelerator="nvidia", gpu_type="A100-40GB", gpus=8, network_cards=4, efa=True,
                                 nvme_disks=8, nvme_gb_each=1000, vcpus=96, memory_gib=1152),
    "p4de.24xlarge": InstanceSpec(accelerator="nvidia", gpu_type="A100-80GB", gpus=8, network_cards=4, efa=True,
                                  nvme_disks=8, nvme_gb_each=1000, vcpus=96, memory_gib=1152),
    "p5.48xlarge": InstanceSpec(accelerator="nvidia", gpu_type="H100", gpus=8, network_cards=32, efa=True,
                                nvme_disks=8, nvme_gb_each=3840, vcpus=192, memory_gib=2048),
    "p5e.48xlarge": InstanceSpec(accelerator="nvidia", gpu_type="H200", gpus=8, network_cards=32, efa=True,
                                 nvme_disks=8, nvme_gb_each=3840, vcpus=192, memory_gib=2048),
    "p5en.48xlarge": InstanceSpec(accelerator="nvidia", gpu_type="H200", gpus=8, network_cards=16, efa=True,
                                  nvme_disks=8, nvme_gb_each=3840, vcpus=192, memory_gib=2048),
    "trn1.32xlarge": InstanceSpec(accelerator="neuron", gpu_type="Trainium", gpus=16, network_cards=8, efa=True,
                                  nvme_disks=4, nvme_gb_each=1900, vcpus=128, memory_gib=512),
    "g6e.48xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L40S", gpus=8, network_cards=4, efa=True,
                                 nvme_disks=4, nvme_gb_each=1900, vcpus=192, memory_gib=1536),
    "g6e.12xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L40S", gpus=4, network_cards=1, efa=True,
                                 nvme_disks=2, nvme_gb_each=1900, vcpus=48, memory_gib=384),
    "g6e.xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L40S", gpus=1, network_cards=1, efa=False,
                               nvme_disks=1, nvme_gb_each=250, vcpus=4, memory_gib=32),
    "g6e.2xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L40S", gpus=1, network_cards=1, efa=False,
                                nvme_disks=1, nvme_gb_each=450, vcpus=8, memory_gib=64),
    "g6.xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L4", gpus=1, network_cards=1, efa=False,
                              nvme_disks=1, nvme_gb_each=250, vcpus=4, memory_gib=16),
    "g6.2xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L4", gpus=1, network_cards=1, efa=False,
                               nvme_disks=1, nvme_gb_each=450, vcpus=8, memory_gib=32),
    "g6.12xlarge": InstanceSpec(accelerator="nvidia", gpu_type="L4", gpus=4, network_cards=1, efa=False,
                                nvme_disks=4, nvme_gb_each=940, vcpus=48, memory_gib=192),
    "g5.xlarge": InstanceSpec(accelerator="nvidia", gpu_type="A10G", gpus=1, network_cards=1, efa=False,
                              nvme_disks=1, nvme_gb_each=250, vcpus=4, memory_gib=16),
    "g5.48xlarge": InstanceSpec(accelerator="nvidia", gpu_type="A10G", gpus=8, network_cards=1, efa=True,
                                nvme_disks=2, nvme_gb_each=3800, vcpus=192, memory_gib=768),
}


def instance_spec(instance_type: str) -> InstanceSpec:
    """Return the catalog entry, or raise KeyError naming the type and the known ones."""
    try:
        return CATALOG[instance_type]
    except KeyError:
        known = ", ".join(sorted(CATALOG))
        raise KeyError(f"unknown EC2 GPU instance type {instance_type!r} (known: {known})") from None
