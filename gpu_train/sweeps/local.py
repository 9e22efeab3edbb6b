"""Sweep trials as local torchrun jobs on this machine: each trial through the one local launch
(gpu_train.jobs.launch.local, as `gpu-train run --local` runs a job), in its own run directory under runs/<sweep>/<trial>.

Usage:
    backend = LocalBackend(sweep, runs=Path("runs"), data_uri="synthetic", nproc=1, tracking_uri=...)
    Controller(sweep, backend.sweep_dir, backend).run()

A trial's budget object and status.json are files in its run directory (train.budget_uri=file://.../budget.json).
Pausing sends SIGTERM to its launcher, which has every worker stop (the checkpoint of the rung is already
saved) and exits 75; launching again the same run directory resumes from that checkpoint. A launcher from an
earlier launch that is still stopping is waited for first, so two launches never share a run directory. The
launchers get SIGTERM when this process dies (gpu_train.jobs.launch.detach_launcher), so a killed controller
leaves no trial training on its own: its successor launches them again and they resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from gpu_train.jobs.launch import Site, detach_launcher, local
from gpu_train.spec.errors import EXIT_RESUMABLE
from gpu_train.spec.job import JobSpec
from gpu_train.spec.sweep import SweepSpec
from gpu_train.sweeps.journal import TrialState

log = logging.getLogger("gpu_train.sweeps")
BUDGET = "budget.json"
STATUS = "status.json"
LAUNCHER_LOG = "launcher.log"
LAUNCHER_PID = "launcher.pid"
# How long a stopping launcher may take: torchrun's shutdown timeout (gpu_train.jobs.launch) and a margin.
STOP_WAIT_S = 330


class LocalBackend:
    """Trials as local launcher processes (module docstring)."""

    poll_s = 0.5

    def __init__(self, sweep: SweepSpec, *, runs: Path, data_uri: str, nproc: int = 1, tracking_uri: str = "",
                 parent_run_id: str | None = None, workdir: Path | None = None) -> None:
        """`workdir`: where a template with its own command runs (its script's folder, as the image's /workspace)."""
        self.sweep, self.data_uri, self.nproc, self.workdir = sweep, data_uri, nproc, workdir
        self.sweep_dir = Path(runs).resolve() / sweep.name
        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id
        self.procs: dict[str, subprocess.Popen] = {}

    def run_dir(self, t: TrialState) -> Path:
        return self.sweep_dir / t.id

    def settings(self, t: TrialState) -> dict[str, Any]:
        out = {"train.budget_uri": (self.run_dir(t) / BUDGET).as_uri(), "tracking.experiment": self.sweep.name}
        if self.tracking_uri:
            out["tracking.uri"] = self.tracking_uri
        if self.parent_run_id:
            out["tracking.parent_run_id"] = self.parent_run_id
        return out

    def write_budget(self, t: TrialState, tokens: int) -> None:
        path = self.run_dir(t) / BUDGET
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{BUDGET}.{os.getpid()}.part")
        tmp.write_text(json.dumps({"tokens": tokens}) + "\n")
        os.replace(tmp, path)

    def read_status(self, t: TrialState) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir(t) / STATUS).read_text())
        except (OSError, ValueError):
            return None  # not written yet, or being replaced: read again at the next pass

    def launch(self, t: TrialState, job: JobSpec) -> None:
        run_dir = self.run_dir(t)
        run_dir.mkdir(parents=True, exist_ok=True)
        proc = self.procs.get(t.id)
        if proc is not None and proc.poll() is None:
            try:  # stopping after a pause: wait for it before a new launch uses the same run directory
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"trial {t.id}'s launcher (pid {proc.pid}) did not stop within "
                                   f"{STOP_WAIT_S} s of SIGTERM") from None
        elif proc is None:
            wait_for_exit(run_dir / LAUNCHER_PID, run_dir)  # one a killed controller started, now stopping
        # This machine: no object store, no read cache; the same precedence as `gpu-train run --local`.
        cmd, env = local(job, Site(run_dir=str(run_dir), dataset_uri=self.data_uri), self.nproc)
        with open(run_dir / LAUNCHER_LOG, "ab") as logf:
            self.procs[t.id] = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                                cwd=None if job.bundled else self.workdir,
                                                stdin=subprocess.DEVNULL, preexec_fn=detach_launcher)  # noqa: PLW1509
        (run_dir / LAUNCHER_PID).write_text(f"{self.procs[t.id].pid}\n")

    def pause(self, t: TrialState) -> None:
        proc = self.procs.get(t.id)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    stop = pause  # a trial stopped for good gets the same SIGTERM as a paused one

    def ended(self, t: TrialState) -> str | None:
        """None while its launcher runs; "preempted" after a stop signal (exit 75), else what went wrong."""
        proc = self.procs.get(t.id)
        if proc is None:
            return "not running"
        code = proc.poll()
        if code is None:
            return None
        if code == EXIT_RESUMABLE:
            return "preempted"
        return f"its launcher exited {code} (see {self.run_dir(t) / LAUNCHER_LOG})"

    def shutdown(self) -> None:
        """Stop every trial (each saves a checkpoint) and wait for them."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_WAIT_S)


def wait_for_exit(pid_file: Path, run_dir: Path, timeout_s: float = STOP_WAIT_S) -> None:
    """Wait until the launcher named in `pid_file` (if it is still a launcher of `run_dir`) has exited."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout_s
    while _is_launcher(pid, run_dir):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the launcher of {run_dir} (pid {pid}) from an earlier controller did not stop "
                               f"within {timeout_s:.0f} s")
        time.sleep(0.2)


def _is_launcher(pid: int, run_dir: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"trainer.launch" in cmdline and str(run_dir).encode() in cmdline
