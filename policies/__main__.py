"""The gpu-train CrossGuard policy pack: `pulumi preview --stack aws-dev --policy-pack policies`.

Usage:
    pulumi preview --stack aws-dev --policy-pack policies --policy-pack-config policies/policy-config.json

The Pulumi CLI runs this file as the policy pack's program. Constructing `PolicyPack` starts the
analyzer's gRPC server and never returns, so nothing imports this module: the rules live in plain
modules (`policies/registry.py`) that tests and `python -m policies.check` import directly.
"""

import sys
from pathlib import Path

# The CLI runs the pack from policies/; the rules import infra.naming and the GPU catalogs.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pulumi_policy import EnforcementLevel, PolicyPack  # noqa: E402

from policies.crossguard import build_policies  # noqa: E402

PolicyPack(
    name="gpu-train-policies",
    description="Security, cost and operability guardrails for the gpu-train GPU training platform.",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=build_policies(),
)
