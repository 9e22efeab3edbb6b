"""Catalog and fabric-layout tests (pure, no mocks): `pytest tests/infra/gcp/test_catalog.py`."""

from __future__ import annotations

import pytest

from infra.gcp.catalog import CATALOG, FABRIC_MTU, fabric_nic_count, fabric_vpcs, machine_spec


@pytest.mark.parametrize(("machine", "fabric", "gvnic", "rdma_subnets", "ssds"), [
    ("a3-highgpu-8g", "tcpx", 4, 0, 16),
    ("a3-megagpu-8g", "tcpxo", 8, 0, 16),
    ("a3-ultragpu-8g", "rdma", 1, 8, 32),
    ("a4-highgpu-8g", "rdma", 1, 8, 32),
])
def test_fabric_machines_get_their_vpcs_and_ssds(machine, fabric, gvnic, rdma_subnets, ssds):
    spec = machine_spec(machine)
    assert (spec.gpus, spec.fabric, spec.local_ssds) == (8, fabric, ssds)
    vpcs = fabric_vpcs(machine)
    plain = [v for v in vpcs if not v.rdma]
    roce = [v for v in vpcs if v.rdma]
    assert len(plain) == gvnic and all(v.subnets == 1 for v in plain)
    assert sum(v.subnets for v in roce) == rdma_subnets and len(roce) == (1 if rdma_subnets else 0)
    assert all(v.mtu == FABRIC_MTU == 8244 for v in vpcs)
    assert fabric_nic_count(machine) == gvnic + rdma_subnets
    assert len({v.suffix for v in vpcs}) == len(vpcs)


def test_machines_without_fabric_have_no_fabric_vpcs():
    for name, spec in CATALOG.items():
        if spec.fabric == "none":
            assert fabric_vpcs(name) == ()
            assert spec.local_ssds >= 1


def test_unknown_machine_type_names_it():
    with pytest.raises(KeyError, match="a9-nope.*known: "):
        machine_spec("a9-nope")
