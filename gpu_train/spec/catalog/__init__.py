"""The GPU instance and machine types each cloud offers, as plain data, and one lookup over both.

Usage:
    from gpu_train.spec import catalog
    catalog.shape("aws", "p5.48xlarge")      # Shape(gpus=8, gpu_type="H100", vcpus=192, memory_gib=2048, ...)
    catalog.known("gcp")                     # the machine types the settings accept on GCP

The tables (`catalog.aws.CATALOG`, `catalog.gcp.CATALOG`) hold what each cloud's own pages publish; the
settings checks, the policy pack and the cloud layers read them, so a type is known or not in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_train.spec.catalog import aws, gcp


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What every layer needs of a GPU node type, whatever the cloud."""

    gpus: int  # accelerators per node
    gpu_type: str  # short GPU model name, e.g. "H100"
    accelerator: str  # "nvidia" or "neuron" (AWS Trainium); GCP machine types are all NVIDIA
    vcpus: int
    memory_gib: int
    fabric: str  # "efa", "tcpx", "tcpxo", "rdma" or "none": the high-bandwidth GPU network the type supports


def known(cloud: str) -> list[str]:
    """The GPU types of a cloud's catalog, sorted."""
    return sorted(aws.CATALOG if cloud == "aws" else gcp.CATALOG)


def shape(cloud: str, instance_type: str) -> Shape | None:
    """The shape of a catalog type, or None when the cloud's catalog does not have it."""
    if cloud == "aws":
        a = aws.CATALOG.get(instance_type)
        if a is None:
            return None
        return Shape(gpus=a.gpus, gpu_type=a.gpu_type, accelerator=a.accelerator, vcpus=a.vcpus,
                     memory_gib=a.memory_gib, fabric="efa" if a.efa else "none")
    g = gcp.CATALOG.get(instance_type)
    if g is None:
        return None
    return Shape(gpus=g.gpus, gpu_type=g.gpu_type, accelerator="nvidia", vcpus=g.vcpus, memory_gib=g.memory_gib,
                 fabric=g.fabric)
