"""The GPU catalogs (gpu_train/spec/catalog): entries as each cloud documents them, and lookups that name an
unknown type. Pure, no mocks: `pytest tests/gpu_train/spec/test_catalog.py`."""

from __future__ import annotations

import pytest

from gpu_train.spec.catalog import aws, gcp


@pytest.mark.parametrize(("machine", "disk"), [
    # A3 Ultra and A4 take Hyperdisk only; the other GPU series boot from Persistent Disk.
    ("a3-ultragpu-8g", "hyperdisk-balanced"), ("a4-highgpu-8g", "hyperdisk-balanced"),
    ("a3-highgpu-8g", "pd-ssd"), ("a3-megagpu-8g", "pd-ssd"), ("g2-standard-8", "pd-balanced"),
])
def test_boot_disk_type_is_one_the_series_supports(machine, disk):
    assert gcp.machine_spec(machine).boot_disk == disk


def test_unknown_machine_type_names_it():
    with pytest.raises(KeyError, match="a9-nope.*known: "):
        gcp.machine_spec("a9-nope")


def test_unknown_instance_type_names_it():
    with pytest.raises(KeyError, match="p9.huge"):
        aws.instance_spec("p9.huge")
