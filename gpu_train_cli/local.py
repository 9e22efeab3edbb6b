"""`gpu-train run --local [SPEC]`: a job spec under local torchrun on this machine, through the image's own
launcher (python -m trainer.launch: preflight, then torchrun with elastic c10d rendezvous).

Usage:
    gpu-train run --local                      # the embedded default: the tiny preset on 2 CPU workers
    gpu-train run --local job.yaml --nproc 1   # a team's spec: its preset, overrides, steps, batch, checkpoints

The spec goes through the same reader and checks as a submitted one (infra.config.read_job; with no platform
to check pool and team against, those two names are taken as written) and gives the trainer the same
settings the cluster job gets (infra.config.job_trainer_overrides). What differs on one machine: one node
(`--nnodes=1`) with --nproc workers, a run directory under ./runs/<job name> instead of the node's NVMe, and
the dataset: --data, or the spec's own when it is a local file:// manifest, else the trainer's built-in
synthetic data (a cluster dataset in object storage is the cluster's to read).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpu_train_cli.cluster import CliError

# The embedded default: what `make train` runs, as a job spec.
DEFAULT_SPEC: dict[str, Any] = {
    "name": "local-tiny", "team": "local", "pool": "local", "preset": "tiny", "nodes": "1:1", "steps": 200,
    "globalBatchTokens": 4096, "checkpointEvery": 50, "maxRestarts": 3,
}
DEFAULT_NPROC = 2


def local_config(team: str, pool: str):
    """The stack settings the job checks need on one machine: the spec's team and pool, no catalog shape
    (so the per-GPU checks leave the world size to the launcher's preflight, which knows --nproc)."""
    from infra import config

    return config.StackConfig(cloud="aws", environment="dev", region="local", zones=(),
                              # As many nodes as the settings can name: the spec's MIN:MAX is the cluster's business.
                              gpu_pools=(config.GpuPoolConfig(name=pool, instance_type="local", capacity="on-demand",
                                                              max_nodes=999_999),),
                              teams=(config.TeamConfig(name=team, gpu_quota=1),))


def launch_command(job, *, nproc: int, run_dir: Path, data_uri: str, port: int = 0) -> list[str]:
    """trainer.launch's arguments (torchrun's, then the trainer's) for the job on this machine."""
    from infra.config import job_trainer_overrides

    return [
        sys.executable, "-m", "trainer.launch",
        "--nnodes=1", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
        f"--rdzv-id={job.name}", f"--rdzv-conf=join_timeout={job.rendezvous_timeout_minutes * 60}",
        f"--max-restarts={job.max_restarts}",
        "-m", "trainer", "--preset", job.preset, "--run-dir", str(run_dir),
        *job_trainer_overrides(job), f"data.uri={data_uri}",
    ]


def run_local(spec_path: str | None, *, nproc: int = DEFAULT_NPROC, data: str = "", runs: str = "runs") -> int:
    from gpu_train_cli.jobs import read_spec
    from infra.config import ConfigError, read_job

    raw = dict(read_spec(spec_path)) if spec_path else dict(DEFAULT_SPEC)
    source = spec_path or "the embedded default spec"
    if nproc < 1:
        raise CliError(f"--nproc {nproc} must be >= 1")
    try:
        job = read_job(raw, cfg=local_config(str(raw.get("team") or "local"), str(raw.get("pool") or "local")),
                       key="job")
    except ConfigError as exc:
        raise CliError("\n".join(f"{source}: {p}" for p in exc.problems)) from None
    if data:
        data_uri = data
    elif job.dataset_uri.startswith("file://"):
        data_uri = job.dataset_uri
    else:
        data_uri = "synthetic"
        if job.dataset_uri:
            print(f"gpu-train: {job.dataset_uri} is the cluster's dataset; this run trains on synthetic data "
                  "(--data URI to use another)", file=sys.stderr)
    run_dir = Path(runs) / job.name
    cmd = launch_command(job, nproc=nproc, run_dir=run_dir, data_uri=data_uri)
    env = dict(os.environ)
    # torchrun lives next to this interpreter (the venv's bin), which need not be on PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    print(f"gpu-train: job {job.name!r} ({job.preset}, {job.steps} steps) on {nproc} local worker(s), run directory "
          f"{run_dir}", file=sys.stderr)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:  # the launcher got the SIGINT too, and stops torchrun and its workers
        return 130
