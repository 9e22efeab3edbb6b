"""Fabric layouts of the catalog's machine types (infra/gcp/network.py; pure, no mocks):
`pytest tests/infra/gcp/test_catalog.py`. The catalog's own entries: tests/gpu_train/spec/test_catalog.py."""

from __future__ import annotations

import pytest

from gpu_train.spec.catalog.gcp import CATALOG, machine_spec
from infra.gcp.network import fabric_vpcs

# Expected layouts as Google documents them: the GPUDirect-TCPX/TCPXO guide (4 / 8 gVNIC VPCs,
# MTU 8244), the AI Hypercomputer custom GKE guide for A3 Ultra and A4 (1 gVNIC VPC + 1 RoCE VPC
# with 8 subnets) and the RDMA network profile page (MTU 8896).


@pytest.mark.parametrize(("machine", "fabric", "gvnic", "rdma_subnets", "ssds", "mtu"), [
    ("a3-highgpu-8g", "tcpx", 4, 0, 16, 8244),
    ("a3-megagpu-8g", "tcpxo", 8, 0, 16, 8244),
    ("a3-ultragpu-8g", "rdma", 1, 8, 32, 8896),
    ("a4-highgpu-8g", "rdma", 1, 8, 32, 8896),
])
def test_fabric_machines_get_their_vpcs_and_ssds(machine, fabric, gvnic, rdma_subnets, ssds, mtu):
    spec = machine_spec(machine)
    assert (spec.gpus, spec.fabric, spec.local_ssds) == (8, fabric, ssds)
    vpcs = fabric_vpcs(machine)
    plain = [v for v in vpcs if not v.rdma]
    roce = [v for v in vpcs if v.rdma]
    assert len(plain) == gvnic and all(v.subnets == 1 for v in plain)
    assert sum(v.subnets for v in roce) == rdma_subnets and len(roce) == (1 if rdma_subnets else 0)
    assert {v.mtu for v in vpcs} == {mtu}
    assert len({v.suffix for v in vpcs}) == len(vpcs)


def test_machines_without_fabric_have_no_fabric_vpcs():
    for name, spec in CATALOG.items():
        if spec.fabric == "none":
            assert fabric_vpcs(name) == ()
            assert spec.local_ssds >= 1
