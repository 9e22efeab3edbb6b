"""The gpu-train CrossGuard policy pack: `pulumi preview --stack aws-dev --policy-pack policies`.

Usage:
    make setup    # the project's virtualenv (.venv) with the project installed: policies, gpu_train, pulumi-policy
    pulumi preview --stack aws-dev --policy-pack policies --policy-pack-config policies/policy-config.json

The Pulumi CLI runs this file as the policy pack's program, with the virtualenv PulumiPolicy.yaml
names; the rules import `policies` and `gpu_train` from the installed project. Constructing
`PolicyPack` starts the analyzer's gRPC server and never returns, so nothing imports this module:
the rules live in plain modules (`policies/registry.py`) that tests and `python -m policies.check`
import directly.
"""

from pulumi_policy import EnforcementLevel, PolicyPack

from policies.crossguard import build_policies

PolicyPack(
    name="gpu-train-policies",
    description="Security, cost and operability guardrails for the gpu-train GPU training platform.",
    enforcement_level=EnforcementLevel.MANDATORY,
    policies=build_policies(),
)
