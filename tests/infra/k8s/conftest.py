"""Fixtures for the Kubernetes-layer tests: the layer built under Pulumi mocks for every stack in
stacks/, on a hand-built platform per cloud (tests/infra/k8s/harness.py), plus its manifests on disk.

Usage: take `layers` (stack -> (records, fields)) or `layer_manifests` (stack -> k8s YAML dir).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.plan import write_plan
from tests.infra.k8s.harness import STACKS, build_layer


@pytest.fixture(scope="session")
def layers() -> dict[str, tuple[list[dict], dict]]:
    return {stack: build_layer(stack) for stack in STACKS}


@pytest.fixture(scope="session")
def layer_manifests(layers, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("k8s-layer")
    dirs = {}
    for stack, (records, _) in layers.items():
        write_plan({"stack": stack, "resources": records, "outputs": {}}, out)
        dirs[stack] = out / stack / "k8s"
    return dirs
