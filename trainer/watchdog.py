"""Hang detection inside each worker: a thread that ends the process when a step, or a phase of it, runs past a
bound learnt from the steps before it, after saying which rank and phase it was and dumping every stack.

Usage (trainer/train.py does this on every rank; any loop may, `Watchdog()` takes the default bounds and torchrun's
RANK and LOCAL_RANK):
    wd = Watchdog(cfg.watchdog, rank=env.rank, local_rank=env.local_rank, dump_dir=run_dir / "watchdog")
    wd.start()
    wd.begin_step(step)                        # phase "data"; deadline = now + step_bound()
    wd.phase("forward_backward"); wd.phase("collective"); wd.phase("optimizer")   # same deadline
    wd.end_step(seconds)                       # the step's duration joins the median; phase "metrics"
    with wd.allowance("checkpoint", cfg.watchdog.checkpoint_s):
        ckpt.save(...)
    with wd.allowance("eval", cfg.watchdog.eval_s):
        evaluate(...)
    wd.stop()

The bound of a step (data, forward/backward, the step's collective, optimizer together) is
`min(startup_s, max(floor_s, factor x median of the last `window` step times))`, and `startup_s` for the first
`warmup_steps` steps of each launch (compilation, cold caches, first shard downloads). One deadline for the
whole step, because every rank waits for the slowest one: a rank stuck reading a shard and the ranks waiting
for it in the all-reduce reach their deadlines together (the step's collectives keep the ranks' step starts
within milliseconds), so every rank reports where it was. A blocking checkpoint save and an evaluation get
their own allowances (`checkpoint_s`, `eval_s`); the bookkeeping between steps gets `floor_s`.

When a deadline passes: one line on stderr naming the rank, node, local rank, pid, phase, step, the time spent,
how the bound was derived and where the stacks are; every thread's Python stack (faulthandler.dump_traceback,
all threads) in a file of this rank's own, `dump_dir/watchdog-rank<R>-step<S>-pid<P>.txt` (the trainer's
dump_dir is RUN_DIR/watchdog), after the same line; then `os._exit(EXIT_HUNG)`. A file per rank, because the
ranks behind a hung one fire together and torchrun merges their stderr: dumps written there interleave line by
line and cannot be told apart. Without a dump_dir (or when the file cannot be created) the stacks go to stderr
between `----- rank R: Python stacks of every thread -----` and `----- end of rank R stacks -----`. 124 is the status timeout(1) uses for "timed out"; torchrun treats any non-zero exit as
a failed worker and restarts the group (within --max-restarts), and every rank resumes from the newest
checkpoint. Nothing else runs on the way out: the process may be stuck anywhere, and os._exit cannot block on
a lock the stuck thread holds. The line and the dump go straight to file descriptor 2 for the same reason.

Why a Python thread and not what the libraries offer (they are used where they fit):
- `faulthandler.dump_traceback_later(timeout, exit=True)` dumps and exits from a C thread, but it is armed
  with one fixed timeout, always exits with status 1 and cannot say which phase or step it caught, and
  re-arming it starts a new OS thread each time. Its dumping half (`faulthandler.dump_traceback`) is used.
- torchelastic's expiration timers (`torch.distributed.elastic.timer`) are served by the agent and SIGKILL
  the worker: no stacks, and a worker started without torchrun has no server.
- NCCL's own watchdog covers only NCCL collectives, on GPUs, with one timeout per process group.
The thread needs the GIL to run; every wait the trainer can hang in (gloo and NCCL collectives, socket and
file reads, `time.sleep`) releases it. If a C extension ever held it forever, the process-group timeout
below (NCCL's watchdog and heartbeat monitor are C++ threads) is the backstop.

Consistency with the process group and NCCL: a collective must not time out before the watchdog has had its
say, so the default process group's timeout is `collective_timeout_s(cfg)` (the largest bound a step or an
evaluation can get, plus a margin) and the checkpoint group's is `checkpoint_timeout_s(cfg)`.
`gpu_train.jobs.launch.nccl_env()` is what the launcher and the JobSet put in the environment (torch 2.13 names, from
torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp and FlightRecorder.hpp): tear the process down on a
collective error or timeout without a possibly hanging communicator abort (TORCH_NCCL_ASYNC_ERROR_HANDLING=3,
torch's own default made explicit), keep the flight recorder's ring buffer (TORCH_FR_BUFFER_SIZE, which
2.13 prefers to the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE) and dump it on a timeout
(TORCH_NCCL_DUMP_ON_TIMEOUT, which needs both), and keep the heartbeat monitor on
(TORCH_NCCL_ENABLE_MONITORING). The heartbeat timeout follows the process-group timeout
(`nccl_heartbeat_s(cfg)`) and is set by the worker itself, since it depends on the settings.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_train.spec.errors import EXIT_HUNG

if TYPE_CHECKING:
    from gpu_train.spec.trainer_config import WatchdogConfig

MARGIN_S = 60.0  # what a collective's timeout adds to the watchdog's largest bound
STEP_PHASES = ("data", "forward_backward", "collective", "optimizer")  # share the step's deadline


def collective_timeout_s(cfg: WatchdogConfig) -> float:
    """Timeout of the default process group: longer than any bound a step or an evaluation gets."""
    return max(cfg.startup_s, cfg.eval_s) + MARGIN_S


def checkpoint_timeout_s(cfg: WatchdogConfig) -> float:
    """Timeout of the checkpoint group (its collectives run inside a save): longer than a save's allowance."""
    return cfg.checkpoint_s + MARGIN_S


def nccl_heartbeat_s(cfg: WatchdogConfig) -> int:
    """TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: NCCL's monitor gives up no earlier than a collective would time out."""
    return int(collective_timeout_s(cfg))


def step_bound(times: list[float], done: int, cfg: WatchdogConfig) -> tuple[float, str]:
    """(seconds a step may take, how that was derived) after `done` steps of this launch with these durations."""
    if done < max(1, cfg.warmup_steps) or not times:
        return cfg.startup_s, f"watchdog.startup_s, one of the first {max(1, cfg.warmup_steps)} steps of this launch"
    median = statistics.median(times)
    bound = min(cfg.startup_s, max(cfg.floor_s, cfg.factor * median))
    return bound, (f"max(watchdog.floor_s {cfg.floor_s:g}s, {cfg.factor:g} x median {median:.3f}s of the last "
                   f"{len(times)} steps), at most watchdog.startup_s {cfg.startup_s:g}s")


def _default_on_hang() -> None:
    os._exit(EXIT_HUNG)


class Watchdog:
    """One per worker process; every method is cheap (a lock and a few assignments) and may be called often."""

    def __init__(self, cfg: WatchdogConfig | None = None, *, rank: int | None = None, local_rank: int | None = None,
                 on_hang: Callable[[], None] = _default_on_hang, poll_s: float | None = None,
                 dump_dir: Path | str | None = None) -> None:
        """`cfg`: the bounds (gpu_train.spec.trainer_config.WatchdogConfig, a plain dataclass; None = its
        defaults); `rank` and `local_rank`: None reads torchrun's RANK and LOCAL_RANK (0 without them); `dump_dir`:
        where a fired watchdog writes this rank's stacks (None = stderr); `on_hang`: what ends the process."""
        if cfg is None:
            from gpu_train.spec.trainer_config import WatchdogConfig

            cfg = WatchdogConfig()
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None  # where this rank's stack dump goes when it fires (module docstring)
        self.dump_path: Path | None = None  # the file written, once fired
        self.host = socket.gethostname()
        self._on_hang = on_hang
        # Fire within a tenth of the smallest bound after the deadline, at least every second.
        self.poll_s = poll_s if poll_s is not None else min(1.0, cfg.floor_s / 10)
        self._times: deque[float] = deque(maxlen=cfg.window)
        self._done = 0
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._step = 0
        self._started = 0.0  # when the current deadline's clock started (the step's start for its phases)
        self._deadline: float | None = None
        self._step_started = 0.0
        self._step_deadline = 0.0
        self._step_why = ""
        self._why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired: str | None = None  # the message, once fired

    # -------------------------------------------------------------------------------------------- loop side
    def begin_step(self, step: int) -> None:
        """Step `step` (1-based, the one about to run) starts now, in phase "data"."""
        bound, why = step_bound(list(self._times), self._done, self.cfg)
        now = time.monotonic()
        with self._lock:
            self._step, self._step_started, self._step_deadline, self._step_why = step, now, now + bound, why
            self._phase, self._started, self._deadline, self._why = "data", now, now + bound, why

    def phase(self, name: str) -> None:
        """Now in `name`, a phase of the current step: same deadline as the step."""
        with self._lock:
            self._phase, self._started = name, self._step_started
            self._deadline, self._why = self._step_deadline, self._step_why

    def end_step(self, seconds: float) -> None:
        """The step's own work took `seconds` (not counting a checkpoint or an evaluation after it)."""
        self._times.append(seconds)
        self._done += 1
        self._set("metrics", self.cfg.floor_s, "watchdog.floor_s, bookkeeping between steps")

    @contextlib.contextmanager
    def allowance(self, name: str, seconds: float, why: str = "") -> Iterator[None]:
        """A phase with its own allowance (a checkpoint save, an evaluation); then back to bookkeeping."""
        self._set(name, seconds, why or f"watchdog.{name}_s")
        try:
            yield
        finally:
            self._set("metrics", self.cfg.floor_s, "watchdog.floor_s, bookkeeping between steps")

    def disarm(self) -> None:
        with self._lock:
            self._phase, self._deadline = None, None

    def _set(self, name: str, seconds: float, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._phase, self._started, self._deadline, self._why = name, now, now + seconds, why

    # -------------------------------------------------------------------------------------------- thread
    def start(self) -> None:
        if not self.cfg.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                deadline, phase = self._deadline, self._phase
            if deadline is None or phase is None or time.monotonic() < deadline:
                continue
            self._fire()
            return

    def _fire(self) -> None:
        now = time.monotonic()
        with self._lock:
            phase, step, why, started = self._phase, self._step, self._why, self._started
            bound = (self._deadline or now) - started
        where = f"step {step}" if phase in STEP_PHASES else f"after step {step}"
        head = (f"watchdog: rank {self.rank} (local rank {self.local_rank} on {self.host}, pid {os.getpid()}) hung in "
                f"phase '{phase}' ({where}): {now - started:.1f}s, bound {bound:.1f}s = {why}")
        tail = f"exiting {EXIT_HUNG} so that torchrun restarts the group from the newest checkpoint"
        fd = self._open_dump(step)
        if fd is not None:
            self.fired = f"{head}; every thread's stack is in {self.dump_path}; {tail}"
            _write(f"{self.fired}\n", fd)
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(file=fd, all_threads=True)
            with contextlib.suppress(OSError):
                os.close(fd)
        else:
            self.fired = f"{head}; every thread's stack follows; {tail}"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()) + f",{int(time.time() * 1000) % 1000:03d}"
        _write(f"{stamp} [rank{self.rank}] CRITICAL trainer.watchdog: {self.fired}\n")
        if fd is None:
            _write(f"----- rank {self.rank}: Python stacks of every thread -----\n")
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
            _write(f"----- end of rank {self.rank} stacks -----\n")
        self._on_hang()

    def _open_dump(self, step: int) -> int | None:
        """This rank's dump file, created; None without a dump_dir or when it cannot be created."""
        if self.dump_dir is None:
            return None
        path = self.dump_dir / f"watchdog-rank{self.rank}-step{step}-pid{os.getpid()}.txt"
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError:
            return None
        self.dump_path = path
        return fd


def _write(text: str, fd: int = 2) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, text.encode(errors="replace"))
