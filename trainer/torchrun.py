"""torchrun as the launcher runs it: the `torchrun` on PATH, in this interpreter, ending quietly on a stop signal.

Usage (trainer/launch.py runs it; not a command of its own):
    python -m trainer.torchrun /path/to/torchrun --nnodes=1 ... -m trainer ...

torchrun's agent turns SIGTERM and SIGINT into a SignalException: it forwards the signal to its workers, waits up
to --shutdown-timeout for them to stop (the trainer's final checkpoint), then raises the exception out of its
main, and Python prints a 25-line traceback for what is an orderly stop
(torch/distributed/elastic/multiprocessing/api.py, _terminate_process_handler;
torch/distributed/elastic/agent/server/api.py, SimpleElasticAgent.run). Here the exception ends the process
with 128 + the signal's number and nothing printed: the launcher says in one line what happened. Every other
outcome (an exit code, a ChildFailedError with torchrun's own failure report) is torchrun's own.

It also puts this process's pid in the environment as TRAINER_AGENT_PID, which the workers inherit: their
parent must be this process, and a worker that finds another parent knows its agent is already gone
(trainer.distributed.bind_to_agent).

A `torchrun` that is not a Python script of this interpreter (a site's own wrapper) is executed as it is, in
this process (so with the same pid), and keeps its own behaviour.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from gpu_train.spec import env as job_env


def _runs_here(script: Path) -> bool:
    """Whether `script` is a Python script meant for this interpreter (its #! line names it)."""
    try:
        with script.open("rb") as f:
            first = f.readline(4096).decode(errors="replace")
    except OSError:
        return False
    if not first.startswith("#!") or "python" not in first:
        return False
    interpreter = first[2:].split()[0] if first[2:].split() else ""
    try:
        return os.path.samefile(interpreter, sys.executable) or Path(interpreter).resolve() == Path(
            sys.executable).resolve()
    except OSError:
        return False


def main(argv: list[str]) -> int:
    script, args = Path(argv[0]), argv[1:]
    os.environ[job_env.AGENT_PID] = str(os.getpid())
    if not _runs_here(script):
        os.execv(script, [str(script), *args])
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SignalException as exc:  # the workers were told and waited for; the launcher reports it
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
