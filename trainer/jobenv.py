"""The job's environment as a job reads it: where to write, what to read, where to report.

Usage, in any training script the launcher starts (`gpu-train run --local`, or a pod of the job's JobSet):
    from trainer import JobEnv
    job = JobEnv.from_environ()
    ckpt = CheckpointManager(job.checkpoint_dir, job.checkpoint_uri, keep=3)
    ds = open_dataset(job.dataset_uri, context=256, cache_dir=job.data_cache_dir, endpoint_url=job.data_endpoint)
    tracker = Tracker.start(tracking_uri=job.tracking_uri, experiment=job.experiment, run_name=job.job_name,
                            run_dir=job.run_dir, enabled=job.rank == 0)
    if job.metrics_port: prometheus_client.start_http_server(job.metrics_port)   # this local rank's port

The variables and who sets them are gpu_train.spec.env.JOB_ENV (docs/your-code.md, "The environment").
Outside the launcher (a plain `python train.py`) every place falls back to a default that works on one machine:
the job name `local`, the run directory `runs/<job name>`, no object store, the built-in synthetic dataset, no
MLflow server (Tracker then uses its embedded store beside the run directory), no metrics port, rank 0 of 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpu_train.spec import env as job_env


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be a whole number (got {raw!r})") from None


@dataclass(frozen=True, kw_only=True)
class JobEnv:
    """One worker's view of its job (module docstring); every field comes from the job environment."""

    job_name: str
    run_dir: Path  # the job's directory on this node's disk
    checkpoint_dir: Path  # CheckpointManager's local_dir
    checkpoint_uri: str  # CheckpointManager's remote_uri ("" = none)
    dataset_uri: str  # open_dataset's uri
    data_cache_dir: str | None  # open_dataset's cache_dir (None = the per-user default)
    data_endpoint: str | None  # open_dataset's endpoint_url (None = the store's own)
    tracking_uri: str  # "" = none given (the Tracker's embedded store)
    experiment: str
    metrics_port: int  # this worker's Prometheus port (0 = none): the base port + LOCAL_RANK
    rank: int
    local_rank: int
    world_size: int
    restart_count: int  # torchrun's restarts of this node's workers
    shutdown_timeout_s: float | None  # seconds between SIGTERM and SIGKILL (None = unknown)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        env = os.environ if environ is None else environ
        name = env.get(job_env.JOB_NAME) or "local"
        run_dir = Path(env.get(job_env.RUN_DIR) or Path("runs") / name)
        base_port = _int(env, job_env.METRICS_PORT, 0)
        local_rank = _int(env, "LOCAL_RANK", 0)
        shutdown = env.get(job_env.SHUTDOWN, "")
        return cls(
            job_name=name, run_dir=run_dir,
            checkpoint_dir=Path(env.get(job_env.CHECKPOINT_DIR) or run_dir / "checkpoints"),
            checkpoint_uri=env.get(job_env.CHECKPOINT_URI, ""),
            dataset_uri=env.get(job_env.DATASET_URI) or "synthetic",
            data_cache_dir=env.get(job_env.DATA_CACHE_DIR) or None,
            data_endpoint=env.get(job_env.DATA_ENDPOINT) or None,
            tracking_uri=env.get(job_env.TRACKING_URI, ""),
            experiment=env.get(job_env.EXPERIMENT) or name,
            metrics_port=base_port + local_rank if base_port else 0,
            rank=_int(env, "RANK", 0), local_rank=local_rank, world_size=_int(env, "WORLD_SIZE", 1),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            shutdown_timeout_s=float(shutdown) if shutdown.isdigit() else None,
        )
