"""gpu-train's core: the platform's shared vocabulary and the one job renderer, with neither Pulumi nor torch.

Usage:
    from gpu_train.spec.settings_checks import parse   # stack settings -> StackSettings
    from gpu_train.spec.job import JobSpec, job_problems
    from gpu_train.spec.contract import PlatformContract
    from gpu_train.jobs.jobset import jobset            # JobSpec + contract -> the JobSet
    from gpu_train.jobs.launch import local             # JobSpec -> torchrun argv + env on this machine

Layers (imports run one way, towards `spec`):
    gpu_train.spec     every feature's spec model and pure data: stack settings, job spec, service spec, sweep
                       spec, platform contract, the job environment, names, catalogs, the trainer's settings
                       schema, pod rules, exit codes
    gpu_train.sizing   what a trainer configuration needs from the hardware: the parallel layout at a world size,
                       the memory a GPU needs, a job's fit to its pool's GPUs, FLOPs per token, the GPUs' peaks
    gpu_train.carbon   the region carbon tables (data files beside it), a job's estimate, the region ranking
    gpu_train.jobs     pure functions over the spec: the JobSet and serving renderers, the launch builder, the
                       Kueue queue objects, the quota and node fit
    gpu_train.storage  the object stores (file://, s3://, gs://)
    gpu_train.client   the Python client: submit, follow, pause, resume, cancel, run locally
    gpu_train.serving  serving's programs: the route, the promotion loop, the registry client, `serve --local`
    gpu_train.sweeps   the sweep controller, here or in the cluster
    gpu_train.cli      the `gpu-train` command, built on the client (imports the layers above, never infra)
infra/ (the Pulumi program), policies/ (the policy pack) and trainer/ (the torch library, the bundled GPT and the
local model server) import from here; nothing here imports them.
"""
