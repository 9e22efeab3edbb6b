"""Preemption: turn SIGTERM (spot reclaim, pod eviction, torchrun shutting down) and, if asked, SIGINT (Ctrl-C)
into a flag the loop polls, so that it finishes its step, saves and stops instead of dying mid-write.

Usage, in any training loop:
    from trainer import Preemption
    with Preemption(sigint=True) as preemption:       # installs the handlers; restores the old ones on exit
        for step in ...:
            train_step()
            if preemption.any_rank():                 # collective: every rank stops at the same step
                                                      # (preemption.preempted(): this process only)
                save_checkpoint()
                preemption.report(step, saved=True)   # how much of the shutdown grace period the save used
                break

The handlers only set the flag (and note which signal came first, and when), so they are safe to run between any
two Python bytecodes. With `second_sigint_exits=True` a second SIGINT (Ctrl-C pressed again while the final
checkpoint is written) ends the process at once with one line and exit 130, as an impatient user expects.
Several ranks must agree before they stop, since torchrun may deliver the signal to one node only: `any_rank()`
all-reduces the flag (the bundled trainer sends it in the step's own all-reduce with the loss instead). After the
final checkpoint a worker exits with EXIT_RESUMABLE (75, gpu_train.spec.errors): preempted, the next launch
resumes. `shutdown_timeout_s` is how long the
caller has between the signal and SIGKILL (torchrun's --shutdown-timeout; the trainer passes the launcher's
TRAINER_SHUTDOWN_TIMEOUT_S): `report` warns when the final save used more than half of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from types import FrameType
from typing import Any

from gpu_train.spec.errors import EXIT_INTERRUPTED

log = logging.getLogger("trainer")


class Preemption:
    """SIGTERM (and with `sigint=True` also SIGINT, Ctrl-C) sets a flag instead of ending the process.

    sigint: also catch SIGINT (an interactive run stops cleanly on Ctrl-C).
    shutdown_timeout_s: seconds between the signal and SIGKILL, for `report`; None when unknown.
    Signal handlers can only be installed from the main thread (Python's rule): `install` raises ValueError
    elsewhere.
    """

    def __init__(self, *, sigint: bool = False, shutdown_timeout_s: float | None = None,
                 second_sigint_exits: bool = False) -> None:
        self.signals = (signal.SIGTERM, signal.SIGINT) if sigint else (signal.SIGTERM,)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.second_sigint_exits = second_sigint_exits
        self.at: float | None = None  # monotonic time of the first signal
        self.signum: int | None = None  # the first signal
        self._requested = False
        self._sigints = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> Preemption:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._requested = True
        if self.at is None:
            self.at, self.signum = time.monotonic(), signum
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1 and self.second_sigint_exits:
                with contextlib.suppress(OSError):
                    os.write(2, b"SIGINT again: stopping now, without the final checkpoint\n")
                os._exit(EXIT_INTERRUPTED)

    def preempted(self) -> bool:
        """A signal arrived (in this process) since the handlers were installed."""
        return self._requested

    def any_rank(self, group: Any = None) -> bool:
        """Whether a signal reached any rank of the process group `group` (default: the default group; without
        one, this process): a collective, so call it on every rank at the same point of every step, and every
        rank stops at the same step."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return self._requested
        cuda = dist.get_backend(group) == "nccl"
        flag = torch.tensor([1 if self._requested else 0], device="cuda" if cuda else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    @property
    def signal_name(self) -> str | None:
        """"SIGTERM" or "SIGINT": the first signal this process got; None before any."""
        return signal.Signals(self.signum).name if self.signum is not None else None

    def report(self, step: int, saved: bool, *, elsewhere: str = "SIGTERM") -> None:
        """Log the stop, and how much of the shutdown timeout the final save used (warned above half).
        `elsewhere` names the signal when it reached another rank only (the loop learns it with the flag)."""
        what = "saved checkpoint" if saved else "checkpoint FAILED"
        if self.at is None:
            log.warning("%s: %s at step %d, stopping (the signal reached another rank)", elsewhere, what, step)
            return
        name = self.signal_name
        used = time.monotonic() - self.at
        budget = self.shutdown_timeout_s
        if budget is None:
            log.warning("%s: %s at step %d, stopping (%.1fs after the signal)", name, what, step, used)
            return
        log.warning("%s: %s at step %d, stopping (%.1fs after the signal; torchrun kills workers %gs after "
                    "it)", name, what, step, used, budget)
        if used > 0.5 * budget:
            log.warning("the final checkpoint took %.1fs, more than half of torchrun's --shutdown-timeout (%gs): "
                        "raise it and the pod's terminationGracePeriodSeconds", used, budget)
