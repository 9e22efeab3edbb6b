"""The launch builder: torchrun's arguments and a job's environment, wherever it runs (the launcher that
runs them is trainer/launch.py).

Usage:
    site = Site(run_dir="/mnt/nvme/runs/JOB", dataset_uri="s3://ds/JOB/manifest.json", ...)   # where it runs
    env = launch_env(job, site)                                      # the job environment (gpu_train.spec.env)
    args = torchrun_args(job, nproc=8, endpoint="JOB-worker-0-0.JOB:29400", run_dir=site.run_dir,
                         settings=trainer_settings(job, bundled_settings(job, site)))   # the JobSet's container args
    argv, env = local(job, Site(run_dir="runs/x", dataset_uri="synthetic"), 2)   # run --local, sweep trials, bench
    code, signals = run_forwarding(argv, env=env)   # stop signals to this process reach the launcher once each

Every path that starts a job goes through here: the stack's JobSet and `gpu-train submit` (gpu_train.jobs.jobset),
`gpu-train run --local`, `make train`, local sweep trials and the benchmarks. The launcher (`gpu-train-launch` =
`python -m trainer.launch`, in the image) then checks the bundled trainer's inputs, waits for the dataset and the
rendezvous host, and runs torchrun with this environment (a value the caller already set wins).

What runs (`command_args`): the job's command, mapped to torchrun's own forms: `["python", "-m", "pkg.mod", ...]`
to its module form (`-m pkg.mod ...`), `["python", "path/script.py", ...]` to its script form, anything else to
`--no-python argv...`; torchrun starts each worker with this interpreter in the first two forms. The bundled
trainer (no command) is `-m trainer --preset P --run-dir D section.key=value...`: only it reads trainer settings.

What is spelled here and nowhere else:
- the job's environment (launch_env): the variables gpu_train.spec.env.JOB_ENV lists with source "job";
- the rendezvous: c10d on port RDZV_PORT of pod 0, elastic `--nnodes=MIN:MAX`, the join timeout;
- the rendezvous-store switch: every round gets a fresh store instead of the agent's shared TCPStore, whose keys
  go stale when the agents' restart counts differ after one node fails
  (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, use_agent_store); the trainer relies on it;
- the shutdown: torchrun forwards SIGTERM to its workers and kills them `--shutdown-timeout` seconds later
  (default 30, torch/distributed/run.py); the workers get the pod's grace period less SHUTDOWN_MARGIN_S, in
  which torchrun reaps them and exits before the kubelet's SIGKILL;
- NCCL's watchdog settings (torch 2.13 names, torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp and
  FlightRecorder.hpp): a collective that errors or times out tears the process down without a communicator
  abort that can itself hang (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's own default made explicit), the flight
  recorder keeps its ring buffer (TORCH_FR_BUFFER_SIZE) and dumps it on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT),
  the heartbeat monitor stays on (TORCH_NCCL_ENABLE_MONITORING). The heartbeat timeout follows the trainer's
  watchdog settings and is set by the worker itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_train.spec import env as job_env
from gpu_train.spec.job import JobSpec, NodeRange, override_text, trainer_settings

LAUNCHER = "gpu-train-launch"  # trainer/entrypoint.sh in the image: `python -m trainer.launch "$@"`
RDZV_PORT = 29400
# SIGTERM -> the trainer writes a final checkpoint and uploads it. 300 s covers a synchronous save of the 7b
# preset's sharded state to local NVMe plus the upload of one checkpoint at object-store speeds.
TERMINATION_GRACE_S = 300
SHUTDOWN_MARGIN_S = 15
PYTHONS = ("python", "python3")  # a command starting with one of these runs in torchrun's own interpreter
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what run_forwarding passes on to its child


class LaunchSpecError(ValueError):
    """A job that cannot be launched as asked; the message names the setting."""


def nccl_env() -> dict[str, str]:
    """The TORCH_NCCL_* settings every launch gets; see the module docstring."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
    }


def rendezvous_env(job: JobSpec) -> dict[str, str]:
    """The store switch and the launcher's waits for this job."""
    return {
        job_env.STORE_SWITCH: "1",
        job_env.DATA_WAIT: str(job.data_wait_minutes * 60),
        # As long as torchrun's join: pod 0's DNS name appears only once the pod exists.
        job_env.DNS_TIMEOUT: str(job.rendezvous_timeout_minutes * 60),
    }


@dataclass(frozen=True, kw_only=True)
class Site:
    """Where a job's processes run: the paths and endpoints its environment names (gpu_train.spec.env)."""

    run_dir: str  # the job's directory on the node's disk
    dataset_uri: str  # the manifest URI as the job reads it (through the cache when data_endpoint is set)
    checkpoint_uri: str = ""  # "" = no object store (a run on one machine)
    data_cache_dir: str = ""  # "" = <run_dir>/../cache/<job>
    data_endpoint: str = ""  # the read cache's S3 endpoint for dataset_uri
    tracking_uri: str = ""  # MLflow
    metrics_port: int = 0  # 0 = no scraping (a run on one machine)
    cloud: str = ""
    region: str = ""
    image_digest: str = ""

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.run_dir}/checkpoints"

    def cache_dir(self, job: JobSpec) -> str:
        return self.data_cache_dir or f"{self.run_dir.rsplit('/', 1)[0]}/cache/{job.name}"


def launch_env(job: JobSpec, site: Site) -> dict[str, str]:
    """The job's environment (JOB_ENV's "job" variables): the same for the bundled trainer and any command."""
    env = {
        job_env.JOB_NAME: job.name,
        job_env.RUN_DIR: site.run_dir,
        job_env.CHECKPOINT_DIR: site.checkpoint_dir,
        job_env.CHECKPOINT_URI: site.checkpoint_uri,
        job_env.DATASET_URI: site.dataset_uri,
        job_env.DATA_CACHE_DIR: site.cache_dir(job),
        job_env.EXPERIMENT: job.name,
        **nccl_env(),
        job_env.FR_DUMP: f"{site.run_dir}/nccl_trace_rank_",
        **rendezvous_env(job),
    }
    optional = {job_env.DATA_ENDPOINT: site.data_endpoint, job_env.TRACKING_URI: site.tracking_uri,
                job_env.METRICS_PORT: str(site.metrics_port) if site.metrics_port else "",
                job_env.CLOUD: site.cloud, job_env.REGION: site.region, job_env.IMAGE_DIGEST: site.image_digest}
    env.update({k: v for k, v in optional.items() if v})
    if site.cloud and not site.region:
        raise LaunchSpecError(f"job {job.name!r}: a cloud ({site.cloud}) without its region")
    return env


def bundled_settings(job: JobSpec, site: Site) -> dict[str, Any]:
    """The bundled trainer's settings for where it runs: the same places its environment names."""
    settings: dict[str, Any] = {
        "checkpoint.local_dir": site.checkpoint_dir, "checkpoint.remote_uri": site.checkpoint_uri,
        "data.uri": site.dataset_uri, "data.cache_dir": site.cache_dir(job), "tracking.experiment": job.name}
    if site.data_endpoint:
        settings["data.endpoint_url"] = site.data_endpoint
    return settings


def shutdown_timeout_s(grace_s: int = TERMINATION_GRACE_S) -> int:
    """torchrun's --shutdown-timeout for a pod with this termination grace period."""
    if grace_s <= SHUTDOWN_MARGIN_S:
        raise LaunchSpecError(f"a termination grace period of {grace_s} s leaves torchrun no time to stop its "
                              f"workers (it needs more than {SHUTDOWN_MARGIN_S} s)")
    return grace_s - SHUTDOWN_MARGIN_S


def command_args(job: JobSpec, run_dir: str | Path, settings: Mapping[str, Any]) -> list[str]:
    """What torchrun runs on every node, in its own form (module docstring): the bundled trainer with its preset,
    run directory and dotted `settings`, or the job's command (`settings` are the bundled trainer's only)."""
    if job.bundled:
        return ["-m", "trainer", "--preset", job.preset, "--run-dir", str(run_dir),
                *(override_text(k, v) for k, v in settings.items())]
    argv = job.argv
    if not argv or not argv[0]:
        raise LaunchSpecError(f"job {job.name!r}: job.command is empty")
    if argv[0] in PYTHONS and len(argv) >= 3 and argv[1] == "-m":
        return ["-m", *argv[2:]]
    if argv[0] in PYTHONS and len(argv) >= 2 and not argv[1].startswith("-"):
        return argv[1:]
    return ["--no-python", *argv]


def torchrun_args(job: JobSpec, *, nproc: int, endpoint: str, run_dir: str | Path, settings: Mapping[str, Any],
                  nodes: NodeRange | None = None, rdzv_conf: Sequence[str] = (),
                  shutdown_timeout: int | None = None) -> list[str]:
    """torchrun's arguments (which the launcher takes as they are), then what it runs (command_args).

    `nodes` defaults to the job's MIN:MAX; `rdzv_conf` adds rendezvous options after the join timeout (which is at
    least as long as Kueue gives the pods to become ready: gpu_train.spec.job.timeout_problems)."""
    nodes = nodes or job.nodes
    conf = ",".join([f"join_timeout={job.rendezvous_timeout_minutes * 60}", *rdzv_conf])
    args = [
        f"--nnodes={nodes.min}:{nodes.max}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job.name}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={job.max_restarts}",
    ]
    if shutdown_timeout is not None:
        args.append(f"--shutdown-timeout={shutdown_timeout}")
    return [*args, *command_args(job, run_dir, settings)]


def local(job: JobSpec, site: Site, nproc: int, *, environ: Mapping[str, str] = os.environ,
          nodes: NodeRange = NodeRange(1, 1), rdzv_conf: Sequence[str] = (), port: int = 0) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line and environment for a job on this machine (`gpu-train run --local`, a local sweep
    trial, the benchmarks): one or more local "nodes" of `nproc` workers on the CPU or this machine's GPUs, the
    same shutdown rule as a pod's. The bundled trainer gets its settings for `site` (bundled_settings), then the
    job's own, as in the JobSet. The environment, each later source winning over the ones before it:
    1. the launcher's tuning (nccl_env, rendezvous_env: NCCL's watchdog, the store switch, the waits);
    2. the caller's environment (`environ`), which may retune those, as a value already set wins on a node;
    3. the job's places (the rest of launch_env: name, run directory, dataset, cache, checkpoints, experiment),
       so that they always name what the trainer's settings name;
    4. PATH with this interpreter's folder first: torchrun lives there (a virtualenv's bin need not be on PATH)."""
    if nproc < 1:
        raise LaunchSpecError(f"--nproc {nproc} must be >= 1")
    settings = trainer_settings(job, bundled_settings(job, site))
    argv = [sys.executable, "-m", "trainer.launch",
            *torchrun_args(job, nproc=nproc, endpoint=f"localhost:{port}", run_dir=site.run_dir, settings=settings,
                           nodes=nodes, rdzv_conf=rdzv_conf, shutdown_timeout=shutdown_timeout_s())]
    tuning = {**nccl_env(), **rendezvous_env(job)}
    env = {**tuning, **environ, **{k: v for k, v in launch_env(job, site).items() if k not in tuning}}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return argv, env


def detach_launcher() -> None:
    """In a launcher's process (subprocess preexec_fn): a process group of its own, so a terminal's Ctrl-C reaches
    only the command that started it (which forwards it once), and SIGTERM when that command dies (Linux's
    PR_SET_PDEATHSIG), so the launcher still stops its workers after a final checkpoint instead of training on
    alone."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def run_forwarding(cmd: Sequence[str], *, env: Mapping[str, str], cwd: str | Path | None = None,
                   preexec_fn: Callable[[], None] | None = detach_launcher) -> tuple[int, list[int]]:
    """Run `cmd` and wait for it (`gpu-train run --local` runs the launcher so, the launcher torchrun): SIGINT,
    SIGTERM and SIGHUP to this process are forwarded to it once each, one that arrives before it exists as soon as it
    does; the previous handlers are back afterwards. Returns its exit code and the signals forwarded, in order."""
    received: list[int] = []
    children: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:  # noqa: ARG001
        received.append(signum)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    # Handlers first: a signal between the start and the handlers would otherwise end this process alone.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        child = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, preexec_fn=preexec_fn)  # noqa: PLW1509
        children.append(child)
        if received:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(received[0])
        return child.wait(), received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
