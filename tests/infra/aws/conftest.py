"""Fixtures for the AWS layer tests.

`plans` is the session's plans of the aws-* stacks (each planned once per session, by tests/conftest.py).
`stack_cfg(pools)` builds an AWS StackSettings, checked as the program checks it, for component tests.
"""

from __future__ import annotations

import pytest

from gpu_train.spec import catalog
from gpu_train.spec.settings import StackSettings
from gpu_train.spec.settings_checks import parse
from infra import clouds
from tests.conftest import STACKS

AWS_STACKS = [s for s in STACKS if s.startswith("aws-")]


@pytest.fixture(scope="session")
def plans(plans) -> dict[str, dict]:
    """The session's plans (tests/conftest.py), only the aws stacks."""
    return {s: p for s, p in plans.items() if s in AWS_STACKS}


def _capacity(pool: dict) -> int:
    return catalog.shape("aws", pool["instanceType"]).gpus * pool["maxNodes"]


def stack_cfg(pools: list[dict], environment: str = "prod", nat: str = "per-zone") -> StackSettings:
    raw = {
        "gpu-train:cloud": "aws", "gpu-train:environment": environment, "gpu-train:region": "us-west-2",
        "gpu-train:zones": ["us-west-2a", "us-west-2b"],
        "gpu-train:network": {"vpcCidr": "10.30.0.0/16", "podCidr": "100.64.0.0/16", "nat": nat},
        "gpu-train:cluster": {"systemNodeType": "m6i.large"},
        "gpu-train:gpuPools": pools,
        "gpu-train:cache": {"masters": 3},
        # Up to 8 GPUs on every pool, never more than the pool holds (a quota above that is refused).
        "gpu-train:teams": [{"name": "vision", "gpuQuota": {p["name"]: min(8, _capacity(p)) for p in pools}}],
        "gpu-train:limits": {"maxGpus": 512},
    }
    cfg = parse(raw, stack="aws-test")
    clouds.require_valid(cfg)  # and the cloud's own rules, as the program checks before any resource
    return cfg
