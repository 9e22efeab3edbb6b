"""What the AWS layer tells the platform about its GPU nodes (infra/aws/node_addons.py): what a node leaves to a
training pod, the pools as jobs see them, and the add-ons the Kubernetes layer installs. Every expected number is
worked out beside it from the published rules the module cites, not read back from the code.

Usage: .venv/bin/pytest tests/infra/aws/test_node_addons.py -q
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from gpu_train.jobs.fit import quantity
from gpu_train.spec import naming
from gpu_train.spec.catalog.aws import CATALOG
from infra.aws import node_addons
from infra.aws.gpu_nodes import nccl_env
from tests.infra.aws.conftest import stack_cfg

GIB = 2**30
MIB = 2**20
# What the platform keeps on every GPU node for its own agents (infra/platform.py): 4 cores and 12 GiB.
AGENTS_CPU, AGENTS_MEMORY = Fraction(4), 12 * GIB


@pytest.mark.parametrize(("instance_type", "cpu", "memory"), [
    # p5.48xlarge: 192 vCPUs, 2048 GiB, 100 pods (eni-max-pods.txt).
    # cpu reserved: 0.06 + 0.01 + 2 x 0.005 + 188 x 0.0025 = 0.55 -> 191.45 cores.
    # memory: 2048 GiB x 0.925 = 1894.4 GiB, less (11 x 100 + 255) MiB kube-reserved and 100 MiB eviction.
    ("p5.48xlarge", Fraction(19145, 100), Fraction(18944, 10) * GIB - 1355 * MIB - 100 * MIB),
    # g6.xlarge: 4 vCPUs, 16 GiB, 58 pods. cpu: 0.06 + 0.01 + 2 x 0.005 = 0.08 -> 3.92.
    # memory: 16 GiB x 0.925 = 14.8 GiB, less (11 x 58 + 255) = 893 MiB and 100 MiB.
    ("g6.xlarge", Fraction(392, 100), Fraction(148, 10) * GIB - 893 * MIB - 100 * MIB),
    # p4d.24xlarge: 96 vCPUs, 1152 GiB, 737 pods. cpu: 0.08 + 92 x 0.0025 = 0.31 -> 95.69.
    # memory: 1152 x 0.925 = 1065.6 GiB, less (11 x 737 + 255) = 8362 MiB and 100 MiB.
    ("p4d.24xlarge", Fraction(9569, 100), Fraction(10656, 10) * GIB - 8362 * MIB - 100 * MIB),
])
def test_eks_allocatable_follows_the_ami_formula(instance_type, cpu, memory):
    assert node_addons.kubelet_allocatable(instance_type) == (cpu, memory)
    # A training pod gets that less the platform's agents, as exact Kubernetes quantities.
    left = node_addons.allocatable(instance_type)
    assert (quantity(left.cpu), quantity(left.memory)) == (cpu - AGENTS_CPU, memory - AGENTS_MEMORY)


def test_every_catalog_type_has_its_eni_pod_limit():
    assert set(CATALOG) <= set(node_addons.ENI_MAX_PODS)


POOLS = [
    {"name": "h100", "instanceType": "p5.48xlarge", "capacity": "capacity-block", "reservationId": "cr-0123456789abcdef0",
     "maxNodes": 4, "fabric": True, "zone": "us-west-2a"},
    {"name": "l4", "instanceType": "g6.xlarge", "capacity": "spot", "maxNodes": 2},
]


def test_pools_as_jobs_see_them():
    cfg = stack_cfg(POOLS)
    h100, l4 = node_addons.gpu_pools(cfg)
    assert (h100.name, h100.gpu_type, h100.gpus_per_node, h100.max_nodes, h100.provisioner) == (
        "h100", "H100", 8, 4, "karpenter")
    assert h100.node_selector == {naming.POOL_LABEL: "h100"}
    assert h100.tolerations == [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present",
                                 "effect": "NoSchedule"}]
    # One EFA device per network card of a p5.48xlarge (32), and libfabric's EFA settings for the trainer.
    assert h100.fabric.kind == "efa" and h100.fabric.resources == {"vpc.amazonaws.com/efa": 32}
    assert h100.fabric.nccl_env == nccl_env("p5.48xlarge")
    assert h100.allocatable == node_addons.allocatable("p5.48xlarge")
    assert l4.fabric.kind == "none" and l4.fabric.resources == {} and l4.zone == ""
    assert l4.allocatable == node_addons.allocatable("g6.xlarge")


def test_eks_nodes_get_nvidias_plugin_and_the_efa_plugin_where_a_pool_has_efa():
    cfg = stack_cfg(POOLS)
    addons = node_addons.node_addons(node_addons.gpu_pools(cfg))
    # The EKS NVIDIA AMI brings the driver and container toolkit but no device plugin; the container runtime
    # injects the driver (no host path), and nodeadm mounts the instance store itself (no raw devices to RAID).
    assert addons.device_plugin is True
    assert (addons.driver_host_path, addons.nvme_device_glob, addons.installers, addons.cluster_objects) == (
        "", "", (), ())
    (efa,) = addons.device_plugins
    assert (efa.fabric, efa.chart, efa.repo) == ("efa", "aws-efa-k8s-device-plugin", "https://aws.github.io/eks-charts")
    assert {name: (p.probe, p.devices) for name, p in addons.fabric_probes.items()} == {
        "h100": ("efa", 32), "l4": ("none", 0)}
    plain = node_addons.node_addons(node_addons.gpu_pools(stack_cfg(POOLS[1:])))
    assert plain.device_plugins == [] and plain.device_plugin is True
