"""Policy-as-code for gpu-train: plain rule functions shared by CrossGuard and the offline checker.

Usage:
    python -m policies.check build/plan/aws-dev.json      # offline, over plans from `python -m infra.plan`
    pulumi preview --stack aws-dev --policy-pack policies  # for real, as a CrossGuard policy pack

Importing this package (or any rule module) never starts the policy server; only
`policies/__main__.py` builds the `PolicyPack`.
"""
