"""`gpu-train`: a team member's command for the platform (docs/teams.md).

Usage:
    gpu-train kubeconfig --platform platform.json --team research     # a kubeconfig scoped to the team
    gpu-train submit job.yaml [--dry-run]                             # render, check and submit a JobSet
    gpu-train list | status JOB | logs JOB [--rank N] [--follow] | pause JOB | resume JOB | cancel JOB
    gpu-train run --local [job.yaml]                                  # the same job under local torchrun

It talks to the cluster only through the user's kubeconfig (the official `kubernetes` client), and renders
and checks jobs with the stack's own functions (infra.config.read_job, infra.k8s.training.jobset_manifest),
fed by the platform contract the stack publishes (infra/k8s/contract.py). It never imports Pulumi itself.
"""
