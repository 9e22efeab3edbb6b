"""gpu-train's core: the platform's shared vocabulary and the one job renderer, with neither Pulumi nor torch.

Usage:
    from gpu_train.spec.settings_checks import parse   # stack settings -> StackSettings
    from gpu_train.spec.job import JobSpec, job_problems
    from gpu_train.spec.contract import PlatformContract
    from gpu_train.jobs.jobset import jobset            # JobSpec + contract -> the JobSet
    from gpu_train.jobs.launch import launcher           # JobSpec -> torchrun argv + env

Layers (imports run one way, towards `spec`):
    gpu_train.spec   typed models and pure data: settings, job spec, platform contract, names, catalogs,
                     the trainer's settings schema, pod rules, exit codes
    gpu_train.jobs   pure functions over the spec: the JobSet renderer, the launcher, the quota and node fit
    gpu_train.cli    the `gpu-train` command and its Python client (imports spec and jobs, never infra)
infra/ (the Pulumi program), policies/ (the policy pack) and trainer/ (the torch library and the bundled GPT)
import from here; nothing here imports them.
"""
