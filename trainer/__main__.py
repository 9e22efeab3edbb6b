"""Command line of the trainer.

Run:
    python -m trainer --preset tiny --run-dir runs/dev train.steps=50          # one process (world 1)
    gpu-train-launch --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 \\
        --max-restarts=3 -m trainer --preset tiny --run-dir runs/dev             # elastic, 2 workers
    python -m trainer --help                                                   # every key with its default

Overrides are `section.key=value`. Exit codes (trainer/errors.py): 0 all of train.steps done, or stopped by
early stopping (eval.early_stopping_patience) after a final checkpoint; 2 bad input, printed as one line naming
the setting, file, URI or checkpoint (never a traceback); 75 stopped by SIGTERM (or, under torchrun, SIGINT) here
or on another node, after a final checkpoint; 130 stopped by Ctrl-C (SIGINT) in one process, after the same
final checkpoint, with one line (a second Ctrl-C stops at once, without it); 124 a hung step ended by the
watchdog (trainer/watchdog.py); 1 another failure worth retrying. Under gpu-train-launch (trainer/entrypoint.sh) a bad input also stops torchrun from restarting the
workers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpu_train.spec.trainer_config import PRESETS, build_config, reference
from trainer.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_RESUMABLE,
    BadInput,
    TrainingFailed,
    one_line,
    stop_retries,
)

PROG = "python -m trainer"


def parser() -> argparse.ArgumentParser:
    keys = "\n".join(f"  {key:<36} {typ:<24} default {default!r}" for key, typ, default in reference())
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train a GPT decoder with DDP or FSDP2; elastic under torchrun; resumes from the newest "
        "verified checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"overrides (section.key=value; values of the preset shown for tiny):\n{keys}\n\n"
        "exit codes: 0 completed (or stopped early), 2 bad input (not retried), 75 stopped by SIGTERM after a "
        "checkpoint, 130 stopped by Ctrl-C after a checkpoint, 124 hung (watchdog), 1 failure (retried).\n"
        "See docs/trainer.md.",
    )
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), help="named configuration (default tiny)")
    p.add_argument("--config", type=Path, default=None, help="YAML file with the same sections as the overrides")
    p.add_argument("--run-dir", type=Path, default=Path("runs/default"),
                   help="outputs: summary.json, metrics.jsonl, loss.png, config.json, checkpoints/")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p


def bad_input(message: str) -> int:
    """One line on stderr: under the launcher its own (the worker stops torchrun from restarting the group and
    leaves the message to it, trainer/errors.py), else this worker's."""
    text = one_line(message)
    if not stop_retries(text):
        print(f"{PROG}: error: {text}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None, *, step_callbacks: Iterable[Any] = (), energy_counter: Any = None) -> int:
    """Run the trainer with these arguments (default: the command line); returns the exit code.
    `step_callbacks` go to the Trainer (trainer/train.py says when they are called); none in production.
    `energy_counter`: this rank's GPU energy counter (trainer/energy.py); None: the GPU's own, through NVML."""
    args = parser().parse_args(argv)  # argparse itself exits 2 with a usage line on an unknown option
    from trainer.distributed import bind_to_agent, under_torchrun

    bind_to_agent()
    standalone = not under_torchrun()
    try:
        cfg = build_config(args.preset, args.config, args.overrides)
        from trainer.data.errors import DataError
        from trainer.train import train

        try:
            summary = train(cfg, args.run_dir, step_callbacks=step_callbacks, energy_counter=energy_counter)
        except DataError as exc:  # a data failure outside the checks that already name data.uri
            raise BadInput(f"data.uri: {exc}") from exc
    except BadInput as exc:
        return bad_input(str(exc))
    except TrainingFailed as exc:
        print(f"{PROG}: failed (will be retried): {one_line(str(exc))}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C before the trainer caught SIGINT itself (imports, the process group)
        print(f"{PROG}: interrupted (SIGINT) before training started: nothing to save", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED if standalone else EXIT_RESUMABLE
    if summary["status"] in ("completed", "stopped_early"):
        return EXIT_OK
    if summary.get("signal") == "SIGINT" and standalone:
        # Ctrl-C on a run of its own: the conventional status of a command the user interrupted, after the stop.
        print(f"{PROG}: interrupted (SIGINT) at step {summary['step']}; the same command resumes from the newest "
              "checkpoint", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return EXIT_RESUMABLE


def exit_now(code: int) -> None:
    """Flush and leave without the interpreter's teardown of torch's native state, which takes seconds and
    delays torchrun noticing that a worker is gone (and so every restart). Everything of ours is closed."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
