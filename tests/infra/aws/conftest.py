"""Fixtures for the AWS layer tests.

`plans` plans only the aws-* stacks through the plan tool (as a user runs it), so these tests do not
wait for the other cloud. `stack_cfg(pools)` builds a validated AWS StackConfig for component tests.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra import config
from tests.conftest import STACKS, _plan

AWS_STACKS = [s for s in STACKS if s.startswith("aws-")]


@pytest.fixture(scope="session")
def plans(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("aws-plan")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _plan(s, out), AWS_STACKS))
    failures = [f"{s}:\n{p.stdout}\n{p.stderr}" for s, p in results if p.returncode != 0]
    assert not failures, "planning failed:\n" + "\n".join(failures)
    return {s: json.loads((out / f"{s}.json").read_text()) for s in AWS_STACKS}


def stack_cfg(pools: list[dict], environment: str = "prod", nat: str = "per-zone") -> config.StackConfig:
    raw = {
        "gpu-train:cloud": "aws", "gpu-train:environment": environment, "gpu-train:region": "us-west-2",
        "gpu-train:zones": ["us-west-2a", "us-west-2b"],
        "gpu-train:network": {"vpcCidr": "10.30.0.0/16", "podCidr": "100.64.0.0/16", "nat": nat},
        "gpu-train:cluster": {"systemNodeType": "m6i.large"},
        "gpu-train:gpuPools": pools,
        "gpu-train:cache": {"masters": 3},
        "gpu-train:teams": [{"name": "vision", "gpuQuota": 8}],
        "gpu-train:limits": {"maxGpus": 512},
    }
    return config.parse(raw, stack="aws-test")
