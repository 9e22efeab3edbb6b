"""Running a sweep's controller to its end, wherever it runs (`gpu-train sweep run`, `python -m gpu_train.sweeps`).

Usage:
    status = drive(controller, backend.shutdown, sweep, sweep_dir)   # 0 at the end, 130 when stopped

SIGTERM and Ctrl-C call the backend's shutdown (local trials save a checkpoint and stop; cluster trials go on) and
return 130; the same command continues the sweep. The end writes the plot, completes the MLflow parent run and
prints the table. While it runs, the controller's pid is in <sweep_dir>/controller.pid (`gpu-train sweep stop`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from gpu_train.client.errors import ClientError
from gpu_train.sweeps.controller import SweepFailed
from gpu_train.sweeps.journal import CONTROLLER_PID


def drive(controller, shutdown, sweep, sweep_dir: Path,
          stopped: str = "its trials checkpointed and stopped; the same command continues it") -> int:
    previous = signal.signal(signal.SIGTERM, lambda *_: controller.stopping.set())
    pid_file = sweep_dir / CONTROLLER_PID
    pid_file.write_text(f"{os.getpid()}\n")
    try:
        controller.run()
    except KeyboardInterrupt:
        print(f"gpu-train: sweep {sweep.name!r} stopped: {stopped}", file=sys.stderr)
        shutdown()
        return 130
    except SweepFailed as exc:
        shutdown()
        raise ClientError(str(exc), code=1) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        pid_file.unlink(missing_ok=True)
    return finish(controller, sweep, sweep_dir)


def finish(controller, sweep, sweep_dir: Path) -> int:
    from gpu_train.sweeps.report import PLOT, plot_sweep, status_table

    plot = plot_sweep(sweep, controller.state, sweep_dir / PLOT)
    if controller.tracker:
        controller.tracker.finish(controller.state, plot=plot, journal=controller.journal.path)
    print(status_table(sweep, controller.state))
    print(f"plot      {plot}\njournal   {controller.journal.path}")
    if controller.tracker:
        print(f"mlflow    parent run {controller.parent_run_id} in {controller.tracker.tracking_uri}")
    return 0
