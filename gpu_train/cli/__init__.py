"""`gpu-train`: a team member's command for the platform (docs/teams.md).

Usage:
    gpu-train kubeconfig --platform platform.json --team research     # a kubeconfig scoped to the team
    gpu-train submit job.yaml [--dry-run]                             # render, check and submit a JobSet
    gpu-train list | status JOB | logs JOB [--rank N] [--follow] | pause JOB | resume JOB | cancel JOB
    gpu-train run --local [job.yaml]                                  # the same job under local torchrun

It talks to the cluster only through the user's kubeconfig (the official `kubernetes` client), and reads, checks
and renders jobs with the platform's one job model and renderer (gpu_train.spec.job, gpu_train.jobs), fed by the
platform contract the stack publishes (gpu_train.spec.contract). It imports neither Pulumi nor the Pulumi program,
and torch only for `run --local`, through the trainer.
"""
