"""The trainer's errors, the exit codes they map to (defined with the platform's vocabulary,
gpu_train.spec.errors, because the JobSet maps them to its failure rules), and how a worker stops retries.

Usage:
    from trainer.errors import BadInput, TrainingFailed, EXIT_BAD_INPUT
    raise BadInput("train.lr must be a finite number (got nan)")   # -> one line on stderr, exit 2

Exit codes (of `python -m trainer` and of the launcher `gpu-train-launch`, see docs/trainer.md):
    0   EXIT_OK          every step of train.steps is done and the final checkpoint is saved
    2   EXIT_BAD_INPUT   settings, dataset, run directory or checkpoint unusable; retrying cannot help
    75  EXIT_RESUMABLE   stopped early (SIGTERM or SIGINT on this node or another one) after a final
                         checkpoint; the next launch resumes (75 is EX_TEMPFAIL of sysexits.h: "try again later")
    130 EXIT_INTERRUPTED the same stop after a Ctrl-C (SIGINT), from the commands a user runs: `python -m
                         trainer` in one process, the launcher, `gpu-train run --local` (128 + SIGINT, the
                         shell's convention); a worker under torchrun exits 75
    124 (watchdog)       a hung worker ended by its watchdog (trainer/watchdog.py) after dumping every
                         thread's stack; retried: torchrun restarts the group from the newest checkpoint
    1   anything else    a failure worth retrying (lost peer, storage outage, ...)

Why a worker kills its own agent on bad input: torchrun restarts the whole worker group after any worker
failure until --max-restarts is used up, whatever the exit code (torch 2.13,
torch/distributed/elastic/agent/server/api.py, SimpleElasticAgent._invoke_run), and it exits 1 itself
afterwards. So under the launcher (which sets TRAINER_EXIT_FILE and TRAINER_LAUNCHER_PID) the first worker of
a node that finds bad input writes its message to TRAINER_EXIT_FILE and SIGKILLs its torchrun agent before
exiting: the agent never sees a failed worker, so it restarts nothing; the node's other workers die with it
(they asked for SIGKILL on their parent's death, trainer.distributed.bind_to_agent); the launcher finds the
file, prints the message and exits 2: that line is the only one, as the workers print nothing themselves then.
Without the launcher (plain torchrun) each worker prints its line and exits 2, and torchrun restarts the group
into the same error until --max-restarts is used up: torchrun cannot skip restarts by exit code, so a plain
torchrun run stops at the first bad input only with --max-restarts=0 (docs/trainer.md).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from gpu_train.spec import env as job_env
from gpu_train.spec.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RESUMABLE,
    BadInput,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_RESUMABLE", "BadInput",
           "TrainingFailed", "one_line", "record_stop", "stop_retries"]


class TrainingFailed(Exception):
    """A failure worth retrying (a storage outage, the final checkpoint not saved); one line, exit 1."""


def one_line(text: str) -> str:
    """Messages end up in pod logs and alert texts: keep them on one line."""
    return " ".join(str(text).split())


def _parent_pid_of(pid: int) -> int | None:
    """Parent of `pid` from /proc/PID/stat (field 4, after the parenthesised command name)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return None


def stop_retries(message: str) -> bool:
    """Record bad input for the launcher and stop this node's torchrun agent; True when the launcher will print
    the message (this worker recorded it, or another worker of this node already did): the worker then prints
    nothing itself, so the message is one line however many workers found it.

    Does nothing (returns False) unless this worker runs under a torchrun that the launcher started: the
    agent is our parent and the launcher is the agent's parent. Only the first worker of a node to get here
    writes the file (O_EXCL) and kills the agent; the others are killed with it.
    """
    path = os.environ.get(job_env.EXIT_FILE)
    launcher = os.environ.get(job_env.LAUNCHER_PID)
    if not path or not launcher or not launcher.isdigit():
        return False
    agent = os.getppid()
    if _parent_pid_of(agent) != int(launcher):
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return True  # another worker of this node recorded its message and is killing the agent
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(one_line(message) + "\n")
    os.kill(agent, signal.SIGKILL)
    return True


def record_stop(step: int, *, saved: bool | None, signal: str) -> None:
    """Tell the launcher (TRAINER_STOP_FILE, which it sets) how this node's workers stopped on a signal: at `step`,
    with its final checkpoint saved (True), not saved (False), or without a new one (None: stopped before training).
    The launcher prints it in its one line; without the launcher (or on a write error) nothing happens."""
    path = os.environ.get(job_env.STOP_FILE)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "saved": saved, "signal": signal}) + "\n")
    except OSError:
        pass
