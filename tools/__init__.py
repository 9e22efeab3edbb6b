"""Developer tooling that is not shipped with the package; run it from the repository root.

Usage:
    python -m tools.validation build/plan/*.json   # the plans against the pinned charts and CRDs (docs/validation.md)
    python -m tools.validation.refresh             # `make schemas`: the chart and CRD snapshots under tests/schemas
    python tools/deploy_matrix.py stacks           # the stacks marked for deployment, as GitHub outputs
"""
