"""Fixtures for the GCP layer tests.

`plans` is the session's plans of the gcp-* stacks (each planned once per session, by tests/conftest.py).
`stack_cfg(...)` builds a StackSettings, checked as the program checks it, with chosen GPU pools for component tests.
"""

from __future__ import annotations

import pytest

from gpu_train.spec.settings import StackSettings
from gpu_train.spec.settings_checks import parse
from infra import clouds
from tests.conftest import STACKS

GCP_STACKS = [s for s in STACKS if s.startswith("gcp-")]


@pytest.fixture(scope="session")
def plans(plans) -> dict[str, dict]:
    """The session's plans (tests/conftest.py), only the gcp stacks."""
    return {s: p for s, p in plans.items() if s in GCP_STACKS}


def stack_cfg(pools: list[dict], environment: str = "prod", regional: bool = True) -> StackSettings:
    raw = {
        "gpu-train:cloud": "gcp", "gpu-train:environment": environment, "gpu-train:project": "acme-ml-test",
        "gpu-train:region": "us-central1", "gpu-train:zones": ["us-central1-a", "us-central1-b"],
        "gpu-train:network": {"vpcCidr": "10.10.0.0/20", "podCidr": "10.12.0.0/14", "serviceCidr": "10.16.0.0/20"},
        "gpu-train:cluster": {"regional": regional, "masterCidr": "172.16.0.32/28"},
        "gpu-train:gpuPools": pools,
        "gpu-train:cache": {"masters": 3},
        "gpu-train:teams": [{"name": "research", "gpuQuota": 1}],
        "gpu-train:limits": {"maxGpus": 512},
    }
    cfg = parse(raw, stack="gcp-test")
    clouds.require_valid(cfg)  # and the cloud's own rules, as the program checks before any resource
    return cfg


def fabric_pool(name: str, machine_type: str, capacity: str = "spot", zone: str = "us-central1-a") -> dict:
    pool = {"name": name, "instanceType": machine_type, "capacity": capacity, "maxNodes": 2,
            "fabric": True, "zone": zone}
    if capacity == "reservation":
        pool["reservationId"] = f"{name}-res"
    return pool
