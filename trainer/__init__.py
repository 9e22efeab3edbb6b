"""gpu-train's trainer: the platform's guarantees as a library for any PyTorch loop, and the bundled GPT trainer
(`python -m trainer --help`, docs/trainer.md) built on them.

Usage (docs/your-code.md documents every name, its signature and its guarantee):
    from trainer import CheckpointManager, GlobalSampler, JobEnv, Preemption, Tracker, Watchdog, open_dataset
    job = JobEnv.from_environ()                           # the job's environment (gpu_train.spec.env)
    env = init_distributed()                              # torchrun's process group (gloo on CPU, NCCL on GPUs)
    ckpt = CheckpointManager(job.checkpoint_dir, job.checkpoint_uri, keep=3)

The names below are the library's public surface: each piece stands alone and takes plain arguments (paths, URIs,
the environment, the process group). `import trainer` imports none of them (nor torch): each is imported on first
use, so the package stays cheap for the launcher and the tools that only need one part.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
PUBLIC: dict[str, str] = {
    # verified, asynchronous checkpoints over torch.distributed.checkpoint (trainer/checkpoint/)
    "CheckpointManager": "trainer.checkpoint",
    "CheckpointInvalid": "trainer.checkpoint",
    "SaveRecord": "trainer.checkpoint",
    "verify": "trainer.checkpoint",
    # the deterministic sharded dataset and its world-size-free sampler (trainer/data/)
    "open_dataset": "trainer.data",
    "Dataset": "trainer.data",
    "GlobalSampler": "trainer.data",
    "read_step": "trainer.data",
    "DataError": "trainer.data",
    "is_transient": "trainer.data",
    # a sweep trial's token budget: hold at a rung with a checkpoint until promoted or stopped (trainer/budget.py)
    "TrialBudget": "trainer.budget",
    # MLflow tracking that never blocks the loop (trainer/tracking.py)
    "Tracker": "trainer.tracking",
    # this worker's Prometheus endpoint, under the metric names the platform's dashboards and alerts read
    "TrainerMetrics": "trainer.metrics",
    # hang detection (trainer/watchdog.py) and the timeouts that agree with it
    "Watchdog": "trainer.watchdog",
    "WatchdogConfig": "gpu_train.spec.trainer_config",
    "collective_timeout_s": "trainer.watchdog",
    "checkpoint_timeout_s": "trainer.watchdog",
    "nccl_heartbeat_s": "trainer.watchdog",
    # SIGTERM / SIGINT as a flag the loop polls (trainer/preemption.py)
    "Preemption": "trainer.preemption",
    # the job's environment, the process group, seeds
    "JobEnv": "trainer.jobenv",
    "DistEnv": "trainer.distributed",
    "init_distributed": "trainer.distributed",
    "current_env": "trainer.distributed",
    "bind_to_agent": "trainer.distributed",
    "seed_everything": "trainer.distributed",
    "shutdown": "trainer.distributed",
    "agree": "trainer.distributed",
    "raise_agreed": "trainer.distributed",
    "setup_logging": "trainer.distributed",
    # errors and the exit codes the JobSet's failure rules read
    "BadInput": "trainer.errors",
    "TrainingFailed": "trainer.errors",
    "stop_retries": "trainer.errors",
    "record_stop": "trainer.errors",
    "EXIT_OK": "trainer.errors",
    "EXIT_BAD_INPUT": "trainer.errors",
    "EXIT_RESUMABLE": "trainer.errors",
    "EXIT_FAILED": "trainer.errors",
    "EXIT_INTERRUPTED": "trainer.errors",
    # a model's full state dict (collective under FSDP) and its sha256: what runs compare to prove they ended
    # bit-identical
    "full_state_dict": "trainer.outputs",
    "state_sha256": "trainer.outputs",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
