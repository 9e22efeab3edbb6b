"""`gpu-train run --local [SPEC]`: a job spec under local torchrun on this machine, through the one launcher
(gpu_train.jobs.launch) and the image's own launcher (python -m trainer.launch: preflight, then torchrun with
elastic c10d rendezvous).

Usage:
    gpu-train run --local                      # the embedded default: the tiny preset on 2 CPU workers
    gpu-train run --local job.yaml --nproc 1   # a team's spec: its preset, overrides, steps, batch, checkpoints

The spec goes through the same job model as a submitted one (gpu_train.spec.job: types, then the job's own and
its trainer settings' checks, with this machine standing in for the pool: `--nproc` workers on one node) and
gives the trainer the same settings the cluster job gets (gpu_train.spec.job.trainer_settings). What differs on
one machine: one node (`--nnodes=1`) with --nproc workers, a run directory under ./runs/<job name> instead of the
node's NVMe, and the dataset: --data, or the spec's own when it is a local file:// manifest, else the trainer's
built-in synthetic data (a cluster dataset in object storage is the cluster's to read). It needs the trainer
(`pip install "gpu-train[trainer]"`); without it, one line says so. Ctrl-C stops it the way SIGTERM stops a
cluster job: the launcher has every worker save a final checkpoint, prints one line and exits 130, which this
command returns (the same command resumes); a second Ctrl-C stops at once, without that checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_train.cli.cluster import CliError
from gpu_train.jobs.launch import launch_env, local_command
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.job import JobSpec, NodeRange, job_problems, read_job, trainer_settings

# The embedded default: what `make train` runs, as a job spec.
DEFAULT_SPEC: dict[str, Any] = {
    "name": "local-tiny", "team": "local", "pool": "local", "preset": "tiny", "nodes": "1:1", "steps": 200,
    "globalBatchTokens": 4096, "checkpointEvery": 50, "maxRestarts": 3,
}
DEFAULT_NPROC = 2


@dataclass(frozen=True)
class _Here:
    """This machine as the job's pool and team: `nproc` workers on one node, no quota to fit."""

    name: str
    nproc: int

    @property
    def instance_type(self) -> str:
        return "this machine"

    @property
    def gpus_per_node(self) -> int:
        return self.nproc

    @property
    def max_nodes(self) -> int:
        return 1

    @property
    def gpu_type(self) -> str:
        return ""  # no GPU memory to check the layout against

    @property
    def gpu_quota(self) -> dict[str, int]:
        return {self.name: self.nproc}


def local_problems(job: JobSpec, nproc: int, key: str = "job") -> list[str]:
    """The job's checks with this machine as its pool: MIN:MAX is the cluster's business, so one node here."""
    here = job.model_copy(update={"nodes": NodeRange(1, 1), "gpus_per_node": 0})
    return job_problems(here, pools=[_Here(job.pool, nproc)], teams=[_Here(job.team, nproc)], scheme=None, key=key)


def run_local(spec_path: str | None, *, nproc: int = DEFAULT_NPROC, data: str = "", runs: str = "runs") -> int:
    from gpu_train.cli.jobs import read_spec

    raw = dict(read_spec(spec_path)) if spec_path else dict(DEFAULT_SPEC)
    source = spec_path or "the embedded default spec"
    if nproc < 1:
        raise CliError(f"--nproc {nproc} must be >= 1")
    if importlib.util.find_spec("torch") is None:
        raise CliError('`gpu-train run --local` runs the trainer on this machine and needs it installed: '
                       'pip install "gpu-train[trainer]"')
    try:
        job = read_job(raw, key="job")
    except SettingsError as exc:
        raise CliError("\n".join(f"{source}: {p}" for p in exc.problems)) from None
    problems = local_problems(job, nproc)
    if problems:
        raise CliError("\n".join(f"{source}: {p}" for p in problems))
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
    cmd = local_command(job, nproc=nproc, run_dir=run_dir, settings=trainer_settings(job, {"data.uri": data_uri}))
    # The launcher's settings for this job, unless the caller set them; torchrun lives next to this interpreter
    # (the venv's bin), which need not be on PATH.
    env = {**launch_env(job), **os.environ}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    print(f"gpu-train: job {job.name!r} ({job.preset}, {job.steps} steps) on {nproc} local worker(s), run directory "
          f"{run_dir}", file=sys.stderr)
    return run_launcher(cmd, env)


def _launcher_child() -> None:
    """In the launcher's process: a process group of its own (a terminal's Ctrl-C reaches this command only, which
    forwards it once), and SIGTERM when this command dies (Linux's PR_SET_PDEATHSIG), so that the launcher still
    stops its workers after a final checkpoint instead of training on alone."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def run_launcher(cmd: list[str], env: dict[str, str]) -> int:
    """Run the launcher and return its exit code. SIGINT, SIGTERM and SIGHUP to this command are forwarded to it
    once each: on Ctrl-C it has the workers save a final checkpoint, prints one line and exits 130."""
    received: list[int] = []
    children: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:  # noqa: ARG001
        received.append(signum)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        child = subprocess.Popen(cmd, env=env, preexec_fn=_launcher_child)  # noqa: PLW1509
        children.append(child)
        if received:  # arrived before the launcher existed
            child.send_signal(received[0])
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
