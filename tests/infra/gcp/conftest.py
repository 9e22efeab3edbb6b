"""Fixtures for the GCP layer tests.

`plans` here plans only the gcp-* stacks (through the same plan tool and helper as the root
fixture), so these tests neither wait for nor depend on the other cloud's stacks.
`stack_cfg(...)` builds a validated StackConfig with chosen GPU pools for component tests.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra import config
from tests.conftest import STACKS, _plan

GCP_STACKS = [s for s in STACKS if s.startswith("gcp-")]


@pytest.fixture(scope="session")
def plans(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("gcp-plan")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _plan(s, out), GCP_STACKS))
    failures = [f"{s}:\n{p.stdout}\n{p.stderr}" for s, p in results if p.returncode != 0]
    assert not failures, "planning failed:\n" + "\n".join(failures)
    return {s: json.loads((out / f"{s}.json").read_text()) for s in GCP_STACKS}


def stack_cfg(pools: list[dict], environment: str = "prod", regional: bool = True) -> config.StackConfig:
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
    return config.parse(raw, stack="gcp-test")


def fabric_pool(name: str, machine_type: str, capacity: str = "spot", zone: str = "us-central1-a") -> dict:
    pool = {"name": name, "instanceType": machine_type, "capacity": capacity, "maxNodes": 2,
            "fabric": True, "zone": zone}
    if capacity == "reservation":
        pool["reservationId"] = f"{name}-res"
    return pool
