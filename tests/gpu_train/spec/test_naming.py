"""Names the layers share (gpu_train/spec/naming.py) where a rule decides them. Pure:
`pytest tests/gpu_train/spec/test_naming.py`."""

from __future__ import annotations

import pytest

from gpu_train.spec import naming


@pytest.mark.parametrize(("uri", "expected"), [
    ("s3://acme-datasets/gpt2/manifest.json", "s3://gpt2/manifest.json"),
    ("gs://acme-datasets/web/v2/manifest.json", "s3://web/v2/manifest.json"),
    ("s3://acme-datasets/manifest.json", None),  # top level: no Alluxio "bucket" to name it by
    ("s3://other-bucket/gpt2/manifest.json", None),  # outside the cached bucket: read directly
])
def test_dataset_uri_through_the_cache_proxy(uri, expected):
    bucket = "gs://acme-datasets" if uri.startswith("gs://") else "s3://acme-datasets"
    assert naming.proxy_dataset_uri(uri, bucket) == expected


def test_workdir_is_the_namespaces_directory_under_the_nvme_root():
    assert naming.workdir_path("/mnt/k8s-disks/0/", "team-a") == "/mnt/k8s-disks/0/gpu-train/team-a"
    for bad in ("relative/path", "/", ""):
        with pytest.raises(ValueError, match="nvme_host_path"):
            naming.workdir_path(bad, "team-a")

