"""`gpu-train run --local [SPEC]`: a job spec under local torchrun on this machine, through the one launch builder
(gpu_train.jobs.launch) and the launcher (python -m trainer.launch: the bundled trainer's preflight,
then torchrun with elastic c10d rendezvous).

Usage:
    run_local(None)                                        # the embedded default: the tiny preset, 2 CPU workers
    run_local("job.yaml", nproc=1)                         # a team's spec: its command or the bundled trainer
    run_local("examples/plain-loop/job.yaml", nproc=2)     # its command runs in examples/plain-loop/

The spec goes through the same job model as a submitted one (gpu_train.spec.job: types, then the job's own and
its trainer settings' checks, with this machine standing in for the pool: `nproc` workers on one node) and gets
the same command and job environment the cluster job gets (gpu_train.jobs.launch: launch_env, and for the
bundled trainer its settings). What differs on one machine: one node (`--nnodes=1`) with nproc workers, a run
directory under ./runs/<job name> instead of the node's NVMe, no object store unless the spec names a file://
checkpoint URI, and the dataset: --data, or the spec's own when it is a local file:// manifest, else the
built-in synthetic data (a cluster dataset in object storage is the cluster's to read); a dataset on this disk
without its manifest (a mistyped path) is refused at once with one line naming it. A job of its own code runs
in its working directory (the spec's folder unless `workdir`), as it runs in the image's /workspace. It needs the
trainer package (`pip install ".[trainer]"`); without it, one line says so. Ctrl-C stops it the way
SIGTERM stops a cluster job: the launcher has every worker stop (the bundled trainer after a final checkpoint),
prints one line and exits 130, which this returns (the same command resumes); a second Ctrl-C stops at once.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from gpu_train.client.errors import ClientError
from gpu_train.jobs.launch import Site, local, run_forwarding
from gpu_train.sizing.job import layout_problems
from gpu_train.spec import naming
from gpu_train.spec.errors import SettingsError
from gpu_train.spec.install import install_hint
from gpu_train.spec.job import JobSpec, NodeRange, job_problems, read_job
from gpu_train.spec.values import as_uri

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
    pool: str = ""  # the team's pool (its quota is there); "" for the pool itself

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
        return {self.pool or self.name: self.nproc}


def local_problems(job: JobSpec, nproc: int, key: str = "job") -> list[str]:
    """The job's checks with this machine as its pool: MIN:MAX is the cluster's business, so one node here."""
    here = job.model_copy(update={"nodes": NodeRange(1, 1), "gpus_per_node": 0})
    pools = [_Here(job.pool, nproc)]
    return (job_problems(here, pools=pools, teams=[_Here(job.team, nproc, pool=job.pool)], scheme=None, key=key)
            + layout_problems(here, pools=pools, key=key))


def local_site(job: JobSpec, *, runs: str | Path, data: str = "") -> Site:
    """This machine as the job's site: runs/<job> for the node's disk, the dataset from --data or the spec's own
    file:// one (else the built-in synthetic data: a cluster dataset in object storage is the cluster's to read),
    the spec's checkpoint URI when it is a file:// one."""
    if data:
        data_uri = as_uri(data)  # a plain path is this shell's, whatever the job's working directory
    elif job.dataset_uri.startswith("file://"):
        data_uri = job.dataset_uri
    else:
        data_uri = "synthetic"
        if job.dataset_uri:
            print(f"gpu-train: {job.dataset_uri} is the cluster's dataset; this run trains on synthetic data "
                  "(--data URI to use another)", file=sys.stderr)
    checkpoint_uri = job.checkpoint_uri if job.checkpoint_uri.startswith("file://") else ""
    return Site(run_dir=str(Path(runs).resolve() / job.name), dataset_uri=data_uri, checkpoint_uri=checkpoint_uri)


def local_dataset_problem(uri: str) -> str | None:
    """Why a dataset on this machine's disk (file://) cannot be used, checked at once: nothing will upload it while
    the job waits, so a missing manifest is a mistyped path. None for one that is there, the synthetic data, or an
    object store (whose manifest the launcher waits for, TRAINER_DATA_WAIT_S)."""
    if not uri.startswith("file://"):
        return None
    # The client imports neither the trainer nor the storage layer: a file:// dataset is a manifest file, or a
    # folder holding the manifest under the name the trainer reads (naming.DATASET_MANIFEST).
    path = Path(unquote(urlsplit(uri).path))
    manifest = path if path.suffix == ".json" else path / naming.DATASET_MANIFEST
    if not manifest.is_file():
        return (f"{uri}: no dataset manifest at {manifest.as_uri()}; prepare one there first: "
                f"python -m trainer.data prepare ... --out file://{manifest.parent}")
    return None


def run_local(spec_path: str | Path | None, *, nproc: int = DEFAULT_NPROC, data: str = "", runs: str | Path = "runs",
              workdir: str | Path | None = None) -> int:
    """Run a job spec (default: the embedded one) under local torchrun; returns the launcher's exit code. A job of
    its own code runs in `workdir` (default: the spec file's folder, as the image's /workspace holds the folder it
    was built from)."""
    from gpu_train.client.jobs import read_spec

    raw = dict(read_spec(spec_path)) if spec_path else dict(DEFAULT_SPEC)
    source = str(spec_path or "the embedded default spec")
    if nproc < 1:
        raise ClientError(f"--nproc {nproc} must be >= 1")
    if importlib.util.find_spec("torch") is None:
        raise ClientError("`gpu-train run --local` runs the trainer on this machine and needs it installed: "
                          + install_hint("trainer"))
    try:
        job = read_job(raw, key="job")
    except SettingsError as exc:
        raise ClientError("\n".join(f"{source}: {p}" for p in exc.problems)) from None
    problems = local_problems(job, nproc)
    if problems:
        raise ClientError("\n".join(f"{source}: {p}" for p in problems))
    site = local_site(job, runs=runs, data=data)
    problem = local_dataset_problem(site.dataset_uri)
    if problem:
        raise ClientError(f"{'--data' if data else f'{source}: datasetUri'} {problem}")
    cwd = None
    if not job.bundled:
        cwd = Path(workdir) if workdir else (Path(spec_path).resolve().parent if spec_path else Path.cwd())
        if not cwd.is_dir():
            raise ClientError(f"--workdir {cwd}: no such directory")
    cmd, env = local(job, site, nproc)  # the one precedence of a local launch (its docstring)
    what = f"{job.preset}, {job.steps} steps" if job.bundled else " ".join(job.argv)
    print(f"gpu-train: job {job.name!r} ({what}) on {nproc} local worker(s), run directory {site.run_dir}"
          + (f", in {cwd}" if cwd else ""), file=sys.stderr)
    return run_forwarding(cmd, env=env, cwd=cwd)[0]  # stop signals reach the launcher once each
